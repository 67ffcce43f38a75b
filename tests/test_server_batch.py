"""A batch of prompts in one completions request, as OpenAI and vLLM take it: `prompt` as a list of
strings or of token-id lists. Choice prompt_index * n + sample_index is that prompt's sample, the
same text as the prompt sent alone (greedy, and seeded with a deterministic drafter); usage sums
over the prompts and choices; every prompt is checked before any runs; the batch's samples are one
group against the lanes and the queue; a client that leaves frees every prompt's samples."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from test_server import CONTEXT, KEY, NAME, Served

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.cluster.jobs import Job
from forerun.engine.engine import Engine
from forerun.serve.inflight import new_group
from forerun.serve.requests import MAX_PROMPTS

AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["abc", "hello there", "xyzxyzxyz"]


@pytest.fixture(scope="module")
def plain(target_tok):
    s = Served(LLM(target_tok))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def speculative(target_tok):
    llm = LLM(target_tok, speculative_method="ngram", num_speculative_tokens=3, speculative_k_policy="fixed")
    s = Served(llm)
    yield s
    s.stop()


def send(served, body: dict) -> httpx.Response:
    return httpx.post(served.url + "/v1/completions", json={"model": NAME, **body}, headers=AUTH, timeout=60)


def post(served, body: dict) -> dict:
    r = send(served, body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(served, body: dict) -> list[dict]:
    """The chunks of a streamed request; [DONE] once, last."""
    body = {"model": NAME, **body, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    return [json.loads(line[6:]) for line in lines[:-1]]


def alone(served, prompt, body: dict) -> dict:
    """The one choice of `prompt` sent alone with `body`'s other fields."""
    out = post(served, {**body, "prompt": prompt, "n": 1})
    assert len(out["choices"]) == 1
    return out


def refused(r: httpx.Response, param: str | None, words: str, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error
    return error


# --- choices -------------------------------------------------------------------------------------


def test_each_prompt_gets_its_greedy_answer_in_order(plain) -> None:
    body = {"prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
    out = post(plain, body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    tok = plain.llm.tokenizer
    want = [Engine(plain.llm.target).generate(tok.encode(p), SamplingParams(max_tokens=12)).text for p in PROMPTS]
    assert [c["text"] for c in out["choices"]] == want
    ids = post(plain, {**body, "prompt": [tok.encode(p) for p in PROMPTS]})
    assert [c["text"] for c in ids["choices"]] == want  # token-id lists: the same prompts


@pytest.mark.parametrize("server", ["plain", "speculative"])
def test_choice_p_times_n_plus_i_is_sample_i_of_prompt_p_with_seed_plus_i(server, request) -> None:
    served = request.getfixturevalue(server)
    body = {"prompt": PROMPTS[:2], "max_tokens": 10, "temperature": 1.0, "seed": 21, "n": 3}
    out = post(served, body)
    assert [c["index"] for c in out["choices"]] == list(range(6))
    want = [alone(served, p, {**body, "seed": 21 + i})["choices"][0]["text"] for p in PROMPTS[:2] for i in range(3)]
    assert [c["text"] for c in out["choices"]] == want
    assert len(set(want)) > 2  # the seeds and the prompts do differ


def test_usage_sums_prompt_tokens_over_prompts_and_completion_tokens_over_choices(plain) -> None:
    body = {"prompt": PROMPTS, "max_tokens": 9, "temperature": 0.8, "seed": 3, "n": 2}
    out = post(plain, body)
    singles = [alone(plain, p, {**body, "seed": 3 + i})["usage"] for p in PROMPTS for i in range(2)]
    prompt_tokens = sum(len(plain.llm.tokenizer.encode(p)) for p in PROMPTS)
    completion_tokens = sum(u["completion_tokens"] for u in singles)
    usage = out["usage"]
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == completion_tokens
    assert usage["total_tokens"] == prompt_tokens + completion_tokens


def test_a_streamed_batch_interleaves_its_choices_and_equals_the_whole_answer(plain) -> None:
    body = {"prompt": PROMPTS, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "n": 2}
    whole = post(plain, body)
    chunks = stream(plain, {**body, "stream_options": {"include_usage": True}})
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in choice_chunks)  # OpenAI's null usage
    order = [c["choices"][0]["index"] for c in choice_chunks]
    assert set(order) == set(range(6))
    assert order != sorted(order)  # chunks of different prompts interleave
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in choice_chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(m["text"] for m in mine) == choice["text"]
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == [choice["finish_reason"]]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]


def test_echo_and_logprobs_are_each_prompt_s_own(plain) -> None:
    body = {"prompt": ["hello", "abc"], "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    out = post(plain, body)
    for prompt, choice in zip(["hello", "abc"], out["choices"]):
        single = alone(plain, prompt, body)["choices"][0]
        assert choice["text"].startswith(prompt) and choice["text"] == single["text"]
        mine, theirs = choice["logprobs"], single["logprobs"]
        assert mine["tokens"] == theirs["tokens"] and mine["text_offset"] == theirs["text_offset"]
        assert mine["token_logprobs"][0] is None and theirs["token_logprobs"][0] is None
        assert mine["token_logprobs"][1:] == pytest.approx(theirs["token_logprobs"][1:], abs=1e-4)  # batched rows
        for a, b in zip(mine["top_logprobs"][1:], theirs["top_logprobs"][1:]):
            assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
        assert choice["logprobs"]["tokens"][: len(prompt)] == list(prompt)
    scored = post(plain, {**body, "max_tokens": 0})
    assert [c["text"] for c in scored["choices"]] == ["hello", "abc"]
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == 8
    chunks = stream(plain, body)
    for index, choice in enumerate(out["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(m["text"] for m in mine) == choice["text"]
        assert [t for m in mine for t in m["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]


def test_the_openai_client_takes_a_list_of_prompts(plain) -> None:
    client = plain.client()
    whole = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=8, temperature=0)
    texts = [alone(plain, p, {"max_tokens": 8, "temperature": 0})["choices"][0]["text"] for p in PROMPTS]
    assert [c.index for c in whole.choices] == [0, 1, 2] and [c.text for c in whole.choices] == texts
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=PROMPTS,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_a_one_prompt_list_answers_as_the_prompt_does(plain) -> None:
    body = {"max_tokens": 6, "temperature": 0}
    assert post(plain, {**body, "prompt": ["abc"]})["choices"] == post(plain, {**body, "prompt": "abc"})["choices"]


# --- checks --------------------------------------------------------------------------------------


@pytest.fixture
def submissions(plain, monkeypatch) -> list:
    """What reached the scheduler (each group submitted), so a refusal can show nothing ran."""
    seen: list = []
    submit = plain.scheduler.submit_group
    monkeypatch.setattr(plain.scheduler, "submit_group", lambda group: seen.append(group) or submit(group))
    return seen


BAD_IN_THE_MIDDLE = [
    (["abc", "", "def"], "prompt", "prompt[1]: prompt is empty"),
    ([[5, 6], [10**9], [7]], "prompt", "prompt[1]: "),
    ([[5, 6], [], [7]], "prompt", "prompt[1]: "),
    (["abc", "x\udfff", "def"], "prompt", "prompt[1]: "),
    (["abc", "a" * CONTEXT, "def"], "max_tokens", "prompt[1]: "),  # with max_tokens, past the context
    (["abc", "a" * (CONTEXT * 16 + 1), "def"], "prompt", "prompt[1]: "),  # past the characters' cap
    (["abc", "def", "ghi", [5, 6]], "prompt", "strings or token-id lists"),  # mixed kinds
    (["abc", 5], "prompt", "prompt"),
]


@pytest.mark.parametrize("prompt,param,words", BAD_IN_THE_MIDDLE, ids=[str(i) for i in range(len(BAD_IN_THE_MIDDLE))])
def test_a_bad_prompt_in_a_batch_is_named_and_nothing_runs(plain, submissions, prompt, param, words) -> None:
    r = httpx.post(
        plain.url + "/v1/completions",
        content=json.dumps({"model": NAME, "prompt": prompt, "max_tokens": 4}),
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=60,
    )
    refused(r, param, words)
    assert submissions == [] and plain.scheduler.counts() == (0, 0)


def test_more_prompts_than_the_cap_are_a_400(plain, submissions) -> None:
    refused(send(plain, {"prompt": ["a"] * (MAX_PROMPTS + 1), "max_tokens": 1}), "prompt", str(MAX_PROMPTS))
    assert submissions == []
    out = post(plain, {"prompt": ["a"] * MAX_PROMPTS, "max_tokens": 1, "temperature": 0})
    assert len(out["choices"]) == MAX_PROMPTS and len({c["text"] for c in out["choices"]}) == 1


def test_a_batch_s_samples_are_one_group_taken_all_or_none(target_tok) -> None:
    served = Served(LLM(target_tok), max_waiting=1, max_num_seqs=2)
    try:
        assert len(post(served, {"prompt": PROMPTS[:2], "max_tokens": 3, "n": 1})["choices"]) == 2
        refused(send(served, {"prompt": PROMPTS[:2], "max_tokens": 3, "n": 2}), "n", "never")  # 4 > 2 + 1
        long = {"prompt": ["abc", "def"], "max_tokens": 500, "ignore_eos": True}
        thread = threading.Thread(target=send, args=(served, long))
        thread.start()  # both lanes taken
        served.wait_counts((2, 0), 20)
        r = send(served, {"prompt": PROMPTS[:2], "max_tokens": 3})  # two would wait: one may
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        assert served.scheduler.counts() == (2, 0)  # neither prompt was queued
        thread.join(120)
    finally:
        served.stop()


# --- clients that go away ------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
def test_a_client_gone_mid_batch_frees_every_prompt_s_samples(plain, monkeypatch, streamed) -> None:
    step = plain.batch.step
    monkeypatch.setattr(plain.batch, "step", lambda *a: time.sleep(0.02) or step(*a))  # 500 tokens: 10 s
    body = {"model": NAME, "prompt": PROMPTS, "n": 2, "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    with plain.send_raw({**body, "stream": streamed}):
        plain.wait_counts((6, 0), 20, "not every prompt's samples running: ")
    plain.wait_counts((0, 0), 3, "left running for nobody: ")


# --- the replicas' job ---------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_only", [False, True])
def test_a_replica_job_carries_every_prompt_and_rebuilds_the_same_indices(prompt_only) -> None:
    async def build() -> tuple[list, list]:
        queue: asyncio.Queue = asyncio.Queue()
        params = [[SamplingParams(seed=s + i) for i in range(2)] for s in (10, 20, 30)]
        group = new_group([[1, 2], [3], [4, 5, 6]], params, queue, prompt_only)
        job = Job.of(group, "key")
        return group, new_group(job.prompts, job.params, queue, job.prompt_only)

    group, again = asyncio.run(build())
    assert len(group) == len(again) == 6
    for a, b in zip(group, again):
        assert (a.prompt_ids, a.params.seed) == (b.prompt_ids, b.params.seed)
        assert (a.like is None) == (b.like is None)
        assert a.prompt_only == b.prompt_only == prompt_only  # the replica counts no token for echo's scoring
    assert [r.params.seed for r in group] == [10, 11, 20, 21, 30, 31]
    assert [r.like is None for r in group] == [True, False] * 3
    assert group[3].like is group[2]  # a prompt's samples share its own prefill
