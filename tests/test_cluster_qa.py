"""`forerun serve --ray` where clients and replicas misbehave: clients that leave, odd routing keys,
jobs too large for a replica, the hub restarting, a request during shutdown; and flags refused
before Ray starts.

One cluster for the module (tests/test_cluster.py's, with a short waiting queue); the tests against
it run in file order, the shutdown last.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

ray = pytest.importorskip("ray", reason="make test installs ray[serve] (requirements.txt)")

from test_cluster import AUTH, KEY, RAY_ENV, Cluster, counter, key_for, two_replicas  # noqa: E402
from test_cluster import folder as folder  # noqa: E402, F401 - the module's tiny model folder

from forerun.base.errors import ForerunError  # noqa: E402

RUNNING = "forerun:num_requests_running"
SUCCESS = "forerun:request_success_total"
SHARED = "forerun:shared_answers_received_total"
LONG = {"max_tokens": 900, "ignore_eos": True}  # an answer that outlasts the test's moves


@pytest.fixture(scope="module")
def qa(folder):
    with two_replicas(folder, ("--max-waiting", "8")) as running:
        yield running


def _wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def _kill(cluster: Cluster, deployment: str, replica: str | None = None) -> str:
    """Kill one replica of `deployment` (the first listed when `replica` is None); its id."""
    ray.init(address=cluster.address, namespace="serve", logging_level="ERROR", log_to_driver=False)
    try:
        prefix = f"SERVE_REPLICA::forerun#{deployment}#"
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
        name = prefix + replica if replica is not None else sorted(names)[0]
        assert name in names, names
        ray.kill(ray.get_actor(name, namespace="serve"))
        return name.removeprefix(prefix)
    finally:
        ray.shutdown()


def _stream_events(response: httpx.Response, count: int) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: {"):
            events.append(json.loads(line[6:]))
        if len(events) >= count:
            break
    return events


# --- against the running cluster -------------------------------------------------------------------


def test_a_client_leaving_mid_stream_frees_the_replicas_lanes(qa) -> None:
    replicas = qa.wait_replicas(2)
    victim = sorted(replicas)[0]
    before = counter(qa.settled_metrics(), SUCCESS, victim)
    body = {"model": "tiny", "prompt": "leaving early", "stream": True, **LONG}
    headers = {**AUTH, "X-Routing-Key": key_for(victim, replicas)}
    with httpx.stream("POST", qa.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.headers["x-forerun-replica"] == victim
        assert len(_stream_events(r, 3)) == 3
    # The client is gone: the replica's lane is freed, and the request never finishes there.
    _wait_for(lambda: counter(qa.metrics(), RUNNING, victim) == 0, 60, "the replica still runs the request")
    after = counter(qa.settled_metrics(), SUCCESS, victim)
    assert after == before, f"the request ran to its end: {before} -> {after} finished"


def test_routing_keys_long_or_not_ascii_are_taken_and_keep_their_replica(qa) -> None:
    for key in (b"k" * 8000, "clé-ü-日本".encode(), b"\xff\xfe", b"a  b"):
        headers = {**AUTH, "X-Routing-Key": key}
        body = {"model": "tiny", "prompt": "odd keys", "max_tokens": 4}
        first = httpx.post(qa.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert first.status_code == 200, (key[:20], first.text)
        again = httpx.post(qa.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert again.headers["x-forerun-replica"] == first.headers["x-forerun-replica"], key[:20]
    # A huge key is taken too (its first 256 characters place the request).
    huge = httpx.post(qa.url + "/v1/completions", json=body, headers={**AUTH, "X-Routing-Key": "k" * 200_000})
    assert huge.status_code == 200, huge.text
    assert qa.complete("after the odd keys", max_tokens=4).status_code == 200


def test_concurrent_requests_with_different_keys_each_get_their_own_answer(qa) -> None:
    replicas = qa.wait_replicas(2)
    keys = [key_for(r, replicas, avoid={f"key-{i}" for i in range(j)}) for j in range(3) for r in sorted(replicas)]
    alone = {k: qa.complete(f"concurrent {k}", key=k, max_tokens=16).json()["choices"][0]["text"] for k in keys}
    results: dict = {}

    def ask(key: str) -> None:
        results[key] = qa.complete(f"concurrent {key}", key=key, max_tokens=16)

    threads = [threading.Thread(target=ask, args=(k,)) for k in keys for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for key in keys:
        assert results[key].status_code == 200, results[key].text
        assert results[key].json()["choices"][0]["text"] == alone[key]


def test_a_job_larger_than_a_replicas_lanes_and_queue_is_a_400_naming_n(qa) -> None:
    # 8 lanes and 8 waiting per replica: 2 prompts x 9 samples could never be taken.
    body = {"model": "tiny", "prompt": ["one", "two"], "n": 9, "max_tokens": 2}
    r = httpx.post(qa.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "could never be taken" in r.json()["error"]["message"]
    streamed = httpx.post(qa.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "n"
    fits = httpx.post(qa.url + "/v1/completions", json={**body, "n": 8}, headers=AUTH, timeout=120)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 16


def test_logprobs_logit_bias_and_penalties_answer_as_forerun_serve_does(qa, folder) -> None:
    from test_server import Served

    from forerun.api import LLM

    local = Served(LLM(str(folder), dtype="float32"), api_key=KEY, max_num_seqs=8)
    try:
        fields = {
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": 2,
            "logit_bias": {"5": 3.5, "7": -100},
            "presence_penalty": 0.5,
            "frequency_penalty": 0.3,
        }
        for body in (
            {"prompt": ["a batch", "of two"], "n": 2, **fields},
            {"prompt": "echoed", "echo": True, **fields},
        ):
            want = httpx.post(local.url + "/v1/completions", json={"model": "tiny", **body}, headers=AUTH).json()
            got = httpx.post(qa.url + "/v1/completions", json={"model": "tiny", **body}, headers=AUTH).json()
            for choice in (*want["choices"], *got["choices"]):
                choice.pop("speculative_decoding_stats", None)
            assert _rounded(got["choices"]) == _rounded(want["choices"]) and got["usage"] == want["usage"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2, **fields, "logprobs": True}
        want = httpx.post(local.url + "/v1/chat/completions", json={"model": "tiny", **chat}, headers=AUTH).json()
        got = httpx.post(qa.url + "/v1/chat/completions", json={"model": "tiny", **chat}, headers=AUTH).json()
        assert _rounded(got["choices"][0]["logprobs"]) == _rounded(want["choices"][0]["logprobs"])
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
    finally:
        local.stop()


def _rounded(value):
    """`value` with its floats to 4 decimals: a replica verifies drafts in passes of several rows,
    whose sums may differ from one row's in the last bits."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def test_after_the_hub_restarts_answers_are_shared_again_and_health_recovers(qa) -> None:
    replicas = sorted(qa.wait_replicas(2))
    a, b = replicas
    for i in range(3):  # answers published before the restart: the replicas' cursors move on
        assert qa.complete(f"before the restart {i}", key=key_for(a, set(replicas)), max_tokens=8).status_code == 200
    _wait_for(lambda: counter(qa.metrics(), SHARED, b) >= 3, 30, "B never took A's answers")
    _kill(qa, "ForerunHub")

    def healthy() -> bool:
        r = httpx.get(qa.url + "/health", timeout=30)
        return r.status_code == 200 and r.json()["replicas"] == 2

    _wait_for(healthy, 120, "/health never came back after the hub restarted")
    received = counter(qa.settled_metrics(SHARED), SHARED, b)
    assert qa.complete("after the restart", key=key_for(a, set(replicas)), max_tokens=8).status_code == 200
    _wait_for(lambda: counter(qa.metrics(), SHARED, b) > received, 30, "B never took A's answer after the restart")


def test_requests_during_shutdown_end_and_the_command_exits_0(qa) -> None:
    results: dict = {}

    def long_stream() -> None:
        body = {"model": "tiny", "prompt": "cut by the shutdown", "stream": True, **LONG}
        try:
            with httpx.stream("POST", qa.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
                lines = [line for line in r.iter_lines() if line]
            results["stream"] = (r.status_code, lines[-2:])
        except httpx.HTTPError as exc:
            results["stream"] = (type(exc).__name__, [])

    def late() -> None:
        try:
            r = qa.complete("sent during the shutdown", max_tokens=4)
            results["late"] = (r.status_code, r.text)
        except httpx.HTTPError as exc:
            results["late"] = (type(exc).__name__, "")

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    _wait_for(lambda: sum(counter(qa.metrics(), RUNNING, r) for r in qa.replicas()) > 0, 30, "nothing ran")
    qa.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    asking = threading.Thread(target=late)
    asking.start()
    for t in (streaming, asking):
        t.join(90)
    assert set(results) == {"stream", "late"}, f"a request never ended: {results}"
    assert qa.process.wait(90) == 0
    # As forerun serve: the stream finishes within its grace, or ends with an error event; then [DONE].
    status, last = results["stream"]
    assert status == 200 and last[-1] == "data: [DONE]", results
    ended = json.loads(last[0].removeprefix("data: "))
    assert ended.get("error", {}).get("code") == "shutting_down" or ended["choices"][0]["finish_reason"], results
    # The late request: run (its replica had not heard yet), refused, or the port already closed.
    status, text = results["late"]
    assert status in (200, 503, "ConnectError"), results
    if status == 503:
        assert json.loads(text)["error"]["code"] == "shutting_down"


# --- flags, without a cluster ----------------------------------------------------------------------


def _serve_args(folder, *flags: str):
    from forerun.cli import build_parser

    return build_parser().parse_args(["serve", "--model", str(folder), "--ray", *flags])


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--min-replicas", "3", "--max-replicas", "2"), "0 <= min <= max"),
        (("--min-replicas", "1"), "both --min-replicas and --max-replicas"),
        (("--min-replicas", "0", "--max-replicas", "0"), "--max-replicas must be at least 1"),
        (("--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "0"), "--target-ongoing"),
        (("--target-ongoing-requests", "4"), "--target-ongoing-requests is for autoscaling"),
        (("--num-replicas", "3", "--min-replicas", "1", "--max-replicas", "2"), "--num-replicas"),
        (("--replica-cpus", "inf"), "--replica-cpus"),
    ],
)
def test_bad_replica_flags_are_refused_before_ray_starts(folder, monkeypatch, flags, said) -> None:
    import forerun.cluster.app as cluster_app

    def started(*args, **kwargs):
        raise AssertionError("Ray started")

    monkeypatch.setattr(ray, "init", started)
    with pytest.raises(ForerunError, match=said):
        cluster_app.run_cluster(_serve_args(folder, "--port", "18999", *flags))
    with pytest.raises(ForerunError, match=said):
        cluster_app.build_app({"model": str(folder), **{f[2:]: v for f, v in zip(flags[::2], flags[1::2])}})


def test_replicas_needing_more_cpus_than_the_local_cluster_has_are_refused(folder, monkeypatch) -> None:
    from ray import serve

    import forerun.cluster.app as cluster_app

    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:6379"))
    monkeypatch.setattr(cluster_app.lifecycle, "check_free", lambda *args: None)
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    monkeypatch.setattr(serve, "start", lambda **kwargs: (_ for _ in ()).throw(AssertionError("deployed")))
    args = _serve_args(folder, "--port", "18999", "--num-replicas", "3", "--replica-cpus", "1")
    with pytest.raises(ForerunError, match=r"3 replicas x 1 CPU.*has 2"):
        cluster_app.run_cluster(args)
    auto = _serve_args(folder, "--port", "18999", "--min-replicas", "0", "--max-replicas", "9", "--replica-cpus", "2")
    with pytest.raises(AssertionError, match="deployed"):  # one replica at first: it fits
        cluster_app.run_cluster(auto)
    assert math.isfinite(args.replica_cpus)


def test_replicas_that_cannot_start_end_the_command_with_their_reason(tmp_path) -> None:
    import os

    missing = tmp_path / "no-such-model"
    done = subprocess.run(
        [sys.executable, "-m", "forerun.cli", "serve", "--ray", "--model", str(missing), "--port", "18998"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **RAY_ENV},
    )
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr[-3000:]
    assert last.startswith("error:") and "no-such-model: no such file or folder" in last, last


def test_a_replica_takes_the_answers_of_a_restarted_hub_though_its_cursor_is_further() -> None:
    import asyncio

    from forerun.cluster.hub import Hub

    old = Hub(max_tokens=100)
    for i in range(5):
        asyncio.run(old.publish("a", [i, i + 1]))
    cursor, fresh = asyncio.run(old.since("b", None))
    assert len(fresh) == 5
    new = Hub(max_tokens=100)  # Ray Serve's replacement: empty, counting from 1 again
    asyncio.run(new.publish("a", [7, 8]))
    asyncio.run(new.publish("a", [9, 10]))
    cursor, fresh = asyncio.run(new.since("b", cursor))
    assert fresh == [[7, 8], [9, 10]]
    assert asyncio.run(new.since("b", cursor))[1] == []


def test_the_hub_waits_a_shutdown_for_replicas_busy_or_not_yet_draining() -> None:
    import asyncio

    from forerun.cluster.hub import Hub

    hub = Hub(max_tokens=10)
    assert asyncio.run(hub.report("r1", "", 2, False)) is None
    asyncio.run(hub.drain(5.0))
    assert asyncio.run(hub.stopping())
    assert asyncio.run(hub.busy()) == 3  # two requests, and it has not heard yet
    assert asyncio.run(hub.report("r1", "", 1, True)) == 5.0
    assert asyncio.run(hub.busy()) == 1
    asyncio.run(hub.report("r1", "", 0, True))
    assert asyncio.run(hub.busy()) == 0
