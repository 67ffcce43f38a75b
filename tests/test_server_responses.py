"""OpenAI's Responses API (`POST /v1/responses`) over a running server: an answer is the one chat
gives for the same conversation (text, usage, the token limit as `incomplete`), its input items are
the chat messages they amount to, streamed events add up to the whole response, function calls,
reasoning and structured outputs come back as their own items, and every field forerun cannot honour
is refused by name, as the Responses body names it."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from test_server import NAME, Served
from test_server_api import AUTH, post

from forerun.api import LLM
from forerun.serve import responses_api
from forerun.serve.schemas import ResponsesRequest

FLIP = {"type": "function", "name": "flip", "parameters": {"type": "object", "properties": {}}}
CALL_TEXT = '<tool_call>\n{"name": "flip", "arguments": {}}\n</tool_call>'
CHAT_FLIP = {"type": "function", "function": {k: v for k, v in FLIP.items() if k != "type"}}


@pytest.fixture(scope="module")
def served(target_tok):
    s = Served(LLM(target_tok), reasoning_parser="qwen3")
    yield s
    s.stop()


def respond(served, body: dict, status: int = 200) -> dict:
    r = httpx.post(served.url + "/v1/responses", json={"model": NAME, **body}, headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def events(served, body: dict, path: str = "/v1/responses") -> list[dict]:
    """The streamed events' data, each checked against its `event:` line (Responses' and Anthropic's
    streams name each event so)."""
    out = []
    body = {"model": NAME, **body, "stream": True}
    with httpx.stream("POST", served.url + path, json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def forced(text: str) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}}


def texts(response: dict) -> list[tuple[str, str]]:
    """(item type, its text or call) for each output item."""
    out = []
    for item in response["output"]:
        if item["type"] == "message":
            out.append(("message", "".join(part["text"] for part in item["content"])))
        elif item["type"] == "reasoning":
            out.append(("reasoning", "".join(part["text"] for part in item["content"])))
        else:
            out.append(("function_call", f"{item['name']}({item['arguments']})"))
    return out


def test_an_answer_is_chats_answer_to_the_same_conversation(served) -> None:
    body = {"input": "hello there", "instructions": "be brief", "max_output_tokens": 12, "temperature": 0}
    got = respond(served, body)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    want = post(served, {"model": NAME, "messages": chat, "max_tokens": 12, "temperature": 0}, "/v1/chat/completions")
    assert texts(got) == [("message", want["choices"][0]["message"]["content"])]
    assert got["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    assert got["usage"]["output_tokens"] == want["usage"]["completion_tokens"]
    assert got["usage"]["total_tokens"] == want["usage"]["total_tokens"]
    assert (got["object"], got["model"], got["id"][:5], got["store"]) == ("response", NAME, "resp_", True)
    assert (got["instructions"], got["max_output_tokens"], got["temperature"]) == ("be brief", 12, 0)
    # the token limit reached: incomplete, as OpenAI says it; an answer that ends: completed
    ended = respond(served, {"input": "x", "max_output_tokens": 40, **forced("short.")})
    assert (ended["status"], ended["incomplete_details"], texts(ended)) == ("completed", None, [("message", "short.")])
    cut = respond(served, {"input": "x", "max_output_tokens": 3, **forced("a longer answer")})
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert cut["usage"]["output_tokens"] == 3
    assert cut["output"][0]["status"] == "incomplete"  # the message the limit cut
    streamed = events(served, {"input": "x", "max_output_tokens": 3, **forced("a longer answer")})
    assert streamed[-1]["type"] == "response.incomplete" and streamed[-1]["response"]["output"] == [
        {**cut["output"][0], "id": streamed[-1]["response"]["output"][0]["id"]}
    ]


def test_input_items_are_the_chat_messages_they_amount_to(served) -> None:
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "flip "}, {"type": "input_text", "text": "it"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "flip",
            "arguments": "{}",
            "id": "fc_1",
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "heads"},
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": "It came up heads."}],
            "id": "msg_1",
            "status": "completed",
        },
        {"role": "user", "content": "again"},
    ]
    chat = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "flip it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "flip", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "heads"},
        {"role": "assistant", "content": "It came up heads."},
        {"role": "user", "content": "again"},
    ]
    assert responses_api.messages(items, None) == chat
    got = respond(served, {"input": items, "tools": [FLIP], "max_output_tokens": 1})["usage"]["input_tokens"]
    tokens = post(served, {"model": NAME, "messages": chat, "tools": [CHAT_FLIP]}, "/tokenize")["count"]
    assert got == tokens
    # a null type is a message; a call without arguments has none; reasoning items in a row join
    loose = [
        {"type": None, "role": "user", "content": "a"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "y"}]},
        {"type": "function_call", "call_id": "c", "name": "flip", "arguments": ""},
    ]
    assert responses_api.messages(loose, None)[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "flip", "arguments": "{}"}}],
        "reasoning_content": "xy",
    }
    # a call joins the assistant's text before it
    joined = responses_api.messages([{"role": "assistant", "content": "let me"}, items[3]], "be kind")
    assert joined[1] == {"role": "assistant", "content": "let me", "tool_calls": chat[2]["tool_calls"]}


def test_reasoning_sent_back_reaches_the_template_in_chat_and_in_responses(served) -> None:
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]

    def count(messages: list[dict]) -> int:
        return post(served, {"model": NAME, "messages": messages}, "/tokenize")["count"]

    bare = count(turns)
    for name in ("reasoning_content", "reasoning"):  # vLLM's name and its newer one
        assert count([turns[0], {**turns[1], name: "xyz"}, turns[2]]) == bare + len("<think>xyz</think>")
    assert count([turns[0], {**turns[1], "reasoning_content": None, "reasoning": ""}, turns[2]]) == bare
    assert count([turns[0], {**turns[1], "reasoning": "xyz", "reasoning_content": "xyz"}, turns[2]]) == bare + 18
    both = {"model": NAME, "messages": [turns[0], {**turns[1], "reasoning": "x", "reasoning_content": "y"}]}
    r = httpx.post(served.url + "/v1/chat/completions", json=both, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "differ" in r.json()["error"]["message"]
    # a Responses reasoning item goes to the assistant turn after it
    items = [
        turns[0],
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "xyz"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        turns[2],
    ]
    assert responses_api.messages(items, None)[1] == {"role": "assistant", "content": "b", "reasoning_content": "xyz"}
    used = respond(served, {"input": items, "max_output_tokens": 1})["usage"]["input_tokens"]
    assert used == bare + len("<think>xyz</think>")
    # one that no assistant turn follows is dropped
    assert responses_api.messages([turns[0], items[1], turns[2]], None) == [turns[0], turns[2]]


@pytest.mark.parametrize(
    "text",
    [
        "plain words, then more",
        "<think>weigh it</think>the answer",
        '<think>flip it</think><tool_call>\n{"name": "flip", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "flip", "arguments": {}}\n</tool_call>',
        "",  # no text at all: one empty message, as the whole response gives it
        "<think>only a thought</think>",  # reasoning alone: no message, as OpenAI gives it
    ],
)
def test_streamed_events_add_up_to_the_whole_response(served, text) -> None:
    body = {"input": "go", "tools": [FLIP], "max_output_tokens": 200, "top_logprobs": 1, **forced(text)}
    if not text:  # the end of the turn first
        body = {"input": "go", "temperature": 0, "logit_bias": {str(served.llm.tokenizer.hf.eos_token_id): 100}}
    whole = respond(served, body)
    seen = events(served, body)
    kinds = [e["type"] for e in seen]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
    final = seen[-1]["response"]
    assert texts(final) == texts(whole) and final["usage"] == whole["usage"]
    # a message's logprobs are its own text's tokens, whatever was read apart, whole and streamed alike
    for got, want in zip(final["output"], whole["output"]):
        if got["type"] == "message":
            assert got["content"][0]["logprobs"] == want["content"][0]["logprobs"]
            assert "".join(e["token"] for e in got["content"][0]["logprobs"]) == got["content"][0]["text"]
    # each item opens, takes its deltas and closes in order, as the final response lists it
    added = [e["item"]["type"] for e in seen if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in seen if e["type"] == "response.output_item.done"]
    assert added == [item["type"] for item in final["output"]] and done == final["output"]
    for item in final["output"]:
        mine = [e for e in seen if e.get("item_id") == item["id"]]
        if item["type"] == "message":
            assert (
                "".join(e["delta"] for e in mine if e["type"] == "response.output_text.delta")
                == texts({"output": [item]})[0][1]
            )
        elif item["type"] == "reasoning":
            assert (
                "".join(e["delta"] for e in mine if e["type"] == "response.reasoning_text.delta")
                == item["content"][0]["text"]
            )
        else:
            assert [e["arguments"] for e in mine if e["type"] == "response.function_call_arguments.done"] == [
                item["arguments"]
            ]


def test_calls_reasoning_and_text_come_back_as_their_own_items(served) -> None:
    answer = respond(
        served,
        {
            "input": "go",
            "tools": [FLIP],
            "max_output_tokens": 200,
            **forced('<think>flip it</think><tool_call>\n{"name": "flip", "arguments": {}}\n</tool_call>'),
        },
    )
    assert texts(answer) == [("reasoning", "flip it"), ("function_call", "flip({})")]
    call = answer["output"][1]
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_") and call["status"] == "completed"
    assert answer["usage"]["output_tokens_details"]["reasoning_tokens"] == len(
        "flip it"
    )  # the tiny tokenizer: a character a token
    # the call's result sent back as input answers on
    follow = [
        {"type": "function_call", "call_id": call["call_id"], "name": "flip", "arguments": "{}"},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "heads"},
    ]
    assert respond(served, {"input": follow, "tools": [FLIP], "max_output_tokens": 4})["output"][0]["type"] == "message"
    # a named function forces its call
    named = respond(
        served,
        {"input": "go", "tools": [FLIP], "tool_choice": {"type": "function", "name": "flip"}, "max_output_tokens": 60}
        | {"temperature": 0},  # sampled, a call's free arguments may run past the limit
    )
    assert [item["type"] for item in named["output"]] == ["function_call"] and named["output"][0]["name"] == "flip"


def test_text_format_asks_for_json_and_top_logprobs_give_each_tokens(served) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "count", "schema": schema, "strict": True}}
    compact = {str(i): -100 for i in served.llm.tokenizer.encode(" \n")}  # the tiny model pads JSON with whitespace
    answer = respond(
        served, {"input": "count", "text": fmt, "max_output_tokens": 40, "temperature": 0, "logit_bias": compact}
    )
    assert set(json.loads(texts(answer)[0][1])) == {"n"} and answer["text"] == fmt
    scored = respond(served, {"input": "hi", "top_logprobs": 2, "max_output_tokens": 5, "temperature": 0})
    part = scored["output"][0]["content"][0]
    assert len(part["logprobs"]) == scored["usage"]["output_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in part["logprobs"])
    assert "".join(entry["token"] for entry in part["logprobs"]) == part["text"]


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": "x", "background": True}, "background", "foreground"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "no hosted tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
            "text only",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
            "input[0].arguments",
            "JSON object",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "function_call_output"),
        ({"input": [{"role": "user", "content": "x", "colour": 1}]}, "input[0].colour", "unknown field"),
        ({"input": []}, "input", "non-empty"),
        ({"input": "x", "truncation": "auto"}, "truncation", "refused, not cut"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "output_text.logprobs"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "enable_thinking"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format", "json_schema"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"input": "x", "max_tokens": 5}, "max_tokens", "unknown field"),
        ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "required"),
        ({"input": "x", "temperature": "hot"}, "temperature", "temperature"),
        ({"input": "x", "stream": "yes"}, "stream", "stream"),
        ({"input": [{"type": ["message"], "role": "user", "content": "x"}]}, "input[0]", "message"),
        ({"input": [{"type": {}, "role": "user", "content": "x"}]}, "input[0]", "message"),
        ({"input": "x", "tools": [{"type": "function", "name": "no spaces"}]}, "tools", "tools[0].name"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "developer"),
        ({"input": "x", "instructions": ["a"]}, "instructions", "a string"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_the_responses_name(served, body, param, words) -> None:
    error = respond(served, body, 400)["error"]
    assert error["param"] == param and words in error["message"], error


def test_neutral_settings_are_taken(served) -> None:
    body = {
        "input": "x",
        "max_output_tokens": 2,
        "store": True,
        "reasoning": {"effort": None},
        "truncation": "disabled",
        "include": ["message.output_text.logprobs"],
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "stream_options": {"include_obfuscation": False},
        "previous_response_id": None,
        "background": False,
    }
    got = respond(served, body)
    assert got["metadata"] == {"k": "v"} and got["store"] is True
    assert len(got["output"][0]["content"][0]["logprobs"]) == got["usage"]["output_tokens"]


def test_a_stored_response_continues_as_the_conversation_it_ends(served) -> None:
    """store (the default) keeps a response with its conversation: previous_response_id puts it before
    the new input (its instructions left out, as OpenAI leaves them), GET reads it back, DELETE forgets it."""
    first = respond(served, {**forced_call_body(), "instructions": "be brief"})
    assert first["store"] is True and texts(first) == [("function_call", "flip({})")]
    call_id = first["output"][0]["call_id"]
    result = [{"type": "function_call_output", "call_id": call_id, "output": "heads"}]
    second = respond(
        served,
        {"input": result, "previous_response_id": first["id"], "tools": [FLIP], "max_output_tokens": 9}
        | forced("Heads."),
    )
    assert second["previous_response_id"] == first["id"]
    whole = [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": call_id, "name": "flip", "arguments": "{}"},
        *result,
    ]
    sent = respond(served, {"input": whole, "tools": [FLIP], "max_output_tokens": 9, "store": False} | forced("x"))
    assert second["usage"]["input_tokens"] == sent["usage"]["input_tokens"]  # the same prompt, sent or stored
    # a chain goes on from the last: its conversation holds every turn before
    third = respond(served, {"input": "again", "previous_response_id": second["id"], "max_output_tokens": 2})
    again = [*whole, {"role": "assistant", "content": "Heads."}, {"role": "user", "content": "again"}]
    assert texts(second) == [("message", "Heads.")]
    assert (
        third["usage"]["input_tokens"]
        == respond(served, {"input": again, "max_output_tokens": 2})["usage"]["input_tokens"]
    )
    # read back, streamed ones too; forgotten on DELETE; store false keeps nothing
    assert httpx.get(served.url + f"/v1/responses/{first['id']}", headers=AUTH).json() == first
    final = events(served, {"input": "x", "max_output_tokens": 3})[-1]["response"]
    assert httpx.get(served.url + f"/v1/responses/{final['id']}", headers=AUTH).json() == final
    gone = httpx.delete(served.url + f"/v1/responses/{final['id']}", headers=AUTH)
    assert gone.json() == {"id": final["id"], "object": "response", "deleted": True}
    assert httpx.get(served.url + f"/v1/responses/{final['id']}", headers=AUTH).status_code == 404
    missing = respond(served, {"input": "x", "previous_response_id": sent["id"]}, 400)["error"]  # store false
    assert (missing["param"], missing["code"]) == ("previous_response_id", "previous_response_not_found")
    # input may be left out after a stored response: the conversation as it stands, answered again
    bare = respond(served, {"previous_response_id": second["id"], "max_output_tokens": 2})
    assert (
        bare["usage"]["input_tokens"]
        == respond(served, {"input": again[:-1], "max_output_tokens": 2})["usage"]["input_tokens"]
    )


def test_the_store_forgets_the_oldest_past_its_bounds() -> None:
    from forerun.serve.response_store import ResponseStore

    store = ResponseStore(max_responses=2, max_chars=10**6)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    assert store.get("r0") is None and store.get("r1").messages == [{"role": "user", "content": "1"}]
    small = ResponseStore(max_responses=10, max_chars=250)  # about 100 characters each
    for i in range(3):
        small.put({"id": f"r{i}"}, [{"role": "user", "content": "x" * 60}])
    assert [small.get(f"r{i}") is not None for i in range(3)] == [False, True, True]
    assert small.delete("r2") and not small.delete("r2")


def forced_call_body() -> dict:
    return {"input": "go", "tools": [FLIP], "max_output_tokens": 200, **forced(CALL_TEXT)}


def test_the_schema_lists_the_fields_the_route_takes() -> None:
    assert set(ResponsesRequest.model_fields) == responses_api.FIELDS


def test_openais_client_reads_the_response_and_follows_the_stream(served) -> None:
    client = served.client()
    body = {"model": NAME, "input": "go", "tools": [FLIP], "max_output_tokens": 200}
    text = '<think>weigh it</think>heads, <tool_call>\n{"name": "flip", "arguments": {}}\n</tool_call>'
    extra = {"extra_body": forced(text)}
    whole = client.responses.create(**body, **extra)
    assert whole.output_text == "heads," and [item.type for item in whole.output] == [
        "reasoning",
        "message",
        "function_call",
    ]
    # the client's own stream reader checks each event against the items it has seen
    with client.responses.stream(**body, **extra) as events:
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        final = events.get_final_response()
    assert "".join(deltas) == "heads," and final.output_text == "heads,"
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[2].name == "flip" and final.usage.output_tokens == whole.usage.output_tokens
    # the client's stored-response calls: continue, read back, delete
    call = whole.output[2]
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "heads"}]
    follow = client.responses.create(model=NAME, input=result, previous_response_id=whole.id, max_output_tokens=3)
    sent = [
        {"role": "user", "content": "go"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "weigh it"}]},
        {"role": "assistant", "content": "heads,"},
        {"type": "function_call", "call_id": call.call_id, "name": "flip", "arguments": "{}"},
        *result,
    ]
    again = client.responses.create(model=NAME, input=sent, max_output_tokens=3, store=False)
    assert follow.previous_response_id == whole.id and follow.usage.input_tokens == again.usage.input_tokens
    assert client.responses.retrieve(whole.id).output_text == "heads,"
    client.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)


def test_a_failure_mid_answer_ends_the_stream_with_response_failed(target_tok) -> None:
    from test_server import FlakyEngine

    llm = LLM(target_tok)
    opening = llm.tokenizer.apply_chat([{"role": "user", "content": "x"}])[0]  # every chat prompt's first token
    failing = Served(llm, new_engine=lambda: FlakyEngine(llm, opening))
    try:
        seen = events(failing, {"input": "go", "max_output_tokens": 10, "temperature": 0})
        kinds = [e["type"] for e in seen]
        assert kinds[-2:] == ["error", "response.failed"] and "injected failure" in seen[-2]["message"]
        assert (
            seen[-1]["response"]["status"] == "failed"
            and "injected failure" in seen[-1]["response"]["error"]["message"]
        )
        failed = failing.client().responses.retrieve(seen[-1]["response"]["id"])  # a failed one is kept, to read
        assert failed.status == "failed"
        again = {"model": NAME, "input": "x", "previous_response_id": failed.id}
        r = httpx.post(failing.url + "/v1/responses", json=again, headers=AUTH, timeout=60)
        assert r.status_code == 400 and "cannot be continued" in r.json()["error"]["message"]
        r = httpx.post(failing.url + "/v1/responses", json={"model": NAME, "input": "go"}, headers=AUTH, timeout=60)
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    finally:
        failing.stop()


def count(served, path: str, body: dict, status: int = 200, headers: dict | None = None) -> dict:
    r = httpx.post(served.url + path, json=body, headers=AUTH if headers is None else headers, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


@pytest.mark.parametrize("prefix", ["/v1", ""])
def test_input_tokens_counts_the_prompt_the_request_would_run(served, prefix) -> None:
    """OpenAI's /v1/responses/input_tokens and llama.cpp's /v1/chat/completions/input_tokens (and their
    names without /v1): the prompt tokens the same body's answer reports as its usage."""
    body = {"input": "count me", "instructions": "be brief", "tools": [FLIP]}
    counted = count(served, prefix + "/responses/input_tokens", body)  # model may be left out, or null
    assert count(served, prefix + "/responses/input_tokens", {**body, "model": None}) == counted
    answered = respond(served, {**body, "max_output_tokens": 1, "store": False})["usage"]["input_tokens"]
    assert counted == {"object": "response.input_tokens", "input_tokens": answered}
    chat = {"messages": [{"role": "user", "content": "count me too"}], "tools": [CHAT_FLIP]}
    counted = count(served, prefix + "/chat/completions/input_tokens", {**chat, "model": NAME})
    usage = post(served, {**chat, "model": NAME, "max_tokens": 1}, "/v1/chat/completions")["usage"]
    assert counted == {"object": "response.input_tokens", "input_tokens": usage["prompt_tokens"]}
    # a stored response's conversation counts as it would run after it
    first = respond(served, {"input": "go", "max_output_tokens": 2})
    later = {"input": "again", "previous_response_id": first["id"]}
    assert (
        count(served, prefix + "/responses/input_tokens", later)["input_tokens"]
        == (respond(served, {**later, "max_output_tokens": 1, "store": False})["usage"]["input_tokens"])
    )


def test_input_tokens_refuses_what_the_request_would_refuse_by_its_names(served) -> None:
    tool = {**FLIP, "parameters": "none"}
    bad = count(served, "/v1/responses/input_tokens", {"input": "x", "tools": [tool]}, 400)["error"]
    assert bad == respond(served, {"input": "x", "tools": [tool]}, 400)["error"]
    assert bad["message"].startswith("tools[0].parameters ")  # the Responses shape, not chat's tools[0].function
    assert count(served, "/v1/responses/input_tokens", {"input": "x", "colour": 1}, 400)["error"]["param"] == "colour"
    assert count(served, "/v1/chat/completions/input_tokens", {"messages": "x"}, 400)["error"]["param"] == "messages"
    assert count(served, "/v1/chat/completions/input_tokens", {"messages": [], "model": "other"}, 404)["error"]
    assert count(served, "/v1/responses/input_tokens", {"input": "x"}, 401, headers={})["error"]["code"] == (
        "invalid_api_key"
    )
    paths = httpx.get(served.url + "/openapi.json").json()["paths"]
    assert {"/v1/responses/input_tokens", "/v1/chat/completions/input_tokens"} <= set(paths)
    assert not {"/responses", "/responses/input_tokens", "/chat/completions/input_tokens"} & set(paths)
