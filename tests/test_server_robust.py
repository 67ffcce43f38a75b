"""forerun serve against what knocks servers over: client mistakes that must be 400s (and counted
apart from engine failures), legal numbers that once gave nonsense, a slow tokenization, slow and
vanishing clients, unknown routes, the schema a fuzzer reads, and a SIGTERM with streams open."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server import CONTEXT, KEY, NAME, Served, _metric

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.commands.common import quantization_arg
from forerun.engine.engine import Engine
from forerun.models.testing import save_hf_folder, tiny_model

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(target_tok):
    s = Served(LLM(target_tok), header_timeout=0.5, body_timeout=0.5)
    yield s
    s.stop()


def post(served, body, path="/v1/completions", **kw) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \\udfff, as a client in any language may send it.
    return httpx.post(
        served.url + path,
        content=json.dumps(body),
        timeout=30,
        **kw,
        headers={**AUTH, "Content-Type": "application/json"},
    )


def greedy(served, prompt: str, max_tokens: int) -> str:
    ids = served.llm.tokenizer.encode(prompt)
    return Engine(served.llm.target).generate(ids, SamplingParams(max_tokens=max_tokens)).text


CLIENT_MISTAKES = [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"prompt": [1000000000]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [2**64]}, "prompt"),
    ({"prompt": "x\udfff"}, "prompt"),
    ({"stop": ["\ud800"]}, "stop"),
    ({"logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": {"1" * 5000: 1}}, "logit_bias"),  # more digits than Python reads as a number
    ({"logit_bias": {"5": None}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),  # above max_tokens
    ({"min_tokens": -1}, "min_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),  # no schema
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),  # the unknown key is named
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"guided_json": "false"}, "guided_json"),
    ({"guided_json": {"type": "nothing"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),  # two say what the text must be
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ({"best_of": 3}, "best_of"),
    ({"tempreature": 0.5}, "tempreature"),  # a typo is named, not ignored
    ({"\udfff": 1}, "\\udfff"),  # a field's name with a lone surrogate: named, escaped
    ({"messages": [{"role": "user", "content": "a"}]}, "messages"),  # the chat route's field
    ({"logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize("change,param", CLIENT_MISTAKES, ids=[p for _, p in CLIENT_MISTAKES])
def test_client_mistakes_are_400s_naming_the_field(served, change, param) -> None:
    r = post(served, {"model": NAME, "prompt": "abc", "max_tokens": 4, **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param in error["message"] or param == "prompt"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny", "prompt": "a", "temperature": Infinity}',
        b'{"model": "tiny", "prompt": "a", "temperature": NaN}',
        b'{"model": "tiny", "prompt": "a", "top_p": -Infinity}',
    ],
)
def test_non_finite_numbers_are_refused(served, raw) -> None:
    r = httpx.post(served.url + "/v1/completions", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "finite" in r.json()["error"]["message"]


def test_a_body_nested_a_hundred_thousand_deep_is_a_400(served) -> None:
    r = httpx.post(
        served.url + "/v1/completions",
        content=b"[" * 100_000 + b"]" * 100_000,
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]


def test_neutral_values_of_unsupported_fields_are_accepted(served) -> None:
    r = post(
        served,
        {
            "model": NAME,
            "prompt": "abc",
            "max_tokens": 3,
            "temperature": 0,
            "logit_bias": {},
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "best_of": 1,
            "user": "u1",
            "tools": [],
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy(served, "abc", 3)


def test_chat_roles_outside_openai_s_are_400s(served) -> None:
    for role in ("wizard", "", "System"):
        r = post(served, {"model": NAME, "messages": [{"role": role, "content": "hi"}]}, "/v1/chat/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = post(
        served,
        {
            "model": NAME,
            "max_tokens": 2,
            "messages": [
                {"role": "tool", "content": "42"},
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": "hi"},
            ],
        },
        "/v1/chat/completions",
    )
    assert r.status_code == 200, r.text


def test_a_field_of_the_wrong_type_is_named_as_that_not_as_missing(served) -> None:
    r = post(served, {"model": 5, "prompt": "abc", "max_tokens": 2})
    assert r.status_code == 400 and "not int" in r.json()["error"]["message"], r.text
    r = post(served, {"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 400 and "'model' is required" in r.json()["error"]["message"], r.text
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": 5}]
    r = post(served, {"model": NAME, "messages": [{"role": "user", "content": parts}]}, "/v1/chat/completions")
    assert r.status_code == 400 and "content[1].text must be a string" in r.json()["error"]["message"], r.text
    parts = [{"type": "image_url", "image_url": {"url": "x"}}]
    r = post(served, {"model": NAME, "messages": [{"role": "user", "content": parts}]}, "/v1/chat/completions")
    assert r.status_code == 400 and "only text parts" in r.json()["error"]["message"], r.text


def test_max_model_len_zero_is_refused_not_read_as_the_default() -> None:
    from forerun.base.errors import ForerunError
    from forerun.cli import build_parser
    from forerun.commands.serve import server_config

    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m", "--max-model-len", "0"])
    with pytest.raises(ForerunError, match="between 2 and the model's context"):
        server_config(args, 1024)
    assert server_config(parser.parse_args(["serve", "--model", "m"]), 1024).max_model_len == 1024


def test_client_mistakes_are_counted_apart_from_engine_failures(target_tok) -> None:
    served = Served(LLM(target_tok))
    try:
        for change, _ in CLIENT_MISTAKES:
            assert post(served, {"model": NAME, "prompt": "abc", **change}).status_code == 400
        assert httpx.get(served.url + "/v1/models").status_code == 401
        text = httpx.get(served.url + "/metrics", headers=AUTH).text
        assert _metric(text, "forerun:request_rejected_total", 'status="400"') == len(CLIENT_MISTAKES)
        assert _metric(text, "forerun:request_rejected_total", 'status="401"') == 1
        assert _metric(text, "forerun:request_failure_total") == 0
    finally:
        served.stop()


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 1e-300])
def test_a_tiny_temperature_is_greedy_not_nonsense(served, temperature) -> None:
    r = post(served, {"model": NAME, "prompt": "abc", "max_tokens": 12, "temperature": temperature})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy(served, "abc", 12)


@pytest.mark.parametrize("top_p", [1e-46, 1e-50])
def test_a_tiny_top_p_keeps_the_likeliest_token(served, top_p) -> None:
    r = post(served, {"model": NAME, "prompt": "abc", "max_tokens": 12, "temperature": 1.0, "top_p": top_p, "seed": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy(served, "abc", 12)


def test_tokenizing_a_long_prompt_does_not_stall_other_clients(served, monkeypatch) -> None:
    tok = served.llm.tokenizer
    slow_encode = tok.encode

    def slow(text: str) -> list[int]:
        time.sleep(2.0)
        return slow_encode(text)

    monkeypatch.setattr(tok, "encode", slow)
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(r=post(served, {"model": NAME, "prompt": "abc", "max_tokens": 2}))
    )
    thread.start()
    time.sleep(0.3)  # the slow request is tokenizing now
    started = time.monotonic()
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    assert time.monotonic() - started < 1.0  # not behind the 2 s tokenization
    thread.join(20)
    assert result["r"].status_code == 200


def test_a_prompt_past_the_character_cap_is_refused_before_tokenizing(served, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(served.llm.tokenizer, "encode", lambda text: calls.append(text) or [1])
    r = post(served, {"model": NAME, "prompt": "a" * (CONTEXT * 16 + 1)})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"] and not calls


def test_unknown_routes_and_wrong_methods_answer_in_openai_s_shape_after_the_key(served) -> None:
    assert httpx.get(served.url + "/v1/nothing").status_code == 401  # nothing revealed without the key
    r = httpx.get(served.url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and "/v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(served.url + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.delete(served.url + "/v1/models", headers=AUTH).status_code == 405


def test_openapi_and_docs_describe_both_routes(served) -> None:
    spec = httpx.get(served.url + "/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"] == f"#/components/schemas/{model}"
        assert "model" in spec["components"]["schemas"][model]["properties"]
    assert "ChatMessage" in spec["components"]["schemas"]
    assert "swagger" in httpx.get(served.url + "/docs").text.lower()


def test_models_names_the_speculator(target_tok) -> None:
    served = Served(LLM(target_tok), speculative_model="tiny-draft")
    try:
        (entry,) = httpx.get(served.url + "/v1/models", headers=AUTH).json()["data"]
        assert entry["id"] == NAME and entry["speculative_model"] == "tiny-draft"
    finally:
        served.stop()


def _connect(served) -> socket.socket:
    host, port = served.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def test_a_connection_that_trickles_its_headers_is_closed(served) -> None:
    with _connect(served) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(1.0)  # past the 0.5 s head deadline
        s.settimeout(3)
        assert s.recv(100) == b""  # closed without an answer


def test_a_body_that_never_arrives_gets_408(served) -> None:
    with _connect(served) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY.encode()
            + b'\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
        )
        s.settimeout(5)
        assert s.recv(200).startswith(b"HTTP/1.1 408")


def test_a_client_hanging_up_mid_body_leaves_no_traceback(served, caplog) -> None:
    # uvicorn logs an application's exception on "uvicorn.error", and "uvicorn" hands nothing up to
    # the root logger where caplog listens: listen there too.
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.addHandler(caplog.handler)
    try:
        _hang_up_mid_body(served, caplog)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def _hang_up_mid_body(served, caplog) -> None:
    with caplog.at_level(logging.DEBUG):
        with _connect(served) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + KEY.encode()
                + b'\r\nContent-Length: 100\r\n\r\n{"model"'
            )
        time.sleep(0.5)
        assert httpx.get(served.url + "/health").status_code == 200


def test_serve_and_generate_default_to_the_exact_format() -> None:
    from forerun.cli import build_parser

    parser = build_parser()
    for command in (["serve"], ["generate", "--prompt", "x"]):
        args = parser.parse_args([*command, "--model", "m"])
        assert args.quantization == "auto" and args.speculative_quantization == "auto"
        assert (
            quantization_arg(parser.parse_args([*command, "--model", "m", "--quantization", "none"]).quantization)
            is None
        )


# --- a real `forerun serve` process and its shutdown -----------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return save_hf_folder(tiny_model(seed=0), tmp_path_factory.mktemp("serve") / "tiny")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(folder: Path, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "forerun.cli",
            "serve",
            "--model",
            str(folder),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--quantization",
            "none",
            "--served-model-name",
            "tiny",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_ready(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("forerun serve did not come up")


def _stream(url: str, results: list, index: int) -> None:
    """One streamed completion; records its events (parsed) and whether it ended with [DONE]."""
    events, done = [], False
    try:
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=60,
            json={
                "model": "tiny",
                "prompt": f"abc{index}",
                "max_tokens": 900,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            },
        ) as r:
            status = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
    except httpx.HTTPError as exc:
        status = f"{type(exc).__name__}: {exc}"
    results[index] = (status, events, done)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_finishes_or_ends_every_stream_and_exits_0_within_the_grace(tiny_folder, sig) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = _serve(tiny_folder, port, "--max-num-seqs", "8", "--max-model-len", "1000", "--shutdown-timeout", "1")
    try:
        _wait_ready(process, url)
        results: list = [None] * 12
        threads = [threading.Thread(target=_stream, args=(url, results, i)) for i in range(12)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while True:  # 8 running, 4 waiting
            text = httpx.get(url + "/metrics").text
            if (
                _metric(text, "forerun:num_requests_running") == 8
                and _metric(text, "forerun:num_requests_waiting") == 4
            ):
                break
            assert time.monotonic() < deadline, "the streams did not all start"
            time.sleep(0.02)
        sent = time.monotonic()
        process.send_signal(sig)
        time.sleep(0.2)
        refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "late"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert process.wait(timeout=15) == 0
        assert time.monotonic() - sent < 1 + 5  # the grace, and the uvicorn wind-down
        for t in threads:
            t.join(10)
        errors = 0
        for status, events, done in results:
            assert status == 200 and done, (status, events[-1:] if events else None)
            last = events[-1]
            if "error" in last:
                errors += 1
                assert last["error"]["code"] == "shutting_down"
            else:
                assert last["choices"][0]["finish_reason"] == "length"
        log = process.stderr.read()
        assert sig.name in log and "shut down" in log
        # The 4 waiting ones end at once; the running ones still going at the grace's end are cut,
        # and the log says how many.
        cut = re.search(r"shut down; (\d+) running request\(s\) cut", log)
        assert errors == 4 + (int(cut.group(1)) if cut else 0), log
        assert cut or "every running request finished" in log, log
    finally:
        if process.poll() is None:
            process.kill()


def test_serving_is_announced_only_once_the_port_is_bound(tiny_folder) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = _serve(tiny_folder, port)
        _, err = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "port" in err and "serving" not in err
