"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over a running
server: an answer is the one chat gives for the same conversation, its content blocks are the chat
messages they amount to, streamed events add up to the whole message, tool use, thinking and stop
sequences come back as Anthropic gives them, errors come in Anthropic's shape naming the Messages
field, and anthropic's own client reads the answers and follows the stream."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from test_server import CONTEXT, KEY, NAME, Served
from test_server_api import AUTH, post
from test_server_responses import CALL_TEXT as CALL
from test_server_responses import events as typed_events
from test_server_responses import forced

from forerun.api import LLM
from forerun.serve import messages_api
from forerun.serve.schemas import CountTokensRequest, MessagesRequest

FLIP = {"name": "flip", "description": "flip a coin", "input_schema": {"type": "object", "properties": {}}}
CHAT_FLIP = {
    "type": "function",
    "function": {"name": "flip", "parameters": FLIP["input_schema"], "description": "flip a coin"},
}


@pytest.fixture(scope="module")
def served(target_tok):
    s = Served(LLM(target_tok), reasoning_parser="qwen3")
    yield s
    s.stop()


def ask(served, body: dict, status: int = 200, path: str = "/v1/messages", headers: dict = AUTH) -> dict:
    r = httpx.post(served.url + path, json={"model": NAME, **body}, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def events(served, body: dict) -> list[dict]:
    return typed_events(served, body, "/v1/messages")


def blocks(message: dict) -> list[tuple[str, object]]:
    """(block type, its text or its call) for each content block."""
    out = []
    for block in message["content"]:
        if block["type"] == "tool_use":
            out.append(("tool_use", (block["name"], block["input"])))
        else:
            out.append((block["type"], block.get("text", block.get("thinking"))))
    return out


def test_an_answer_is_chats_answer_to_the_same_conversation(served) -> None:
    body = {"system": "be brief", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12}
    got = ask(served, {**body, "temperature": 0})
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    want = post(served, {"model": NAME, "messages": chat, "max_tokens": 12, "temperature": 0}, "/v1/chat/completions")
    assert blocks(got) == [("text", want["choices"][0]["message"]["content"])]
    assert (got["type"], got["role"], got["model"], got["id"][:4]) == ("message", "assistant", NAME, "msg_")
    usage = got["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == want["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == want["usage"]["completion_tokens"]
    # prompt tokens from the prefix cache (the native layers' models keep one) are cache reads
    reused = {"prompt_tokens": 42, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 40}}
    assert messages_api.usage(reused) == {
        "input_tokens": 2,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 40,
        "output_tokens": 3,
    }
    # why it stopped: the end of the turn, the token limit, a stop sequence (named)
    one = [{"role": "user", "content": "x"}]
    ended = ask(served, {"messages": one, "max_tokens": 40, **forced("short.")})
    assert (ended["stop_reason"], ended["stop_sequence"], blocks(ended)) == ("end_turn", None, [("text", "short.")])
    cut = ask(served, {"messages": one, "max_tokens": 3, **forced("a longer answer")})
    assert (cut["stop_reason"], cut["usage"]["output_tokens"]) == ("max_tokens", 3)
    stopped = ask(served, {"messages": one, "max_tokens": 40, "stop_sequences": ["ong"], **forced("a longer answer")})
    assert (stopped["stop_reason"], stopped["stop_sequence"], blocks(stopped)) == (
        "stop_sequence",
        "ong",
        [("text", "a l")],
    )


def test_content_blocks_are_the_chat_messages_they_amount_to(served) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "flip "}, {"type": "text", "text": "it"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
                {"type": "text", "text": "Flipping."},
                {"type": "tool_use", "id": "toolu_1", "name": "flip", "input": {"times": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "heads"}]},
                {"type": "text", "text": "again", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    system = [{"type": "text", "text": "rules"}, {"type": "text", "text": " apply", "cache_control": {"type": "x"}}]
    chat = [
        {"role": "system", "content": "rules apply"},
        {"role": "user", "content": "flip it"},
        {
            "role": "assistant",
            "content": "Flipping.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "flip", "arguments": '{"times": 1}'}}
            ],
            "reasoning_content": "use the tool",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "heads"},
        {"role": "user", "content": "again"},
    ]
    got = messages_api.count_body({"model": NAME, "messages": messages, "system": system, "tools": [FLIP]})
    assert got["messages"] == chat and got["tools"] == [CHAT_FLIP]
    counted = ask(served, {"messages": messages, "system": system, "tools": [FLIP]}, path="/v1/messages/count_tokens")
    tokens = post(served, {"model": NAME, "messages": chat, "tools": [CHAT_FLIP]}, "/tokenize")["count"]
    assert counted == {"input_tokens": tokens}
    used = ask(served, {"messages": messages, "system": system, "tools": [FLIP], "max_tokens": 1})["usage"]
    assert used["input_tokens"] + used["cache_read_input_tokens"] == tokens
    # a result alone is a tool turn alone; a result with no content is empty
    alone = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]
    assert messages_api.count_body({"model": NAME, "messages": alone})["messages"] == [
        {"role": "tool", "tool_call_id": "t", "content": ""}
    ]
    # Claude Code's per-request billing stamp is blanked, so its prompts share their prefix
    stamped = "x-anthropic-billing-header: cc_version=2.1; cch=a5145; You are Claude Code."
    read = messages_api.count_body({"model": NAME, "messages": [{"role": "user", "content": "x"}], "system": stamped})
    assert read["messages"][0]["content"] == "x-anthropic-billing-header: cc_version=2.1; cch=; You are Claude Code."
    blocked = [{"type": "text", "text": "First. "}, {"type": "text", "text": stamped}]  # in any system block
    read = messages_api.count_body({"model": NAME, "messages": [{"role": "user", "content": "x"}], "system": blocked})
    assert (
        read["messages"][0]["content"]
        == "First. x-anthropic-billing-header: cc_version=2.1; cch=; You are Claude Code."
    )


def test_the_assistants_last_text_is_continued(served) -> None:
    """Anthropic's prefill: the answer goes on from the assistant's text, which it does not repeat."""
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]}
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]
    want = post(
        served,
        {"model": NAME, "messages": chat, "max_tokens": 8, "temperature": 0, "add_generation_prompt": False}
        | {"continue_final_message": True},
        "/v1/chat/completions",
    )
    got = ask(served, {**body, "max_tokens": 8, "temperature": 0})
    assert blocks(got) == [("text", want["choices"][0]["message"]["content"])]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    continued = post(served, {"model": NAME, "messages": chat, **flags}, "/tokenize")["count"]
    closed = post(served, {"model": NAME, "messages": chat}, "/tokenize")["count"]  # a new turn after it
    assert ask(served, body, path="/v1/messages/count_tokens")["input_tokens"] == continued != closed
    use = {"type": "tool_use", "id": "t", "name": "flip", "input": {}}
    calls = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [use]}]
    error = ask(served, {"messages": calls, "max_tokens": 5}, 400)["error"]
    assert "tool_result" in error["message"]


@pytest.mark.parametrize(
    "text",
    [
        "plain words, then more",
        "<think>weigh it</think>the answer",
        f"<think>flip it</think>{CALL}",
        f"heads, {CALL}",
        f"heads, {CALL} and more",  # text after a call joins the text before it, as the whole answer has it
        f"{CALL}{CALL}",
        "words to a STOP sign",  # stop_sequences ["STOP"]
        "",  # no text at all: one empty text block, as the whole message gives it
        "<think>only a thought</think>",
        None,  # max_tokens 0: the prompt read, nothing answered
    ],
)
def test_streamed_events_add_up_to_the_whole_message(served, text) -> None:
    body = {"messages": [{"role": "user", "content": "go"}], "tools": [FLIP], "max_tokens": 200}
    if text == "":  # the end of the turn first
        eos = served.llm.tokenizer.hf.eos_token_id
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 9, "logit_bias": {str(eos): 100}}
    elif text is None:
        body["max_tokens"] = 0
    else:
        body |= forced(text) | {"stop_sequences": ["STOP"]}
    whole = ask(served, body)
    seen = events(served, body)
    kinds = [e["type"] for e in seen]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    start = seen[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"]
    assert seen[-2]["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}
    assert (whole["stop_sequence"] == "STOP") == ("STOP" in (text or ""))
    assert seen[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    # each block starts, takes its deltas and stops in order, and they add up to the whole message's
    built: list[dict] = []
    for e in seen[2:-2]:
        if e["type"] == "content_block_start":
            assert e["index"] == len(built)
            built.append(dict(e["content_block"]) | {"json": ""})
        elif e["type"] == "content_block_delta":
            block, delta = built[e["index"]], e["delta"]
            assert e["index"] == len(built) - 1
            if delta["type"] == "input_json_delta":
                block["json"] += delta["partial_json"]
            else:
                name = delta["type"].removesuffix("_delta")
                block[name] += delta[name]
        else:
            assert e == {"type": "content_block_stop", "index": len(built) - 1}
    for block in built:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["json"])
        del block["json"]
    assert without_ids(built) == without_ids(whole["content"])


def without_ids(content: list[dict]) -> list[dict]:
    """Content blocks without their calls' ids (new ones each answer)."""
    return [{k: v for k, v in block.items() if k != "id"} for block in content]


def test_tool_use_and_thinking_come_back_as_their_own_blocks(served) -> None:
    go = [{"role": "user", "content": "go"}]
    cold = {"temperature": 0}  # sampled, a call's free arguments may run past the limit
    answer = ask(
        served, {"messages": go, "tools": [FLIP], "max_tokens": 200, **forced(f"<think>flip it</think>{CALL}")}
    )
    assert blocks(answer) == [("thinking", "flip it"), ("tool_use", ("flip", {}))]
    assert answer["stop_reason"] == "tool_use" and answer["content"][0]["signature"] == ""
    call = answer["content"][1]
    # the call's result sent back answers on
    follow = [
        *go,
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "heads"}]},
    ]
    answered = ask(served, {"messages": follow, "tools": [FLIP], "max_tokens": 4})["usage"]
    follow[-1]["content"][0]["content"] = "tails!"  # the result is in the prompt: two characters more
    longer = ask(served, {"messages": follow, "tools": [FLIP], "max_tokens": 4})["usage"]
    assert longer["input_tokens"] == answered["input_tokens"] + 1
    # a named tool forces its call; "any" asks for one; "none" for none
    named = ask(
        served,
        {
            "messages": go,
            "tools": [FLIP],
            "tool_choice": {"type": "tool", "name": "flip"},
            "max_tokens": 60,
            "temperature": 0,
        },
    )
    assert [b["type"] for b in named["content"]] == ["tool_use"] and named["stop_reason"] == "tool_use"
    chosen = messages_api.count_body(
        {
            "model": NAME,
            "messages": go,
            "tools": [FLIP],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        }
    )
    assert (chosen["tool_choice"], chosen["parallel_tool_calls"]) == ("required", False)
    strict = {**FLIP, "input_schema": {**FLIP["input_schema"], "additionalProperties": False}}
    called = ask(
        served,
        {
            "messages": go,
            "tools": [strict],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "max_tokens": 60,
        }
        | cold,
    )
    assert called["stop_reason"] == "tool_use" and blocks(called) == [("tool_use", ("flip", {}))]
    kept = ask(
        served, {"messages": go, "tools": [FLIP], "tool_choice": {"type": "none"}, "max_tokens": 60} | forced(CALL)
    )
    assert blocks(kept) == [("text", CALL)] and kept["stop_reason"] == "end_turn"
    # arguments that JSON cannot hold (NaN) are not a call: the text comes back as text
    nan = CALL.replace("{}", '{"x": NaN}')
    assert blocks(ask(served, {"messages": go, "tools": [FLIP], "max_tokens": 200} | forced(nan))) == [("text", nan)]
    # thinking is the template's enable_thinking
    for kind, enabled in (("disabled", False), ("adaptive", True), ("between_tools", True)):
        read = messages_api.count_body({"model": NAME, "messages": go, "thinking": {"type": kind}})
        assert read["chat_template_kwargs"] == {"enable_thinking": enabled}
    both = {"model": NAME, "messages": go, "max_tokens": 5, "thinking": {"type": "disabled"}}
    both["chat_template_kwargs"] = {"flavour": "x"}  # the template's other variables beside it
    assert messages_api.translate(both).chat["chat_template_kwargs"] == {"flavour": "x", "enable_thinking": False}
    # display "omitted": the thinking block comes back empty, whole and streamed
    hidden = {"messages": go, "max_tokens": 200, "thinking": {"type": "adaptive", "display": "omitted"}}
    hidden |= forced("<think>secret</think>shown")
    assert blocks(ask(served, hidden)) == [("thinking", ""), ("text", "shown")]
    seen = events(served, hidden)
    deltas = [e["delta"] for e in seen if e["type"] == "content_block_delta"]
    assert "".join(d.get("text", "") for d in deltas) == "shown" and all(d["type"] == "text_delta" for d in deltas)
    assert seen[2]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}


def test_output_config_asks_for_json_and_the_service_fields_are_taken(served) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    schema["additionalProperties"] = False
    compact = {str(i): -100 for i in served.llm.tokenizer.encode(" \n")}  # the tiny model pads JSON with whitespace
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 40, "temperature": 0}
    body |= {"logit_bias": compact, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    answer = ask(
        served, body | {"output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}}
    )
    assert set(json.loads(answer["content"][0]["text"])) == {"n"}
    taken = {name: None for name in messages_api.IGNORED} | {"cache_control": {"type": "ephemeral"}, "speed": "fast"}
    taken |= {"inference_geo": "us", "diagnostics": {"previous_message_id": None}, "workspace_id": "w"}
    assert ask(served, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **taken})["type"] == "message"


def headers_without_bearer() -> dict:
    return {"x-api-key": KEY, "anthropic-version": "2023-06-01"}


def test_errors_come_in_anthropics_shape_naming_the_messages_field(served) -> None:
    go = [{"role": "user", "content": "go"}]
    # count_tokens checks its body as a request's, and takes the fields the client sends it
    count = "/v1/messages/count_tokens"
    assert "give tools" in ask(served, {"messages": go, "tool_choice": {"type": "any"}}, 400, count)["error"]["message"]
    assert "model is required" in ask(served, {"messages": go, "model": None}, 400, count)["error"]["message"]
    fields = {"output_config": {"effort": "low"}, "speed": "fast", "workspace_id": "w", "user_profile_id": "u"}
    assert ask(served, {"messages": go, **fields}, path=count)["input_tokens"] > 0
    r = httpx.get(served.url + "/v1/messages", headers=AUTH)  # a route's other refusals too
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error" and r.json()["type"] == "error"
    error = ask(served, {"messages": go}, 400)  # max_tokens left out
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens is required" in error["error"]["message"]
    # a refusal names the Messages field: the block, the stop sequences (chat's check, renamed)
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": 5}]}]
    assert "messages[1].content[0].text" in ask(served, {"messages": two, "max_tokens": 2}, 400)["error"]["message"]
    empty = ask(served, {"messages": go, "max_tokens": 2, "stop_sequences": [""]}, 400)["error"]["message"]
    assert empty.startswith("stop_sequences")
    # max_tokens is a most: past the context's room, the answer stops at the context's end (Claude Code
    # asks 32,000 whatever the model); a prompt that fills the context is refused, naming the messages
    capped = ask(served, {"messages": go, "max_tokens": 10**6, "ignore_eos": True, "temperature": 0})
    assert capped["stop_reason"] == "max_tokens"
    assert capped["usage"]["input_tokens"] + capped["usage"]["output_tokens"] == CONTEXT
    full = ask(served, {"messages": [{"role": "user", "content": "x" * CONTEXT}], "max_tokens": 5}, 400)
    assert "messages" in full["error"]["message"] and "context" in full["error"]["message"]
    chat = {"model": NAME, "messages": go, "max_tokens": 10**6}  # chat's stays a refusal, as vLLM's
    assert httpx.post(served.url + "/v1/chat/completions", json=chat, headers=AUTH).status_code == 400
    wrong = ask(served, {"messages": go, "max_tokens": 2, "model": "claude-x"}, 404)
    assert wrong["error"]["type"] == "not_found_error" and "claude-x" in wrong["error"]["message"]
    # the key in Anthropic's header is taken; a wrong one is refused in Anthropic's shape
    assert ask(served, {"messages": go, "max_tokens": 2}, headers=headers_without_bearer())["type"] == "message"
    denied = ask(served, {"messages": go, "max_tokens": 2}, 401, headers={"x-api-key": "wrong"})
    assert denied["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    "body, words",
    [
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0] must be"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text only"),
        ({"messages": [{"role": "user", "content": "x", "name": "a"}]}, "unknown field 'name'"),
        ({"messages": []}, "non-empty"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools only"),
        ({"tools": [{"name": "f"}]}, "input_schema"),
        ({"tools": [{"name": "no spaces", "input_schema": {}}]}, "tools[0].name"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 9}, "chat_template_kwargs": {"enable_thinking": False}},
            "differ",
        ),
        ({"metadata": {"user_id": 3}}, "metadata.user_id"),
        ({"metadata": {"session": "x"}}, "metadata"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"container": "x"}, "containers"),
        ({"colour": "x"}, "unknown field 'colour'"),
        ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0] must be"),
        ({"max_tokens": None}, "max_tokens is required"),
        ({"max_tokens": -1}, "max_tokens is required"),
        ({"tools": [{"name": "f", "input_schema": None}]}, "input_schema"),
        ({"tool_choice": {"type": "tool", "name": "flip"}}, "give tools"),
        (
            {
                "tools": [FLIP],
                "tool_choice": {"type": "any"},
                "output_config": {"format": {"type": "json_schema", "schema": {}}},
            },
            "give one",
        ),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "frobnicate"}}}},
            "output_config.format",
        ),
        ({"speed": "ludicrous"}, "speed must be one of"),
        ({"cache_control": 5}, "cache_control must be an object"),
        ({"inference_geo": [1]}, "inference_geo must be a string"),
        ({"model": None}, "model is required"),
        ({"thinking": {"type": "enabled", "budget_tokens": 9, "display": "full"}}, "thinking.display"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}
                ]
            },
            "input must be an object",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, "tool_use_id"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(served, body, words) -> None:
    error = ask(served, {"messages": [{"role": "user", "content": "go"}], "max_tokens": 5, **body}, 400)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


def test_the_schemas_list_the_fields_the_routes_take() -> None:
    assert set(MessagesRequest.model_fields) == messages_api.FIELDS
    assert set(CountTokensRequest.model_fields) == messages_api.COUNT_FIELDS


def test_anthropics_client_reads_the_message_and_follows_the_stream(served) -> None:
    client = anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0)
    body = {"model": NAME, "messages": [{"role": "user", "content": "go"}], "tools": [FLIP], "max_tokens": 200}
    extra = {"extra_body": forced(f"<think>weigh it</think>heads, {CALL}")}
    whole = client.messages.create(**body, **extra)
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert (whole.content[1].text, whole.content[2].name, whole.stop_reason) == ("heads,", "flip", "tool_use")
    # the client's own stream reader builds the message from the events
    with client.messages.stream(**body, **extra) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "heads," and final.content[2].id.startswith("call_")
    got, want = final.model_dump(exclude={"id"}), whole.model_dump(exclude={"id"})
    assert without_ids(got.pop("content")) == without_ids(want.pop("content")) and got == want
    counted = client.messages.count_tokens(model=NAME, messages=body["messages"], tools=[FLIP])
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    with pytest.raises(anthropic.NotFoundError, match="claude-x"):  # the client reads Anthropic's error shape
        client.messages.create(model="claude-x", messages=body["messages"], max_tokens=5)
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        client.messages.create(model=NAME, messages=body["messages"], max_tokens=5, stop_sequences=[""])


def test_a_failure_mid_answer_ends_the_stream_with_an_error_event(target_tok) -> None:
    from test_server import FlakyEngine

    llm = LLM(target_tok)
    opening = llm.tokenizer.apply_chat([{"role": "user", "content": "x"}])[0]  # every chat prompt's first token
    failing = Served(llm, new_engine=lambda: FlakyEngine(llm, opening))
    try:
        seen = events(failing, {"messages": [{"role": "user", "content": "go"}], "max_tokens": 10, "temperature": 0})
        assert seen[-1]["type"] == "error" and "injected failure" in seen[-1]["error"]["message"]
        assert seen[-1]["error"]["type"] == "api_error"
        r = httpx.post(
            failing.url + "/v1/messages",
            json={"model": NAME, "messages": [{"role": "user", "content": "go"}], "max_tokens": 5},
            headers=AUTH,
            timeout=60,
        )
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
        assert "injected failure" in r.json()["error"]["message"]
    finally:
        failing.stop()


def test_a_served_model_answers_to_its_aliases(target_tok) -> None:
    """--served-model-name NAME ALIAS...: a client that names its own model (Claude Code's) is
    answered; /v1/models lists each name; an answer names the model as the request did (vLLM's)."""
    from forerun.base.errors import ForerunError
    from forerun.cli import build_parser
    from forerun.commands.serve import server_config

    args = build_parser().parse_args(["serve", "--model", "m", "--served-model-name", "qwen", "claude-x", "qwen"])
    config = server_config(args, 1024)
    assert (config.served_model_name, config.aliases, config.model_names) == (
        "qwen",
        ("claude-x",),
        ("qwen", "claude-x"),
    )
    assert server_config(build_parser().parse_args(["serve", "--model", "m"]), 1024).model_names == ("m",)
    with pytest.raises(ForerunError, match="not empty"):
        server_config(build_parser().parse_args(["serve", "--model", "m", "--served-model-name", ""]), 1024)
    served = Served(LLM(target_tok), aliases=("claude-x", "gpt-y"))
    try:
        go = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 2}
        assert ask(served, {**go, "model": "claude-x"})["model"] == "claude-x"
        chat = post(served, {**go, "model": "gpt-y"}, "/v1/chat/completions")
        assert chat["model"] == "gpt-y"
        assert [m["id"] for m in httpx.get(served.url + "/v1/models", headers=AUTH).json()["data"]] == [
            NAME,
            "claude-x",
            "gpt-y",
        ]
        assert httpx.get(served.url + "/v1/models/gpt-y", headers=AUTH).json()["id"] == "gpt-y"
        wrong = ask(served, {**go, "model": "other"}, 404)["error"]["message"]
        assert f"serves {NAME!r} (also as 'claude-x', 'gpt-y')" in wrong
        counted = ask(served, {"messages": go["messages"], "model": "gpt-y"}, path="/v1/messages/count_tokens")
        assert counted["input_tokens"] > 0
    finally:
        served.stop()
