"""forerun serve on a loopback port with a tiny model: the openai client against it (completions and
chat, streamed and whole), 64 concurrent streams, 200 cancelled requests, every invalid field, the
API key, /metrics against the responses, and an engine failure that ends one request only."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import statistics
import threading
import time

import httpx
import openai
import pytest
import uvicorn

import forerun
from forerun.api import LLM
from forerun.base import cpu
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import Engine
from forerun.serve.app import create_app
from forerun.serve.http import TimedH11Protocol
from forerun.serve.metrics import ServerMetrics
from forerun.serve.scheduler import Scheduler
from forerun.serve.state import ServerConfig

KEY = "test-key"
NAME = "tiny"
CONTEXT = 512


class Served:
    """A started server: its base URL, scheduler and metrics; stop() shuts it down."""

    def __init__(
        self,
        llm: LLM,
        api_key: str | None = KEY,
        max_waiting: int = 512,
        max_num_seqs: int = 64,
        new_engine=None,
        header_timeout: float = 10.0,
        **config,
    ) -> None:
        self.llm = llm
        self.batch = (
            BatchEngine(llm.new_engine, max_num_seqs, engines=[llm.engine])
            if new_engine is None
            else BatchEngine(new_engine, max_num_seqs)
        )
        self.metrics = ServerMetrics(self.batch)
        self.scheduler = Scheduler(self.batch, max_waiting)
        self.scheduler.start()
        app = create_app(
            llm,
            self.scheduler,
            ServerConfig(NAME, CONTEXT, api_key, **{"max_num_seqs": max_num_seqs, **config}),
            self.metrics,
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=port, log_level="error", http=TimedH11Protocol.with_timeout(header_timeout)
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **kw)

    def send_raw(self, body: dict) -> socket.socket:
        """A completions request sent whole on a connection of its own, left open: closing it is the
        client going away."""
        data = json.dumps(body).encode()
        host, port = self.url.removeprefix("http://").split(":")
        conn = socket.create_connection((host, int(port)), timeout=5)
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
            + data
        )
        return conn

    def wait_counts(self, counts: tuple[int, int], within_s: float, what: str = "") -> None:
        """Wait until the scheduler runs and holds `counts` (running, waiting), at most `within_s`."""
        deadline = time.monotonic() + within_s
        while self.scheduler.counts() != counts:
            assert time.monotonic() < deadline, f"{what}{self.scheduler.counts()}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.scheduler.stop()


@pytest.fixture(scope="module")
def served(target_tok):
    s = Served(LLM(target_tok))
    yield s
    s.stop()


def alone(llm: LLM, prompt, **params) -> str:
    """What the engine writes for `prompt` with nothing else running."""
    ids = llm.tokenizer.apply_chat(prompt) if isinstance(prompt, list) else llm.tokenizer.encode(prompt)
    return Engine(llm.target).generate(ids, SamplingParams(**params)).text


def test_completions_whole_and_streamed_equal_the_engine_alone(served) -> None:
    client = served.client()
    want = alone(served.llm, "abc", max_tokens=24)
    whole = client.completions.create(model=NAME, prompt="abc", max_tokens=24, temperature=0)
    assert whole.choices[0].text == want
    assert whole.choices[0].finish_reason in ("stop", "length")
    ids = served.llm.tokenizer.encode("abc")
    out_ids = Engine(served.llm.target).generate(ids, SamplingParams(max_tokens=24)).token_ids
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == len(out_ids)
    assert whole.usage.total_tokens == len(ids) + len(out_ids)
    chunks = list(
        client.completions.create(
            model=NAME, prompt="abc", max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == len(out_ids) and not chunks[-1].choices


def test_chat_whole_and_streamed_equal_the_engine_alone(served) -> None:
    client = served.client()
    messages = [{"role": "user", "content": "hello"}]
    want = alone(served.llm, messages, max_tokens=20)
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings_cut_the_text_and_finish_with_stop(served) -> None:
    client = served.client()
    full = alone(served.llm, "abc", max_tokens=40)
    stop = full[5:7]
    assert stop and full.find(stop) >= 0
    out = client.completions.create(model=NAME, prompt="abc", max_tokens=40, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_seeds_reproduce_sampled_output(served) -> None:
    client = served.client()

    def run(seed: int) -> str:
        return (
            client.completions.create(model=NAME, prompt="xy", max_tokens=30, temperature=1.5, seed=seed)
            .choices[0]
            .text
        )

    assert run(7) == run(7)
    assert len({run(seed) for seed in range(8, 14)}) > 1  # the seed does matter


def test_models_lists_the_served_name(served) -> None:
    assert [m.id for m in served.client().models.list().data] == [NAME]


def test_64_concurrent_streams_each_equal_their_run_alone(served) -> None:
    prompts = [f"p{i % 16}{chr(97 + i % 26)}" for i in range(64)]
    want = {p: alone(served.llm, p, max_tokens=16) for p in set(prompts)}

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(all_of_them())
    assert got == [want[p] for p in prompts]


def test_cancelled_requests_leave_nothing_behind(served) -> None:
    # A prompt whose greedy run is long, so that 200 of them would take minutes if they all ran.
    lengths = {
        p: len(served.llm.tokenizer.encode(alone(served.llm, p, max_tokens=400)))
        for p in ("q", "zz", "hello", "abc", "0", "x y", "wq", "mm")
    }
    prompt = max(lengths, key=lengths.get)
    assert lengths[prompt] >= 300, lengths

    async def read_all(client: httpx.AsyncClient, stream: bool) -> None:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": stream}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                pass

    async def give_up(client: httpx.AsyncClient, stream: bool) -> bool:
        try:
            await asyncio.wait_for(read_all(client, stream), timeout=0.5)  # the client's whole-request timeout
        except TimeoutError:
            return True
        return False

    async def cancel_200() -> list[bool]:
        async with httpx.AsyncClient(
            base_url=served.url,
            timeout=30,
            headers={"Authorization": f"Bearer {KEY}"},
            limits=httpx.Limits(max_connections=200),
        ) as client:
            return await asyncio.gather(*(give_up(client, stream=i % 2 == 0) for i in range(200)))

    assert sum(asyncio.run(cancel_200())) >= 190  # a few may finish within the timeout
    start = time.monotonic()
    out = served.client(timeout=30).completions.create(model=NAME, prompt="abc", max_tokens=8, temperature=0)
    assert out.choices[0].text == alone(served.llm, "abc", max_tokens=8)
    assert time.monotonic() - start < 5
    served.wait_counts((0, 0), 5, "left in the scheduler: ")


BAD = [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": CONTEXT}, "max_tokens"),  # with the prompt, beyond the context
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": {"text": "a"}}, "prompt"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"top_k": -3}, "top_k"),
    ({"seed": 1.5}, "seed"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[p + "-" + str(i) for i, (_, p) in enumerate(BAD)])
def test_invalid_fields_get_400_naming_the_field(served, change, param) -> None:
    body = {"model": NAME, "prompt": "abc", "max_tokens": 4, **change}
    r = httpx.post(served.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("_")[0] in error["message"]
    assert served.scheduler.counts() == (0, 0)  # nothing reached the engine


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_gets_400(served, body) -> None:
    r = httpx.post(
        served.url + "/v1/completions",
        content=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_chat_messages_are_checked(served) -> None:
    for messages in ([], [{"content": "no role"}], [{"role": "user", "content": 5}], "hi"):
        r = httpx.post(
            served.url + "/v1/chat/completions",
            json={"model": NAME, "messages": messages},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_an_oversized_body_is_refused(served) -> None:
    r = httpx.post(
        served.url + "/v1/completions",
        json={"model": NAME, "prompt": "a" * (5 << 20)},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_the_api_key_guards_every_route_but_health(served) -> None:
    for path in ("/v1/models", "/metrics", "/version"):
        assert httpx.get(served.url + path).status_code == 401
        assert httpx.get(served.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(served.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    r = httpx.post(served.url + "/v1/completions", json={"model": NAME, "prompt": "a"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    assert httpx.head(served.url + "/health").status_code == 200  # a load balancer's probe
    assert httpx.get(served.url + "/ping").json() == httpx.post(served.url + "/ping").json() == {"status": "ok"}
    version = httpx.get(served.url + "/version", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert version == {"version": forerun.__version__}


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name + (("{" + labels + "}") if labels else "")) + r" ([0-9.e+-]+)"
    match = re.search(r"^" + pattern + "$", text, re.M)
    assert match, f"{name} {labels} not in /metrics"
    return float(match.group(1))


def test_metrics_agree_with_the_responses(target_tok) -> None:
    llm = LLM(target_tok, speculative_method="ngram", num_speculative_tokens=3, speculative_k_policy="fixed")
    served = Served(llm)
    try:
        client = served.client()
        prompts = ["abcabcabcabc", "hello hello hello", "xyzxyzxy"]
        usage = [client.completions.create(model=NAME, prompt=p, max_tokens=30, temperature=0).usage for p in prompts]
        expected = [
            Engine(llm.target, llm.engine.drafter, 3).generate(llm.tokenizer.encode(p), SamplingParams(max_tokens=30))
            for p in prompts
        ]
        text = httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    finally:
        served.stop()
    assert _metric(text, "forerun:generation_tokens_total") == sum(u.completion_tokens for u in usage)
    assert _metric(text, "forerun:prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert _metric(text, "forerun:spec_decode_num_drafts_total") == sum(e.metrics.num_drafts for e in expected)
    drafted = sum(e.metrics.num_draft_tokens for e in expected)
    accepted = sum(e.metrics.num_accepted_tokens for e in expected)
    assert drafted > 0 and accepted > 0
    assert _metric(text, "forerun:spec_decode_num_draft_tokens_total") == drafted
    assert _metric(text, "forerun:spec_decode_num_accepted_tokens_total") == accepted
    first = sum(e.metrics.accepted_per_position[0] for e in expected)
    assert _metric(text, "forerun:spec_decode_num_accepted_tokens_per_pos_total", 'position="1"') == first
    assert _metric(text, "forerun:num_requests_running") == 0
    assert _metric(text, "forerun:time_to_first_token_seconds_count") == 3
    assert _metric(text, "forerun:e2e_request_latency_seconds_count") == 3
    assert _metric(text, "forerun:spec_decode_draft_length") == 3


class Boom(BaseException):
    """Not an Exception: nothing per request catches it, so it ends the engine loop."""


class FlakyEngine(Engine):
    """Raises inside a step of prompts that start with `bad`, at their third token; `fatal`
    raises Boom instead."""

    def __init__(self, llm: LLM, bad: int, fatal: bool = False) -> None:
        super().__init__(llm.target)
        self.bad, self.fatal = bad, fatal

    def finish(self, run, plan, ver, timed=True):
        if run.seq.prompt_ids[0] == self.bad and len(run.seq.output_ids) == 2:
            raise Boom() if self.fatal else RuntimeError("injected failure")
        return super().finish(run, plan, ver, timed)


def test_a_failure_inside_the_engine_ends_that_request_only(target_tok) -> None:
    llm = LLM(target_tok)
    bad = llm.tokenizer.encode("!")[0]
    served = Served(llm, new_engine=lambda: FlakyEngine(llm, bad))
    try:
        client = served.client()
        # A long stream runs beside the failing requests and is not disturbed by them.
        beside = client.completions.create(model=NAME, prompt="fine", max_tokens=60, temperature=0, stream=True)
        with pytest.raises(openai.InternalServerError, match="injected failure"):
            client.completions.create(model=NAME, prompt="!boom", max_tokens=10, temperature=0)
        chunks = []
        with pytest.raises(openai.APIError, match="injected failure"):
            for chunk in client.completions.create(
                model=NAME, prompt="!boom", max_tokens=10, temperature=0, stream=True
            ):
                chunks.append(chunk)
        assert chunks  # text before the failure came through
        r = httpx.post(
            served.url + "/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": NAME, "prompt": "!boom", "max_tokens": 10, "temperature": 0, "stream": True},
        )
        assert '"error"' in r.text and r.text.endswith("data: [DONE]\n\n")
        ok = client.completions.create(model=NAME, prompt="fine", max_tokens=10, temperature=0)
        assert ok.choices[0].text == alone(llm, "fine", max_tokens=10)
        assert "".join(c.choices[0].text for c in beside if c.choices) == alone(llm, "fine", max_tokens=60)
        assert httpx.get(served.url + "/health").status_code == 200
    finally:
        served.stop()


def test_health_says_503_when_the_engine_loop_has_died(target_tok) -> None:
    llm = LLM(target_tok)
    bad = llm.tokenizer.encode("!")[0]
    served = Served(llm, new_engine=lambda: FlakyEngine(llm, bad, fatal=True))
    try:
        with pytest.raises(openai.InternalServerError, match="engine loop stopped"):
            served.client(timeout=10).completions.create(model=NAME, prompt="!x", max_tokens=10, temperature=0)
        r = httpx.get(served.url + "/health")
        assert r.status_code == 503 and "Boom" in r.json()["detail"]
        with pytest.raises(openai.APIStatusError, match="engine loop has stopped") as caught:
            served.client().completions.create(model=NAME, prompt="fine", max_tokens=10, temperature=0)
        assert caught.value.status_code == 503
    finally:
        served.stop()


def test_the_load_generator_times_every_request(served) -> None:
    from forerun.bench.serve_load import run_level

    prompts = [served.llm.tokenizer.encode(p) for p in ("abc", "hello", "xy", "q")] * 2
    lengths = [12, 3, 7, 12, 1, 5, 9, 2]
    level = asyncio.run(run_level(served.url + "/v1", NAME, prompts, 3, lengths, api_key=KEY, setup="off"))
    assert (level.requests, level.failures, level.concurrency) == (8, 0, 3)
    assert level.output_tokens <= sum(lengths) and all(t["tokens"] <= 12 for t in level.timings)
    assert level.output_tokens == sum(t["tokens"] for t in level.timings) and level.tokens_per_s > 0
    assert all(0 < t["ttft_s"] <= t["e2e_s"] <= level.wall_s for t in level.timings)
    assert level.ttft_p50_s <= level.ttft_p90_s


def test_requests_differ_in_length_the_same_way_on_every_server() -> None:
    from forerun.bench.serve_load import request_lengths

    lengths = request_lengths(200, 64, 0.5, seed=8)
    assert lengths == request_lengths(200, 64, 0.5, seed=8)
    assert min(lengths) >= 32 and max(lengths) <= 64 and len(set(lengths)) > 10
    assert request_lengths(5, 64, 0.0) == [64] * 5
    # Levels of 16 and of 64 requests ask for as many tokens a request on average.
    assert abs(statistics.mean(request_lengths(16, 64, 0.5, seed=4)) - statistics.mean(lengths)) < 0.5
    assert abs(statistics.mean(request_lengths(64, 64, 0.5, seed=16)) - statistics.mean(lengths)) < 0.5
    assert min(request_lengths(50, 3, 0.9)) >= 1
    with pytest.raises(ForerunError, match="--length-spread"):
        request_lengths(5, 64, 1.0)


def test_bench_serve_sends_prompts_again_or_with_distinct_never_twice() -> None:
    from forerun.bench.serve_load import level_prompts

    prompts = [[k] * (1 + k) for k in range(10)]
    assert level_prompts(prompts, [3, 12]) == [prompts[:3], prompts + prompts[:2]]
    levels = level_prompts(prompts, [2, 3, 4], distinct=True)
    sent = [p[0] for level in levels for p in level]
    assert [len(level) for level in levels] == [2, 3, 4] and len(set(sent)) == 9
    assert sent != sorted(sent) and levels == level_prompts(prompts, [2, 3, 4], distinct=True)
    with pytest.raises(ForerunError, match="--distinct sends 11 different prompts .* dataset has 10"):
        level_prompts(prompts, [5, 6], distinct=True)


def test_bench_serve_deals_every_level_prompts_as_long_on_average() -> None:
    """With --distinct, levels that differ in size get the same mean prompt length, though a few
    prompts are far longer than the rest (Spec-Bench's summaries and retrieval contexts)."""
    from forerun.bench.serve_load import level_prompts

    draw = random.Random(3)
    lengths = [1 + int(draw.lognormvariate(4, 1)) for _ in range(200)]  # median 59, an eighth over 200
    prompts = [[i] * n for i, n in enumerate(lengths)]
    for counts in ([4, 16, 64], [4, 16], [16, 64], [8, 32]):
        levels = level_prompts(prompts, counts, distinct=True)
        means = [statistics.mean(len(p) for p in level) for level in levels]
        assert [len(level) for level in levels] == counts
        assert len({p[0] for level in levels for p in level}) == sum(counts)
        assert max(means) / min(means) < 1.03, (counts, means)
        assert all(max(map(len, level)) > 4 * statistics.median(lengths) for level in levels if len(level) >= 16)


def test_bench_serve_alternates_which_set_up_runs_first() -> None:
    from forerun.bench.serve_load import running_order

    setups = ["off", "auto", "llama-server"]
    assert running_order(setups, 0) == setups
    assert running_order(setups, 1) == ["llama-server", "auto", "off"]
    assert [running_order(setups, i)[0] for i in range(4)] == ["off", "llama-server", "off", "llama-server"]
    assert setups == ["off", "auto", "llama-server"]


def test_the_serve_report_sets_each_run_beside_off_of_its_own_round(tmp_path) -> None:
    from forerun.bench.serve_load import LevelResult, write_report

    def level(setup, c, tokens, errors=()):
        return LevelResult(
            setup, c, 4, 1.0, tokens, 0.1, 0.2, 0.01, 0.02, len(errors), [], list(errors), prompt_tokens=1200
        )

    counted = level("auto", 16, 99)
    counted.draft_tokens, counted.accepted_tokens = 120, 90
    write_report(
        tmp_path,
        [
            level("off", 16, 100),
            counted,
            level("off", 16, 50),
            level("auto", 16, 55, ["APIConnectionError: Connection error."]),
        ],
        "# header",
    )
    report = (tmp_path / "report.md").read_text()
    assert "| auto | 16 | 4 | 300 | 99.0 | 0.99× |" in report and "| auto | 16 | 4 | 300 | 55.0 | 1.10× |" in report
    assert "| 120 / 90 | 0 |" in report and "| – | 1 |" in report
    assert "- auto at 16: APIConnectionError: Connection error." in report
    assert json.loads((tmp_path / "results.json").read_text())[3]["errors"] == ["APIConnectionError: Connection error."]


def test_bench_serve_refuses_a_set_up_it_does_not_know(tmp_path, capsys) -> None:
    from forerun.cli import main

    assert main(["bench-serve", "--model", "x", "--setups", "off,warp", "--out", str(tmp_path)]) == 2
    assert (
        main(["bench-serve", "--model", "x", "--setups", "off", "--length-spread", "-0.1", "--out", str(tmp_path)]) == 2
    )
    assert "(--length-spread) must be at least 0 and below 1" in capsys.readouterr().err
    assert main(["bench-serve", "--model", "x", "--setups", "auto", "--out", str(tmp_path)]) == 2  # no draft model


def test_bench_serve_runs_every_set_up_at_each_level_and_writes_its_report(tmp_path, monkeypatch) -> None:
    """Real `forerun serve` subprocesses on a tiny model folder: every set-up at every level, the
    levels interleaved (each level runs all set-ups back to back, in turn first and last), every
    server stopped after."""
    from forerun.cli import main
    from forerun.models.testing import save_hf_folder, tiny_model

    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    folder = save_hf_folder(tiny_model(seed=0), tmp_path / "target")
    draft = save_hf_folder(tiny_model(seed=0, num_layers=1), tmp_path / "draft")
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("abc abc", "hello", "xyz")))
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench-serve",
                "--model",
                str(folder),
                "--quantization",
                "w8a8",
                "--speculative-model",
                str(draft),
                "--speculative-quantization",
                "w8a8",
                "--num-speculative-tokens",
                "2",
                "--concurrency",
                "1,2",
                "--requests-per-level",
                "1",
                "--max-tokens",
                "6",
                "--dataset",
                str(dataset),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    levels = json.loads((out / "results.json").read_text())
    # The second level runs the set-ups in the reverse order.
    assert [(r["concurrency"], r["setup"]) for r in levels] == [
        (1, "off"),
        (1, "fixed"),
        (1, "auto"),
        (2, "auto"),
        (2, "fixed"),
        (2, "off"),
    ]
    assert all(r["failures"] == 0 and r["requests"] <= r["output_tokens"] <= 6 * r["requests"] for r in levels)
    # Each level's draft counters, read from the server's /metrics around it.
    assert all(r["draft_tokens"] == r["accepted_tokens"] == 0 for r in levels if r["setup"] == "off")
    assert all(r["draft_tokens"] >= r["accepted_tokens"] >= 0 for r in levels)
    assert sum(r["draft_tokens"] for r in levels if r["setup"] == "fixed") > 0
    report = (out / "report.md").read_text()
    assert "| auto | 2 | 2 |" in report and "× off" in report
    assert f"CPU: {cpu.describe()}; forerun kernels: " in report


def test_the_engine_loop_runs_on_the_calling_thread_until_told_to_end(target_tok) -> None:
    """`forerun serve` runs the loop on its main thread (the HTTP server beside it): it serves
    requests there and returns once keep_going() turns False."""
    from forerun.serve.scheduler import Done, Request

    llm = LLM(target_tok)
    scheduler = Scheduler(BatchEngine(llm.new_engine, 2, engines=[llm.engine]))
    ended = threading.Event()
    caller = threading.Thread(target=scheduler.run, kwargs={"keep_going": lambda: not ended.is_set()})
    caller.start()  # stands in for the main thread
    deadline = time.monotonic() + 10
    while not scheduler.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    done = threading.Event()
    outputs = []

    def on_event(request, event) -> None:
        if isinstance(event, Done):
            outputs.append(event.output.text)
            done.set()

    scheduler.submit(Request(llm.tokenizer.encode("abc"), SamplingParams(max_tokens=8), on_event))
    assert done.wait(10) and outputs == [alone(llm, "abc", max_tokens=8)]
    ended.set()
    caller.join(5)
    assert not caller.is_alive() and not scheduler.alive


class _Recorded:
    """A stand-in BatchEngine that writes down what the scheduler asks of it; `during_first_add` runs
    inside the first prefill (requests arriving meanwhile)."""

    max_seqs = 4
    carried_rows = 0

    def __init__(self, during_first_add) -> None:
        self.log: list[tuple[str, int]] = []
        self.lanes: set[int] = set()
        self.started: list[int] = []
        self.during_first_add = during_first_add

    def check_fits(self, prompt_ids, params) -> int:
        return len(prompt_ids)

    def start(self, key, prompt_ids, params, like=None) -> None:
        self.started.append(key)

    @property
    def prefilling(self) -> list[int]:
        return self.started

    def prefill(self, budget_s):
        results = {}
        for key in self.started:
            results[key] = self.bring_in(key)
            if self.during_first_add is not None:
                arrive, self.during_first_add = self.during_first_add, None
                arrive()
        self.started = []
        return results

    def bring_in(self, key):
        """`key`'s prefill done: its lane runs from the next step; its first token."""
        from forerun.engine.batch import StepResult
        from forerun.engine.engine import StepOutput

        self.log.append(("add", len(self.lanes)))
        self.lanes.add(key)
        return StepResult(StepOutput([1], "a", False))

    def step(self, prefill_share=0.0):
        from forerun.engine.batch import StepResult
        from forerun.engine.engine import StepOutput

        self.log.append(("step", len(self.lanes)))
        return {key: StepResult(StepOutput([2], "b", True)) for key in self.lanes}

    def remove(self, key):
        self.lanes.discard(key)


def _finishing(count: int):
    """A maker of requests (three prompt tokens, two new), the ids of those finished, and an event
    set once `count` have finished."""
    from forerun.serve.scheduler import Done, Request

    finished: list[int] = []
    done = threading.Event()

    def on_event(request, event) -> None:
        if isinstance(event, Done):
            finished.append(request.id)
            if len(finished) == count:
                done.set()

    def request() -> Request:
        return Request([1, 2, 3], SamplingParams(max_tokens=2), on_event)

    return request, finished, done


def test_requests_that_arrive_during_a_prefill_join_before_the_next_step() -> None:
    """A burst of requests joins one batch: the first does not step alone while the rest wait."""
    request, _, done = _finishing(3)
    scheduler = Scheduler(_Recorded(lambda: [scheduler.submit(request()) for _ in range(2)]))
    scheduler.start()
    try:
        scheduler.submit(request())
        assert done.wait(10)
    finally:
        scheduler.stop()
    assert scheduler.batch.log == [("add", 0), ("add", 1), ("add", 2), ("step", 3)]


class _SlowPrompts(_Recorded):
    """Each prefill call takes `chunk_s` and brings in one prompt; a step takes `step_s`."""

    def __init__(self, chunk_s: float, step_s: float) -> None:
        super().__init__(None)
        self.chunk_s, self.step_s = chunk_s, step_s

    def prefill(self, budget_s):
        time.sleep(self.chunk_s)
        key = self.started.pop(0)
        return {key: self.bring_in(key)}

    def step(self, prefill_share=0.0):
        time.sleep(self.step_s)
        return super().step()


class _Carrying(_SlowPrompts):
    """A batch whose steps carry the waiting prompts' rows: each step brings in one waiting prompt
    (as a step whose pass carried its last rows); prefill calls are logged with their budget."""

    def prefill(self, budget_s):
        self.log.append(("prefill", budget_s > 0))
        return super().prefill(budget_s) if budget_s > 0 and self.started else {}

    def step(self, prefill_share=0.0):
        results = super().step(prefill_share)
        self.carried_rows = 0
        if self.lanes and self.started and prefill_share > 0:
            self.carried_rows = 3
            key = self.started.pop(0)
            results[key] = self.bring_in(key)
        return results


def test_while_steps_carry_prompt_rows_no_chunk_runs_alone_between_them() -> None:
    request, finished, done = _finishing(4)
    batch = _Carrying(chunk_s=0.01, step_s=0.01)
    scheduler = Scheduler(batch, prefill_share=1.0)
    scheduler.start()
    try:
        scheduler.submit(request())
        while len(finished) < 1:
            time.sleep(0.01)
        batch.lanes.add(-1)  # a request that keeps decoding: every later prompt comes in while one does
        scheduler.submit_group([request() for _ in range(3)])
        assert done.wait(10)
    finally:
        scheduler.stop()
    later = batch.log[batch.log.index(("step", 1)) + 1 :]
    # The time saved up by the last step before the prompts came buys a chunk alone; from the first
    # step that carries prompt rows on, none runs alone and the rest come in through the steps.
    carrying = later[later.index(("step", 2)) + 1 :]
    assert ("prefill", True) not in carrying, later
    assert sum(entry[0] == "add" for entry in carrying) == 2, later


def test_a_request_with_its_first_token_out_does_not_wait_for_a_whole_burst_of_long_prompts() -> None:
    """Once a step has been timed, a burst's first prefilled request waits for its second token
    about the prefill share of a step (a chunk at least), not for every other prompt of the burst."""
    request, finished, done = _finishing(5)
    batch = _SlowPrompts(chunk_s=0.2, step_s=0.01)
    scheduler = Scheduler(batch, prefill_share=1.0)
    scheduler.start()
    try:
        scheduler.submit(request())  # the first burst runs whole and times a step
        while len(finished) < 1:
            time.sleep(0.01)
        scheduler.submit_group([request() for _ in range(4)])  # four long prompts at once
        assert done.wait(10)
    finally:
        scheduler.stop()
    later = batch.log[batch.log.index(("step", 1)) + 1 :]
    # The first of the four steps after its own prefill and one more chunk: not after all four.
    assert later[:3] == [("add", 0), ("add", 1), ("step", 2)], later


class _LongPrompt(_Recorded):
    """A prompt takes a prefill call of `chunk_s` seconds a token, `chunks` at most; the waiting
    prompts take them in turn, as BatchEngine's do."""

    def __init__(self, chunks: int, chunk_s: float) -> None:
        super().__init__(None)
        self.chunks, self.chunk_s = chunks, chunk_s
        self.left: dict[int, int] = {}

    def start(self, key, prompt_ids, params, like=None) -> None:
        super().start(key, prompt_ids, params)
        self.left[key] = min(len(prompt_ids), self.chunks)

    def prefill(self, budget_s):
        time.sleep(self.chunk_s)
        key = self.started.pop(0)
        self.log.append(("chunk", key))
        self.left[key] -= 1
        if self.left[key]:
            self.started.append(key)
            return {}
        return {key: self.bring_in(key)}

    def remove(self, key):
        super().remove(key)
        if key in self.started:
            self.started.remove(key)
            self.log.append(("dropped", key))


def _long_prompt_running(batch: _LongPrompt) -> tuple[Scheduler, object, list]:
    """A started scheduler over `batch` with one request whose prompt is being prefilled; its events."""
    from forerun.serve.scheduler import Request

    events: list = []
    scheduler = Scheduler(batch)
    scheduler.start()
    request = Request(list(range(batch.chunks)), SamplingParams(max_tokens=2), lambda r, e: events.append(e))
    scheduler.submit(request)
    deadline = time.monotonic() + 10
    while ("chunk", request.id) not in batch.log and time.monotonic() < deadline:
        time.sleep(0.005)
    return scheduler, request, events


def test_a_client_gone_during_its_long_prompt_stops_the_prefill_at_the_next_chunk() -> None:
    batch = _LongPrompt(chunks=1000, chunk_s=0.01)  # ten seconds of prefill
    scheduler, request, _ = _long_prompt_running(batch)
    try:
        request.cancel()
        deadline = time.monotonic() + 10
        while ("dropped", request.id) not in batch.log and time.monotonic() < deadline:
            time.sleep(0.005)
        chunks = sum(entry == ("chunk", request.id) for entry in batch.log)
        assert ("dropped", request.id) in batch.log and chunks < 100, chunks
        assert scheduler.counts() == (0, 0) and not batch.started
    finally:
        scheduler.stop()


def test_a_short_request_that_comes_during_a_server_s_first_long_prefill_is_answered_before_it_ends() -> None:
    """It starts at the next chunk, takes chunks in turn with the long prompt, and steps once it has
    waited about a chunk with its first token out: no step has been timed yet."""
    from forerun.serve.scheduler import Done, Request

    batch = _LongPrompt(chunks=1000, chunk_s=0.01)  # ten seconds of prefill
    scheduler, long_request, _ = _long_prompt_running(batch)
    answered = threading.Event()
    try:
        short = Request([1, 2], SamplingParams(max_tokens=2), lambda r, e: isinstance(e, Done) and answered.set())
        scheduler.submit(short)
        assert answered.wait(10)
        chunks = sum(entry == ("chunk", long_request.id) for entry in batch.log)
        assert chunks < 100 and long_request.id in batch.started, chunks  # the long prompt still prefilling
    finally:
        scheduler.stop()


@pytest.mark.parametrize("grace", [0.2, 0.0])
def test_a_drain_cuts_a_long_prompt_at_the_end_of_its_grace_not_after_the_prefill(grace) -> None:
    """A drain's grace (and a second signal: grace 0) holds during a burst of prefill chunks too."""
    from forerun.serve.scheduler import Failed

    batch = _LongPrompt(chunks=1000, chunk_s=0.01)
    scheduler, request, events = _long_prompt_running(batch)
    try:
        scheduler.drain(grace)
        scheduler._thread.join(10)  # the loop ends once nothing runs
        assert not scheduler._thread.is_alive()
        chunks = sum(entry == ("chunk", request.id) for entry in batch.log)
        assert chunks < 100 and ("dropped", request.id) in batch.log, chunks
        assert scheduler.cut == [request.id] and [e.reason for e in events if isinstance(e, Failed)] == ["shutdown"]
    finally:
        scheduler.stop()


def test_bench_serve_runs_a_set_up_named_twice_as_a_control_beside_it(tmp_path, monkeypatch) -> None:
    from forerun.cli import main
    from forerun.models.testing import save_hf_folder, tiny_model

    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    folder = save_hf_folder(tiny_model(seed=0), tmp_path / "target")
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("abc abc", "hello")))
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench-serve",
                "--model",
                str(folder),
                "--quantization",
                "w8a8",
                "--setups",
                "off,off",
                "--concurrency",
                "2",
                "--requests-per-level",
                "1",
                "--max-tokens",
                "4",
                "--dataset",
                str(dataset),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    levels = json.loads((out / "results.json").read_text())
    assert [r["setup"] for r in levels] == ["off", "off#2"] and all(r["failures"] == 0 for r in levels)
    assert (out / "off#2.log").exists()
    assert "| off#2 | 2 | 2 |" in (out / "report.md").read_text()
