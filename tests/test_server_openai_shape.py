"""What an OpenAI client meets beyond the fields themselves: a model's own route and the status of a
model not served, the streamed chunks' object names, a completion's default length, the fields a
message may carry, and the schema /openapi.json gives for them."""

from __future__ import annotations

import httpx
import pytest
from test_server import CONTEXT, NAME, Served
from test_server_api import AUTH, post, stream

from forerun.api import LLM


@pytest.fixture(scope="module")
def plain(target_tok):
    s = Served(LLM(target_tok))
    yield s
    s.stop()


def refusal(served, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    r = httpx.post(served.url + path, json=body, headers=AUTH, timeout=60)
    return r.status_code, r.json()["error"]


# --- models --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_model_not_served_is_404_model_not_found(plain, path) -> None:
    body = {"model": "other-model", "prompt": "abc", "messages": [{"role": "user", "content": "hi"}]}
    body.pop("messages" if path == "/v1/completions" else "prompt")
    status, error = refusal(plain, {**body, "max_tokens": 2}, path)
    assert status == 404
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "other-model" in error["message"] and NAME in error["message"]


def test_a_model_by_id_is_its_entry_of_the_list_and_any_other_id_is_404(plain) -> None:
    listed = httpx.get(plain.url + "/v1/models", headers=AUTH).json()["data"]
    one = httpx.get(plain.url + f"/v1/models/{NAME}", headers=AUTH)
    assert one.status_code == 200 and one.json() == listed[0]
    for other in ("other-model", "org/other-model"):  # an id with a slash is an id, not a route
        r = httpx.get(plain.url + f"/v1/models/{other}", headers=AUTH)
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found" and other in r.json()["error"]["message"]
    assert httpx.get(plain.url + f"/v1/models/{NAME}").status_code == 401  # the key, as /v1/models


# --- streamed chunks -----------------------------------------------------------------------------


def test_streamed_chunks_are_named_as_openai_names_them(plain) -> None:
    body = {"model": NAME, "max_tokens": 3, "stream_options": {"include_usage": True}}
    completion = stream(plain, {**body, "prompt": "abc"})
    chat = stream(plain, {**body, "messages": [{"role": "user", "content": "abc"}]}, "/v1/chat/completions")
    assert {c["object"] for c in completion} == {"text_completion"}
    assert {c["object"] for c in chat} == {"chat.completion.chunk"}
    for chunks in (completion, chat):  # include_usage: null usage until the last chunk's
        assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]


# --- a completion's default length ---------------------------------------------------------------


def test_a_completion_without_max_tokens_writes_16_tokens_or_the_room_left(plain) -> None:
    out = post(plain, {"model": NAME, "prompt": "abc", "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 16 and out["choices"][0]["finish_reason"] == "length"
    near_full = "ab" * ((CONTEXT - 5) // 2)  # leaves fewer than 16 tokens of context
    out = post(plain, {"model": NAME, "prompt": near_full, "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == CONTEXT - out["usage"]["prompt_tokens"] < 16


def test_chat_without_max_tokens_runs_past_16(plain) -> None:
    body = {"model": NAME, "messages": [{"role": "user", "content": "abc"}], "ignore_eos": True}
    out = post(plain, body, "/v1/chat/completions")
    assert out["usage"]["completion_tokens"] == CONTEXT - out["usage"]["prompt_tokens"] > 16


def test_chat_max_tokens_0_is_refused_without_naming_echo(plain) -> None:
    status, error = refusal(plain, {"model": NAME, "messages": [{"role": "user", "content": "a"}], "max_tokens": 0})
    assert status == 400 and error["param"] == "max_tokens"
    assert ">= 1" in error["message"] and "echo" not in error["message"]


# --- a message's fields --------------------------------------------------------------------------


def chat(served, messages: list[dict], **fields) -> tuple[int, dict]:
    body = {"model": NAME, "messages": messages, "max_tokens": 4, "temperature": 0, **fields}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    return r.status_code, r.json()


def test_an_answer_sent_back_with_its_empty_fields_is_taken(plain) -> None:
    """A client that appends the answer's message as the openai library dumps it (refusal, tool_calls
    and the rest null or empty) gets the same answer as for the bare message."""
    bare = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}, {"role": "user", "content": "e"}]
    dumped = [dict(m) for m in bare]
    dumped[1].update(refusal=None, tool_calls=None, function_call=None, audio=None, annotations=[])
    status, with_fields = chat(plain, dumped)
    assert status == 200, with_fields
    assert with_fields["choices"] == chat(plain, bare)[1]["choices"]


@pytest.mark.parametrize(
    "extra,words",
    [
        (
            {"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]},
            "tool_calls[0].function.arguments must be a JSON object",
        ),
        ({"tool_calls": [{"id": "c1", "type": "function"}]}, "tool_calls[0] is not"),
        ({"tool_calls": {"id": "c1"}}, "tool_calls must be a list"),
        ({"function_call": {"name": "f", "arguments": "{}"}}, "function_call"),
        ({"refusal": "no"}, "refusal"),
        ({"foo": "bar"}, "unknown field 'foo'"),
        ({"name": 7}, "name must be a string"),
    ],
)
def test_a_message_field_that_asks_for_something_is_refused_by_name(plain, extra, words) -> None:
    status, out = chat(plain, [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c", **extra}])
    assert status == 400, out
    assert out["error"]["param"] == "messages" and words in out["error"]["message"]
    assert "messages[1]" in out["error"]["message"]


def test_a_name_and_a_tool_call_id_reach_the_template(plain, monkeypatch) -> None:
    seen = []
    tokenizer = plain.llm.tokenizer
    original = tokenizer.apply_chat
    monkeypatch.setattr(tokenizer, "apply_chat", lambda turns, *a, **k: seen.append(turns) or original(turns, *a, **k))
    messages = [{"role": "user", "content": "ab", "name": "Bob"}, {"role": "tool", "content": "1", "tool_call_id": "c"}]
    status, out = chat(plain, messages)
    assert status == 200, out
    assert seen and seen[-1][0]["name"] == "Bob" and seen[-1][1]["tool_call_id"] == "c"


# --- ignored fields keep OpenAI's values ---------------------------------------------------------


def test_service_tier_takes_openai_values_only(plain) -> None:
    assert chat(plain, [{"role": "user", "content": "a"}], service_tier="auto")[0] == 200
    status, out = chat(plain, [{"role": "user", "content": "a"}], service_tier="ultra")
    assert status == 400 and out["error"]["param"] == "service_tier" and "flex" in out["error"]["message"]


# --- the schema ----------------------------------------------------------------------------------


def test_the_schema_describes_what_the_server_takes(plain) -> None:
    schemas = httpx.get(plain.url + "/openapi.json").json()["components"]["schemas"]
    content = schemas["ChatMessage"]["properties"]["content"]
    assert {"type": "string"} in content["anyOf"] and any(k.get("type") == "array" for k in content["anyOf"])
    assert {"name", "tool_call_id"} <= set(schemas["ChatMessage"]["properties"])
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        fields = schemas[request]["properties"]
        assert {"store", "metadata", "service_tier", "best_of", "tools", "response_format"} <= set(fields)
    assert "not supported" in schemas["CompletionRequest"]["properties"]["tools"]["description"]
    # a completion's suffix is a gap to fill in; chat takes none
    assert "fill" in schemas["CompletionRequest"]["properties"]["suffix"]["description"]
    assert "suffix" not in schemas["ChatCompletionRequest"]["properties"]
    chat_fields = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat_fields)
    assert "not supported" not in chat_fields["tools"].get("description", "")
    assert "tool_calls" in schemas["ChatMessage"]["properties"] and "ToolCall" in schemas
