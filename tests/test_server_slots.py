"""llama.cpp's GET /slots over a running server: every lane by number, idle with /completion's
defaults, or with the request it runs (its id, its sampling settings, the tokens it has sent and may
still send); `fail_on_no_slot`'s 503 while every lane is busy; the lane a request takes (the lowest
free) and gives back; speculation said per lane; POST /slots/{id} refused as not done; under Ray
Serve, the replicas' lanes numbered on (the hub's part here, the whole in tests/test_cluster.py)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest
from test_server import CONTEXT, Served
from test_server_api import AUTH

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import Engine
from forerun.serve.backend import LocalBackend
from forerun.serve.scheduler import Delta, Request, Scheduler, Slot, _emit

STEP_S = 0.03  # a step of the slow engine: a request of 300 tokens runs about nine seconds


class SlowEngine(Engine):
    """The target's own engine, each request's step STEP_S slower (a request that stays running)."""

    def finish(self, run, plan, ver, timed=True):
        time.sleep(STEP_S)
        return super().finish(run, plan, ver, timed)


@pytest.fixture(scope="module")
def idle(target_tok):
    s = Served(LLM(target_tok), max_num_seqs=2)
    yield s
    s.stop()


def slots(served, query: str = "", status: int = 200) -> list | dict:
    r = httpx.get(served.url + "/slots" + query, headers=AUTH, timeout=30)
    assert r.status_code == status, r.text
    return r.json()


def test_idle_slots_show_every_lane_with_the_completion_defaults(idle) -> None:
    props = httpx.get(idle.url + "/props", headers=AUTH, timeout=30).json()
    lanes = slots(idle)
    assert [lane["id"] for lane in lanes] == [0, 1] and props["endpoint_slots"] is True
    for lane in lanes:
        assert lane["id_task"] == -1 and lane["is_processing"] is False and lane["n_ctx"] == CONTEXT
        assert lane["speculative"] is False and lane["params"]["speculative.n_max"] == 0
        assert {k: v for k, v in lane["params"].items() if not k.startswith("speculative.")} == (
            props["default_generation_settings"]["params"]
        )
        idle_token = {"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}
        assert lane["next_token"] == [idle_token] and lane["n_prompt_tokens"] == 0
    assert slots(idle, "?fail_on_no_slot=1") == lanes  # a lane is idle: no 503
    assert httpx.get(idle.url + "/slots", timeout=30).status_code == 401
    assert "/slots" in httpx.get(idle.url + "/openapi.json").json()["paths"]


def test_a_running_request_shows_in_its_slot_and_leaves_it_when_its_client_goes(target_tok) -> None:
    llm = LLM(target_tok)
    served = Served(llm, max_num_seqs=1, new_engine=lambda: SlowEngine(llm.target))
    body = {"prompt": "a b", "n_predict": 300, "ignore_eos": True, "temperature": 0.5, "top_k": 7, "seed": 3}
    try:
        with httpx.stream("POST", served.url + "/completion", json={**body, "stream": True}, headers=AUTH) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: ")).removeprefix("data: "))
            assert first["stop"] is False
            (lane,) = slots(served)
            assert lane["is_processing"] is True and lane["id_task"] >= 0
            params = lane["params"]
            assert (params["temperature"], params["top_k"], params["seed"], params["n_predict"]) == (0.5, 7, 3, 300)
            assert lane["n_prompt_tokens"] == first["tokens_evaluated"] > 0
            (token,) = lane["next_token"]
            assert 1 <= token["n_decoded"] < 300 and token["n_remain"] == 300 - token["n_decoded"]
            busy = slots(served, "?fail_on_no_slot=1", 503)["error"]
            assert busy["type"] == "unavailable_error" and busy["message"] == "no slot available"
            metrics = httpx.get(served.url + "/metrics", headers=AUTH, timeout=30).text
            assert 'status="503"' not in metrics  # polling a busy server is no rejected request
            assert slots(served, "?fail_on_no_slot=")[0]["is_processing"] is True  # empty: not asked
        deadline = time.monotonic() + 5  # the client left: cancelled at the next step, long before its end
        while slots(served)[0]["is_processing"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slots(served)[0]["id_task"] == -1
    finally:
        served.stop()


def test_a_request_takes_the_lowest_free_lane_and_counts_what_it_sent(target_tok) -> None:
    llm = LLM(target_tok)
    scheduler = Scheduler(BatchEngine(llm.new_engine, 3, engines=[llm.engine]))  # its loop never runs
    requests = [Request([1, 2], SamplingParams(max_tokens=9), on_event=lambda r, e: None) for _ in range(4)]
    scheduler._waiting.extend(requests[:3])  # as submit_group queues them
    assert [r.slot for r in scheduler._admit(wait=False)] == [0, 1, 2]
    scheduler._running.pop(requests[1].id)  # the middle lane's request ends
    scheduler._waiting.append(requests[3])
    assert [r.slot for r in scheduler._admit(wait=False)] == [1]
    requests[2].cancel()  # a cancelled request is not shown in its lane
    _emit(requests[3], Delta("x\ny", [5, 6]))
    _emit(requests[3], Delta("z", [7]))
    assert scheduler.slots() == [
        Slot(0, requests[0].id, requests[0].params, prompt_tokens=2),
        Slot(1, requests[3].id, requests[3].params, decoded=3, new_line=True, prompt_tokens=2),
        Slot(2),
    ]


def test_a_replica_sends_its_lanes_without_their_requests_bulky_settings() -> None:
    params = SamplingParams(temperature=0.5, prediction="x" * 10_000, logit_bias={3: 1.0}, stop=["\n"])
    light = Slot(0, 7, params, decoded=4, prompt_tokens=9).light()
    assert light.params.prediction is None and light.params.logit_bias == ()
    assert (light.params.temperature, light.params.stop, light.decoded, light.prompt_tokens) == (0.5, ("\n",), 4, 9)
    assert Slot(1).light() == Slot(1)


def test_a_speculating_server_says_so_in_every_lane(target_tok) -> None:
    from forerun.cli import build_parser
    from forerun.commands.serve import server_config

    def drafted(*flags: str) -> int:
        return server_config(build_parser().parse_args(["serve", "--model", "m", *flags]), 1024).speculative_tokens

    assert drafted() == 0 and drafted("--speculative-model", "d") == 5
    assert drafted("--speculative-method", "suffix", "--num-speculative-tokens", "3") == 3
    served = Served(LLM(target_tok), max_num_seqs=1, speculative_tokens=4)
    try:
        (lane,) = slots(served)
        assert lane["speculative"] is True and lane["params"]["speculative.n_max"] == 4
    finally:
        served.stop()


def test_slots_not_known_now_are_a_503_that_says_so(idle, monkeypatch) -> None:
    async def unknown(self):
        return None

    monkeypatch.setattr(LocalBackend, "slots", unknown)
    error = slots(idle, "", 503)["error"]
    assert error["code"] == "hub_unavailable" and "try again" in error["message"]


def test_saving_restoring_or_erasing_a_slot_is_refused_as_not_done(idle) -> None:
    r = httpx.post(idle.url + "/slots/0?action=save", json={"filename": "a.bin"}, headers=AUTH, timeout=30)
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert "prefix cache" in r.json()["error"]["message"]
    assert httpx.post(idle.url + "/slots/0?action=erase", timeout=30).status_code == 401


def test_the_replicas_lanes_are_numbered_on_in_their_names_order(monkeypatch) -> None:
    import forerun.cluster.hub as hub_module
    from forerun.cluster.ingress import ReplicaBackend
    from forerun.cluster.metrics import IngressMetrics

    clock = [100.0]
    monkeypatch.setattr(hub_module.time, "monotonic", lambda: clock[0])
    hub = hub_module.Hub(max_tokens=10)
    asyncio.run(hub.report("r2", "", 1, False, [Slot(0, 7, SamplingParams()), Slot(1)]))
    asyncio.run(hub.report("r1", "", 0, False, [Slot(0), Slot(1)]))
    asyncio.run(hub.report("r3", "", 0, False, [Slot(0)]))
    handle = SimpleNamespace(slots=SimpleNamespace(remote=hub.slots))  # the hub deployment's handle
    backend = ReplicaBackend(None, IngressMetrics(), handle)
    lanes = asyncio.run(backend.slots())
    assert [(s.id, s.task) for s in lanes] == [(0, None), (1, None), (2, 7), (3, None), (4, None)]  # r1, r2, r3
    clock[0] += 3.0
    asyncio.run(hub.report("r1", "", 0, False, [Slot(0), Slot(1)]))
    asyncio.run(hub.report("r3", "", 0, False, [Slot(0)]))
    clock[0] += hub_module.GAUGE_TTL - 2.0  # r2 silent longer than GAUGE_TTL: gone
    assert asyncio.run(backend.slots()) == [Slot(0), Slot(1), Slot(2)]  # r1's two, then r3's
