"""forerun serve against what an earlier QA pass missed: numbers too big for Python's own parsers,
a prompt that fills the context with no max_tokens, stop lists that would stall every request, a
stream_options of the wrong shape, and a queue that refused what it could take (or forever)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from test_server import CONTEXT, KEY, NAME, Served

from forerun.api import LLM
from forerun.serve.requests import MAX_STOP, MAX_STOP_CHARS

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def served(target_tok):
    s = Served(LLM(target_tok))
    yield s
    s.stop()


def post(served, body, path: str = "/v1/completions", raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(served.url + path, content=content, headers=AUTH, timeout=60)


def refused_naming(r: httpx.Response, param: str | None, words: str, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert words in error["message"], error
    return error


# --- numbers ---------------------------------------------------------------------------------------


def test_an_integer_of_more_digits_than_python_parses_is_a_400_not_a_500(served) -> None:
    raw = b'{"model": "tiny", "prompt": "abc", "max_tokens": 1' + b"0" * 5000 + b"}"
    refused_naming(post(served, None, raw=raw), None, "not valid JSON")


@pytest.mark.parametrize("name", ["temperature", "top_p"])
def test_an_integer_too_big_for_a_float_is_a_400_naming_the_field(served, name) -> None:
    r = post(served, {"model": NAME, "prompt": "abc", "max_tokens": 2, name: 10**400})
    refused_naming(r, name, "finite number")


IGNORED_BUT_TYPED = [
    ({"user": 5}, "user", "/v1/completions"),
    ({"user": ["u"]}, "user", "/v1/chat/completions"),
    ({"store": "yes"}, "store", "/v1/completions"),
    ({"metadata": "m"}, "metadata", "/v1/chat/completions"),
    ({"metadata": {"k": 1}}, "metadata", "/v1/chat/completions"),
    ({"service_tier": 1}, "service_tier", "/v1/completions"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "/v1/chat/completions"),
]


@pytest.mark.parametrize("change,param,path", IGNORED_BUT_TYPED, ids=[str(c) for c, _, _ in IGNORED_BUT_TYPED])
def test_fields_taken_and_ignored_are_still_checked_for_their_type(served, change, param, path) -> None:
    body = {"model": NAME, "max_tokens": 2, **change}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "abc"})
    refused_naming(post(served, body, path), param, param)
    fine = {"user": "u1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}
    assert post(served, {**body, **fine, param: None}, path).status_code == 200


# --- the context -----------------------------------------------------------------------------------


def test_a_prompt_that_fills_the_context_without_max_tokens_names_the_prompt(served) -> None:
    for prompt in ("a" * CONTEXT, "a" * (CONTEXT + 1)):
        r = post(served, {"model": NAME, "prompt": prompt})
        error = refused_naming(r, "prompt", f"context of {CONTEXT}")
        assert "max_tokens" not in error["message"], error  # the client never sent one
    chat = {"model": NAME, "messages": [{"role": "user", "content": "a" * CONTEXT}]}
    refused_naming(post(served, chat, "/v1/chat/completions"), "messages", f"context of {CONTEXT}")


def test_a_prompt_one_token_short_of_the_context_gets_its_one_token(served) -> None:
    r = post(served, {"model": NAME, "prompt": "a" * (CONTEXT - 1), "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


# --- stop strings ----------------------------------------------------------------------------------


def test_a_stop_list_longer_than_the_cap_is_a_400(served) -> None:
    stops = [f"s{i}" for i in range(MAX_STOP + 1)]
    refused_naming(post(served, {"model": NAME, "prompt": "abc", "stop": stops}), "stop", str(MAX_STOP))
    ok = post(served, {"model": NAME, "prompt": "abc", "max_tokens": 2, "stop": stops[:MAX_STOP]})
    assert ok.status_code == 200, ok.text


def test_a_stop_string_longer_than_the_cap_is_a_400(served) -> None:
    r = post(served, {"model": NAME, "prompt": "abc", "stop": ["x" * (MAX_STOP_CHARS + 1)]})
    refused_naming(r, "stop", str(MAX_STOP_CHARS))
    ok = post(served, {"model": NAME, "prompt": "abc", "max_tokens": 2, "stop": "x" * MAX_STOP_CHARS})
    assert ok.status_code == 200, ok.text


# --- stream_options --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,words",
    [
        ({"include_usage": "yes"}, "include_usage must be true or false"),
        ({"include_usage": 1}, "include_usage must be true or false"),
        ({"include_usag": True}, "include_usag"),
    ],
)
def test_stream_options_of_the_wrong_shape_are_400s(served, options, words) -> None:
    body = {"model": NAME, "prompt": "abc", "max_tokens": 2, "stream": True, "stream_options": options}
    refused_naming(post(served, body), "stream_options", words)


def test_stream_options_without_stream_is_a_400_as_in_openai_and_vllm(served) -> None:
    body = {"model": NAME, "prompt": "abc", "max_tokens": 2, "stream_options": {"include_usage": True}}
    refused_naming(post(served, body), "stream_options", "stream")
    assert post(served, {**body, "stream_options": None}).status_code == 200


# --- the queue -------------------------------------------------------------------------------------


def test_max_waiting_zero_runs_requests_while_lanes_are_open(target_tok) -> None:
    served = Served(LLM(target_tok), max_waiting=0, max_num_seqs=2)
    try:
        r = post(served, {"model": NAME, "prompt": "abc", "max_tokens": 3, "n": 2})
        assert r.status_code == 200, r.text
        refused_naming(post(served, {"model": NAME, "prompt": "abc", "max_tokens": 3, "n": 3}), "n", "never")
    finally:
        served.stop()


def test_n_beyond_max_waiting_runs_in_open_lanes_and_a_full_queue_is_a_503(target_tok) -> None:
    served = Served(LLM(target_tok), max_waiting=1, max_num_seqs=2)
    try:
        assert post(served, {"model": NAME, "prompt": "abc", "max_tokens": 3, "n": 3}).status_code == 200
        long = {"model": NAME, "prompt": "abc", "max_tokens": 500, "ignore_eos": True, "n": 3}
        thread = threading.Thread(target=post, args=(served, long))
        thread.start()  # two running, one waiting
        served.wait_counts((2, 1), 20)
        r = post(served, {"model": NAME, "prompt": "abc", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        thread.join(120)
    finally:
        served.stop()


# --- clients that go away --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_gone_before_its_answer_starts_leaves_nothing_running(served, monkeypatch, stream) -> None:
    tok = served.llm.tokenizer
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: time.sleep(1.0) or encode(text))
    step = served.batch.step
    monkeypatch.setattr(served.batch, "step", lambda *a: time.sleep(0.02) or step(*a))  # 500 tokens: 10 s
    body = {"model": NAME, "prompt": "abc", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": stream}
    with served.send_raw(body):
        time.sleep(0.3)  # the body is read; the prompt is tokenizing
    time.sleep(1.2)  # the tokenizing is over: the request was queued, and its client is gone
    served.wait_counts((0, 0), 1.0, "left running for nobody: ")


def test_an_error_quotes_a_huge_value_cut_short(served) -> None:
    r = post(served, {"model": NAME, "prompt": "abc", "n": "x" * 100_000})
    error = refused_naming(r, "n", "whole number")
    assert len(error["message"]) < 200, len(error["message"])
