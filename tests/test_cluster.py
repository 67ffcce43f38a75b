"""`forerun serve --ray`: two replicas of a tiny model under a local Ray Serve, on loopback.

One `forerun serve --ray --num-replicas 2` process for the module (a local Ray cluster of 2 CPUs, a
replica on each); the tests talk to its ingress over HTTP as clients would, and join its Ray cluster
only to kill a replica. The parts that need no cluster (the shared answers, the placement rule, the
merged metrics, the flags) are tested on their own below.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="make test installs ray[serve] (requirements.txt)")

from forerun.api import LLM  # noqa: E402
from forerun.base.config import SamplingParams  # noqa: E402
from forerun.base.errors import ForerunError  # noqa: E402
from forerun.base.tools import tool_choice  # noqa: E402
from forerun.cluster.hub import SharedAnswers  # noqa: E402
from forerun.cluster.metrics import IngressMetrics  # noqa: E402
from forerun.cluster.router import rank  # noqa: E402
from forerun.models.testing import save_hf_folder, tiny_model  # noqa: E402
from forerun.verification.grammar import tool_call_grammar  # noqa: E402

KEY = "cluster-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, folder: Path, extra: tuple[str, ...] = ()) -> None:
        """`extra`: more `forerun serve` flags."""
        self.folder = folder
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log: list[str] = []
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "forerun.cli",
                "serve",
                "--ray",
                "--num-replicas",
                "2",
                "--replica-cpus",
                "1",
                "--model",
                str(folder),
                "--dtype",
                "float32",
                "--quantization",
                "none",
                "--speculative-method",
                "suffix",
                "--speculative-k-policy",
                "fixed",  # every step drafts K: acceptance counts that timing cannot move
                "--served-model-name",
                "tiny",
                "--max-model-len",
                "1000",
                "--api-key",
                KEY,
                "--per-request-spec-decode-stats",
                "summary",
                "--port",
                str(port),
                *extra,
            ],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **RAY_ENV, "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._read_log, daemon=True).start()
        self.address = self._wait_ready()

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "".join(self.log[-40:])
            said = [m for line in self.log if (m := re.search(r"Ray cluster at (\S+)\)", line))]
            if said:
                return said[0].group(1)
            time.sleep(0.2)
        raise AssertionError("forerun serve --ray did not come up:\n" + "".join(self.log[-40:]))

    def complete(self, prompt: str, key: str | None = None, **fields) -> httpx.Response:
        headers = {**AUTH, **({"X-Routing-Key": key} if key else {})}
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, **fields}
        return httpx.post(self.url + "/v1/completions", json=body, headers=headers, timeout=120)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", headers=AUTH, timeout=30).text

    def settled_metrics(self, counts_of: str = "forerun:request_success_total") -> str:
        """/metrics once every replica has reported its latest `counts_of` (two reports alike)."""
        last = None
        for _ in range(60):
            text = self.metrics()
            counts = [line for line in text.splitlines() if line.startswith(counts_of)]
            if counts == last:
                return text
            last = counts
            time.sleep(1.2)  # longer than a replica's report period
        raise AssertionError("the replicas' counts never settled")

    def replicas(self) -> set[str]:
        return {m for m in re.findall(r'replica="([^"]+)"', self.metrics()) if m != "ingress"}

    def wait_replicas(self, at_least: int, exclude: set[str] = frozenset()) -> set[str]:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = self.replicas() - exclude
            if len(found) >= at_least:
                return found
            time.sleep(0.5)
        raise AssertionError(f"replicas reporting: {self.replicas()}")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def counter(text: str, name: str, replica: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and f'replica="{replica}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_hf_folder(tiny_model(seed=0), tmp_path_factory.mktemp("cluster") / "tiny")


@contextlib.contextmanager
def two_replicas(folder: Path, extra: tuple[str, ...] = ()) -> Iterator[Cluster]:
    """A cluster of two replicas on `folder`'s model, stopped cleanly (exit 0) at the end."""
    running = Cluster(folder, extra=extra)
    try:
        running.wait_replicas(2)
        yield running
    finally:
        code = running.stop()
        assert code == 0, "".join(running.log[-40:])


@pytest.fixture(scope="module")
def cluster(folder):
    with two_replicas(folder) as running:
        yield running


def key_for(replica: str, replicas: set[str], avoid: set[str] = frozenset()) -> str:
    """A routing key whose preferred replica is `replica`."""
    for i in range(1000):
        key = f"key-{i}"
        if key not in avoid and rank(key, sorted(replicas))[0] == replica:
            return key
    raise AssertionError("no key found")


# --- against the running cluster -------------------------------------------------------------------


def test_openai_client_chat_and_completions_streamed_and_whole_equal_plain_greedy(cluster, folder) -> None:
    from openai import OpenAI

    plain = LLM(str(folder), dtype="float32")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    client = OpenAI(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0)
    prompt = "the quick brown fox"
    expected = plain.generate([prompt], params)[0].text
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected

    messages = [{"role": "user", "content": "hello there"}]
    expected_chat = plain.generate([messages], params)[0].text
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == expected_chat
    pieces = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == expected_chat


def test_a_structured_output_through_the_replicas_is_what_the_engine_writes(cluster, folder) -> None:
    regex = "[a-e]{3}-[0-9]{2}"
    plain = LLM(str(folder), dtype="float32")
    expected = plain.generate(["the quick"], SamplingParams(max_tokens=12, structured_outputs={"regex": regex}))[0].text
    assert re.fullmatch(regex, expected)
    body = {"model": "tiny", "prompt": "the quick", "max_tokens": 12, "temperature": 0, "guided_regex": regex}
    reply = httpx.post(cluster.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected
    bad = httpx.post(cluster.url + "/v1/completions", json={**body, "guided_regex": "(("}, headers=AUTH, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"


def test_a_required_tool_call_through_the_replicas_is_what_the_engine_writes(cluster, folder) -> None:
    tool = {"type": "function", "function": {"name": "flip", "parameters": {"properties": {}}, "strict": True}}
    messages = [{"role": "user", "content": "flip"}]
    plain = LLM(str(folder), dtype="float32")
    grammar = tool_call_grammar(tool_choice([tool], "required", False), plain.tokenizer)
    expected = plain.chat(messages, SamplingParams(max_tokens=80, structured_outputs=grammar), tools=[tool])[0].text
    body = {"model": "tiny", "messages": messages, "max_tokens": 80, "temperature": 0}
    body |= {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
    reply = httpx.post(cluster.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert expected == '<tool_call>\n{"name": "flip", "arguments": {}}\n</tool_call>'  # one call, its only arguments
    assert call["function"] == {"name": "flip", "arguments": "{}"} and choice["finish_reason"] == "tool_calls"


def test_the_key_and_client_mistakes_are_refused_as_forerun_serve_refuses_them(cluster) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4}
    no_key = httpx.post(cluster.url + "/v1/completions", json=body, timeout=30)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    bad = cluster.complete("x", temperature=-1)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    too_long = cluster.complete("x", max_tokens=5000)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    health = httpx.get(cluster.url + "/health", timeout=30)  # no key needed
    assert health.status_code == 200 and health.json() == {"status": "ok", "replicas": 2}
    unknown = httpx.get(cluster.url + "/v1/nothing", headers=AUTH, timeout=30)
    assert unknown.status_code == 404 and "error" in unknown.json()
    assert counter(cluster.metrics(), "forerun:request_rejected_total", "ingress") >= 3


def test_slots_number_both_replicas_lanes_on(cluster) -> None:
    deadline = time.monotonic() + 10  # both replicas' last reports within the hub's five seconds
    while True:
        r = httpx.get(cluster.url + "/slots", headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        lanes = r.json()
        if len(lanes) == 16 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [lane["id"] for lane in lanes] == list(range(16))  # two replicas of 8 lanes (--max-num-seqs)
    assert all(lane["speculative"] and lane["params"]["speculative.n_max"] == 5 for lane in lanes)
    props = httpx.get(cluster.url + "/props", headers=AUTH, timeout=30).json()
    assert props["total_slots"] == 16
    # The model's facts come from a replica: the folder's float32 tensors, counted.
    assert props["model_ftype"] == "(guessed) all F32" and props["chat_template_caps"]["supports_tools"]
    meta = httpx.get(cluster.url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["meta"]
    assert meta["n_params"] > 0 and meta["size"] == 4 * meta["n_params"]


def test_requests_go_to_the_replica_their_key_prefers_and_spread_over_both(cluster) -> None:
    replicas = cluster.wait_replicas(2)
    before = cluster.settled_metrics()
    served = {r: 0 for r in replicas}
    keys, i = {r: [] for r in replicas}, 0
    while any(len(chosen) < 4 for chosen in keys.values()):  # four keys that prefer each replica
        key = f"spread-{i}"
        preferred = keys[rank(key, sorted(replicas))[0]]
        if len(preferred) < 4:
            preferred.append(key)
        i += 1
    for key in sorted(k for chosen in keys.values() for k in chosen):
        response = cluster.complete(f"spread {key}", key=key, max_tokens=4)
        assert response.status_code == 200, response.text
        chosen = response.headers["x-forerun-replica"]
        assert chosen == rank(key, sorted(replicas))[0]
        served[chosen] += 1
    assert sorted(served.values()) == [4, 4], served
    deadline = time.monotonic() + 30
    while True:  # each replica's own count, as it reported it, agrees
        after = cluster.metrics()
        grown = {
            r: counter(after, "forerun:request_success_total", r) - counter(before, "forerun:request_success_total", r)
            for r in replicas
        }
        if grown == served:
            break
        assert time.monotonic() < deadline, (grown, served)
        time.sleep(0.5)


def test_an_answer_given_on_one_replica_drafts_on_the_other(cluster) -> None:
    replicas = sorted(cluster.wait_replicas(2))
    a, b = replicas
    # A prompt the tiny model answers without looping (a looping answer drafts from itself).
    prompt, fields = "zebra crossing", {"max_tokens": 60, "ignore_eos": True}
    # Earlier tests' answers may still be on their way to B (taken every 0.25 s, reported every 1 s):
    # count from a settled figure, so that the next answer B takes is A's answer to this prompt.
    shared = "forerun:shared_answers_received_total"
    received = counter(cluster.settled_metrics(shared), shared, b)
    first = cluster.complete(prompt, key=key_for(a, set(replicas)), **fields)
    assert first.headers["x-forerun-replica"] == a
    deadline = time.monotonic() + 30
    while counter(cluster.metrics(), shared, b) <= received:
        assert time.monotonic() < deadline, "replica B never took A's answer"
        time.sleep(0.3)
    again = cluster.complete(prompt, key=key_for(b, set(replicas)), **fields)
    assert again.headers["x-forerun-replica"] == b
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    kept_first = (first.json().get("speculative_decoding_stats") or {}).get("num_accepted_draft_tokens", 0)
    kept_again = again.json()["speculative_decoding_stats"]["num_accepted_draft_tokens"]
    # B never ran this prompt: what it drafted beyond what A could draft came from A's answer.
    assert kept_again >= kept_first + 15, (kept_first, kept_again)


def _stream(cluster: Cluster, key: str, results: dict, name: str) -> None:
    events, done, replica = [], False, None
    try:
        with httpx.stream(
            "POST",
            cluster.url + "/v1/completions",
            headers={**AUTH, "X-Routing-Key": key},
            timeout=120,
            json={"model": "tiny", "prompt": name, "max_tokens": 900, "ignore_eos": True, "stream": True},
        ) as r:
            replica = r.headers.get("x-forerun-replica")
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        results[name] = ("stream", r.status_code, replica, events, done)
    except httpx.HTTPError as exc:
        results[name] = ("stream", f"{type(exc).__name__}: {exc}", replica, events, done)


def _whole(cluster: Cluster, key: str, results: dict, name: str) -> None:
    try:
        r = cluster.complete(name, key=key, max_tokens=900, ignore_eos=True)
        results[name] = ("whole", r.status_code, r.headers.get("x-forerun-replica"), r.json(), None)
    except httpx.HTTPError as exc:
        results[name] = ("whole", f"{type(exc).__name__}: {exc}", None, None, None)


def test_a_replica_killed_during_traffic_loses_no_request_without_an_error(cluster, monkeypatch) -> None:
    replicas = cluster.wait_replicas(2)
    victim = sorted(replicas)[0]
    keys = [key_for(victim, replicas, avoid=set()), key_for(sorted(replicas)[1], replicas)]
    results: dict = {}
    threads = []
    for i in range(3):
        for key in keys:
            threads.append(threading.Thread(target=_stream, args=(cluster, key, results, f"s{i}{key}")))
            threads.append(threading.Thread(target=_whole, args=(cluster, key, results, f"w{i}{key}")))
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while counter(cluster.metrics(), "forerun:num_requests_running", victim) == 0:
        assert time.monotonic() < deadline, "no request reached the victim"
        time.sleep(0.2)
    for name, value in RAY_ENV.items():
        monkeypatch.setenv(name, value)
    ray.init(address=cluster.address, namespace="serve", logging_level="ERROR", log_to_driver=False)
    try:
        ray.kill(ray.get_actor(f"SERVE_REPLICA::forerun#ForerunEngine#{victim}", namespace="serve"))
    finally:
        ray.shutdown()
    for t in threads:
        t.join(180)
    assert len(results) == len(threads), "a request never ended"
    cut = 0
    for name, (kind, status, replica, body, done) in results.items():
        assert status == 200, (name, status, body)
        if kind == "whole":  # held until complete, so run again elsewhere when its replica was lost
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 900
            continue
        assert done, name  # every stream ends in [DONE]
        last = body[-1]
        if "error" in last:
            assert last["error"]["code"] == "replica_lost" and replica == victim
            cut += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    text = cluster.metrics()
    assert counter(text, "forerun:request_failure_total", "ingress") == cut
    # Ray Serve starts a new replica in the victim's place; it joins the routing.
    fresh = cluster.wait_replicas(1, exclude=replicas)
    newcomer = fresh.pop()
    current = (replicas - {victim}) | {newcomer}
    deadline = time.monotonic() + 60  # the ingress learns of the newcomer a moment after Serve lists it
    while True:
        response = cluster.complete("after", key=key_for(newcomer, current), max_tokens=4)
        assert response.status_code == 200
        if response.headers["x-forerun-replica"] == newcomer:
            break
        assert time.monotonic() < deadline, "the new replica never joined the routing"
        time.sleep(0.5)


# --- the parts, without a cluster ---------------------------------------------------------------


def test_the_hub_names_the_replicas_that_reported_lately(monkeypatch) -> None:
    import asyncio

    import forerun.cluster.hub as hub_module

    clock = [100.0]
    monkeypatch.setattr(hub_module.time, "monotonic", lambda: clock[0])
    hub = hub_module.Hub(max_tokens=10)
    asyncio.run(hub.report("r1", "text"))
    clock[0] = 105.0
    asyncio.run(hub.report("r2", "text"))
    assert asyncio.run(hub.live(10)) == ["r1", "r2"]
    clock[0] = 112.0
    assert asyncio.run(hub.live(10)) == ["r2"]
    clock[0] = 120.0
    assert asyncio.run(hub.live(10)) == []


def test_shared_answers_keep_the_newest_tokens_and_skip_the_readers_own() -> None:
    answers = SharedAnswers(max_tokens=10)
    answers.publish("a", [1, 2, 3, 4])
    answers.publish("b", [5, 6, 7])
    cursor, fresh = answers.since("b", 0)
    assert fresh == [[1, 2, 3, 4]] and cursor == 2
    answers.publish("a", [8, 9, 10, 11])  # 11 tokens: the oldest answer goes
    assert answers.size == 7 and [a.token_ids for a in answers.answers] == [[5, 6, 7], [8, 9, 10, 11]]
    assert answers.since("b", cursor) == (3, [[8, 9, 10, 11]])
    assert answers.since("c", 0)[1] == [[5, 6, 7], [8, 9, 10, 11]]  # a replica starting takes what is kept


def test_a_replica_leaving_moves_only_the_keys_it_held() -> None:
    three = ["r1", "r2", "r3"]
    keys = [f"k{i}" for i in range(300)]
    before = {k: rank(k, three)[0] for k in keys}
    after = {k: rank(k, ["r1", "r3"])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r2" for k in moved)
    assert 60 < sum(1 for k in keys if before[k] == "r2") < 140  # about a third each


def test_ingress_metrics_label_each_source_and_count_only_lost_requests() -> None:
    metrics = IngressMetrics()
    metrics.failed("engine")  # the replica counted it
    metrics.failed("replica")
    metrics.failed("relay")  # the ingress's call failed: no replica had it to count
    metrics.rejected(400)
    replica = 'forerun:request_success_total{finished_reason="stop"} 3.0\n'
    body, _ = metrics.merged({"r1": "# TYPE forerun:request_success_total counter\n" + replica})
    text = body.decode()
    assert 'forerun:request_failure_total{replica="ingress"} 2.0' in text
    assert 'forerun:request_rejected_total{replica="ingress",status="400"} 1.0' in text
    assert 'forerun:request_success_total{finished_reason="stop",replica="r1"} 3.0' in text
    assert text.count("# TYPE forerun:request_success_total counter") == 1


def test_replica_flags_without_ray_and_bad_serve_config_args_are_clear_errors(folder, capsys) -> None:
    from forerun.cli import main
    from forerun.cluster.app import build_app

    assert main(["serve", "--model", str(folder), "--num-replicas", "2"]) == 2
    assert "--num-replicas is for replicas: add --ray" in capsys.readouterr().err
    with pytest.raises(ForerunError, match="--min-replicas and --max-replicas"):
        build_app({"model": str(folder), "min_replicas": 1})
    with pytest.raises(ForerunError, match="replica_count"):
        build_app({"model": str(folder), "replica_count": 2})
    app = build_app({"model": str(folder), "num_replicas": 2, "speculative_method": "suffix"})
    assert type(app).__name__ == "Application"


def test_without_ray_the_error_names_the_install_command(monkeypatch) -> None:
    import forerun.cluster.app as cluster_app

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    with pytest.raises(ForerunError, match=r"pip install 'ray\[serve\]==2.60.0'"):
        cluster_app._serve()


def test_bench_serve_places_a_set_up_on_ray_replicas() -> None:
    from forerun.commands.bench_serve import setup_serve

    assert setup_serve("off") == (None, [])
    policy, flags = setup_serve("auto@ray2x1")
    assert policy == "adaptive" and flags == ["--ray", "--num-replicas", "2", "--replica-cpus", "1"]
    _, control = setup_serve("auto@ray2x1-p2c")
    assert control[-4:] == ["--routing", "p2c", "--shared-answers-tokens", "0"]
    _, whole = setup_serve("off-whole@ray1x2")
    assert whole == ["--prefill-share", "inf", "--ray", "--num-replicas", "1", "--replica-cpus", "2"]
    for bad in ("auto@ray0", "auto@ray2x0", "auto@k8s", "fast@ray2"):
        with pytest.raises(ForerunError):
            setup_serve(bad)


def test_autoscaling_flags_become_ray_serves_autoscaling_config(folder) -> None:
    from forerun.cli import build_parser
    from forerun.cluster.app import _scaling

    def scaling(*flags: str) -> dict:
        return _scaling(build_parser().parse_args(["serve", "--model", str(folder), "--ray", *flags]))

    assert scaling("--num-replicas", "3") == {"num_replicas": 3}
    auto = scaling("--min-replicas", "0", "--max-replicas", "4", "--max-num-seqs", "6")["autoscaling_config"]
    assert auto == {"min_replicas": 0, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 6}
    with pytest.raises(ForerunError, match="0 <= min <= max"):
        scaling("--min-replicas", "3", "--max-replicas", "2")


class _Replica:
    def __init__(self, name: str) -> None:
        self.replica_id = type("ReplicaID", (), {"unique_id": name})()


def _choose(lengths: dict[str, int], key: str | None, imbalance: int = 1) -> list[list[str]]:
    """AffinityRouter's ranks for a job keyed `key` over replicas with these queue lengths."""
    import asyncio

    from ray.serve.request_router import PendingRequest

    from forerun.cluster.jobs import Job
    from forerun.cluster.router import AffinityRouter

    replicas = {name: _Replica(name) for name in lengths}
    router = AffinityRouter.__new__(AffinityRouter)  # no Ray: only the choice is under test
    router.initialize_state(imbalance=imbalance)

    async def queue_lengths(candidates):
        return {r.replica_id: lengths[r.replica_id.unique_id] for r in candidates}

    router._queue_lengths = queue_lengths
    args = [Job([[1, 2]], [[SamplingParams()]], key)] if key is not None else []
    pending = PendingRequest.__new__(PendingRequest)
    pending.args = args
    ranks = asyncio.run(router.choose_replicas(list(replicas.values()), pending))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_the_router_prefers_the_keys_replica_until_it_is_busier_than_the_imbalance() -> None:
    names = ["r1", "r2", "r3"]
    key = "some question"
    first, *rest = rank(key, names)
    idle = {n: 0 for n in names}
    assert _choose(idle, key) == [[first], [n for n in names if n != first]]
    assert _choose({**idle, first: 1}, key)[0] == [first]  # one more than the least: still its own
    busy = _choose({**idle, first: 2}, key)  # two more: the power of two choices
    assert len(busy) == 1 and len(busy[0]) == 2
    assert _choose({**idle, first: 5}, key, imbalance=8)[0] == [first]  # a looser bound keeps it
    assert len(_choose(idle, None)[0]) == 2  # no key: two at random


def test_a_job_refused_by_the_next_replica_after_its_first_was_lost_is_a_503_to_send_again() -> None:
    from forerun.cluster.ingress import _Relayed
    from forerun.cluster.jobs import Refused, Started
    from forerun.serve.scheduler import Failed

    events = []
    request = type("R", (), {"on_event": staticmethod(lambda r, event: events.append(event))})()
    loop = asyncio.new_event_loop()
    try:
        relayed = _Relayed([request], loop.create_future(), whole=True)
        relayed.take(Started("r1"))  # the first replica took it, then was lost; the next refuses:
        relayed.take(Refused("12 requests are already waiting", None, 503, "server_error", "queue_full"))
    finally:
        loop.close()
    (failed,) = events
    assert isinstance(failed, Failed) and failed.reason == "replica"  # 503 replica_lost, counted by the ingress
    assert "another refused it (12 requests are already waiting); send it again" in failed.message
