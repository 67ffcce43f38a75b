"""The parts of OpenAI's API beyond one plain completion, each exact under speculation: `n` samples
sharing a prefill, the target's logprobs (completions, chat, echo), and per-request speculation
figures in vLLM's shape that add up to /metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from test_logprobs import direct_logprobs
from test_server import CONTEXT, KEY, NAME, Served, _metric

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.engine.engine import Engine

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def plain(target_tok):
    s = Served(LLM(target_tok))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def speculative(target_tok):
    llm = LLM(target_tok, speculative_method="ngram", num_speculative_tokens=3, speculative_k_policy="fixed")
    s = Served(llm, spec_stats="detailed")
    yield s
    s.stop()


def post(served, body: dict, path: str = "/v1/completions") -> dict:
    r = httpx.post(served.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(served, body: dict, path: str = "/v1/completions") -> list[dict]:
    chunks = []
    with httpx.stream("POST", served.url + path, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunks.append(json.loads(line[6:]))
    return chunks


def alone(llm: LLM, prompt: str, **params):
    ids = llm.tokenizer.encode(prompt)
    return Engine(llm.target).generate(ids, SamplingParams(**params))


# --- n -----------------------------------------------------------------------------------------


def test_n_samples_with_a_seed_are_each_the_sample_of_its_own_seed(plain) -> None:
    body = {"model": NAME, "prompt": "abc", "max_tokens": 16, "temperature": 1.0, "seed": 11, "n": 3}
    out = post(plain, body)
    texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert texts == [alone(plain.llm, "abc", max_tokens=16, temperature=1.0, seed=11 + i).text for i in range(3)]
    assert len(set(texts)) > 1  # the seeds differ
    generated = sum(
        len(alone(plain.llm, "abc", max_tokens=16, temperature=1.0, seed=11 + i).token_ids) for i in range(3)
    )
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": generated,
        "total_tokens": 3 + generated,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert post(plain, body)["choices"] == out["choices"]  # and reproduce
    chunks = stream(plain, body)
    streamed = [
        "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
        for i in range(3)
    ]
    assert streamed == texts


def test_n_greedy_chat_samples_are_all_the_greedy_answer(plain) -> None:
    messages = [{"role": "user", "content": "hi"}]
    out = post(
        plain, {"model": NAME, "messages": messages, "max_tokens": 10, "temperature": 0, "n": 2}, "/v1/chat/completions"
    )
    want = (
        Engine(plain.llm.target).generate(plain.llm.tokenizer.apply_chat(messages), SamplingParams(max_tokens=10)).text
    )
    assert [c["message"]["content"] for c in out["choices"]] == [want, want]


def test_n_samples_that_end_at_their_first_token(plain) -> None:
    # The first sample leaves its lane at once: the others prefill on their own instead of sharing.
    out = post(plain, {"model": NAME, "prompt": "hello", "max_tokens": 1, "n": 3, "temperature": 0})
    assert [c["text"] for c in out["choices"]] == [alone(plain.llm, "hello", max_tokens=1).text] * 3
    out = post(plain, {"model": NAME, "prompt": "hello", "max_tokens": 0, "echo": True, "logprobs": 1, "n": 2})
    assert [c["text"] for c in out["choices"]] == ["hello", "hello"]
    assert out["choices"][0]["logprobs"] == out["choices"][1]["logprobs"]


# --- logprobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("server", ["plain", "speculative"])
def test_completion_logprobs_are_the_target_s_own(server, request) -> None:
    served = request.getfixturevalue(server)
    out = post(served, {"model": NAME, "prompt": "abcabcabc", "max_tokens": 12, "temperature": 0, "logprobs": 3})
    choice = out["choices"][0]
    lp = choice["logprobs"]
    ids = served.llm.tokenizer.encode("abcabcabc")
    gen = alone(served.llm, "abcabcabc", max_tokens=12).token_ids
    assert choice["text"] == served.llm.tokenizer.decode(gen)
    assert lp["tokens"] == [served.llm.tokenizer.piece(t) for t in gen]
    direct = direct_logprobs(served.llm.target, ids + gen).tolist()
    for i, token in enumerate(gen):
        row = direct[len(ids) - 1 + i]
        assert lp["token_logprobs"][i] == pytest.approx(row[token], abs=1e-4)
        top = lp["top_logprobs"][i]
        assert len(top) == 3 and max(top.values()) == pytest.approx(lp["token_logprobs"][i], abs=1e-6)  # greedy
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(gen))]


def test_speculative_logprobs_equal_the_plain_run_s(plain, speculative) -> None:
    body = {"model": NAME, "prompt": "abcabcabc", "max_tokens": 20, "temperature": 0, "logprobs": 2}
    a, b = post(plain, body)["choices"][0], post(speculative, body)["choices"][0]
    assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    assert b["logprobs"]["token_logprobs"] == pytest.approx(a["logprobs"]["token_logprobs"], abs=1e-5)
    assert b["speculative_decoding_stats"]["num_accepted_draft_tokens"] > 0  # it did speculate


def test_chat_logprobs_and_streamed_logprobs(plain) -> None:
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "hey"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = post(plain, body, "/v1/chat/completions")["choices"][0]
    content = whole["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == whole["message"]["content"]
    for e in content:
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
        assert e["bytes"] == list(e["token"].encode()) and e["logprob"] <= 0
    chunks = stream(plain, body, "/v1/chat/completions")
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == content
    no_lp = post(plain, {**body, "logprobs": False, "top_logprobs": None}, "/v1/chat/completions")["choices"][0]
    assert no_lp["logprobs"] is None


def test_echo_scores_the_prompt(plain) -> None:
    out = post(plain, {"model": NAME, "prompt": "hello", "max_tokens": 0, "echo": True, "logprobs": 1})
    choice = out["choices"][0]
    assert choice["text"] == "hello" and out["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == list("hello") and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ids = plain.llm.tokenizer.encode("hello")
    direct = direct_logprobs(plain.llm.target, ids).tolist()
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(direct[i - 1][ids[i]], abs=1e-4)
    with_text = post(plain, {"model": NAME, "prompt": "hello", "max_tokens": 4, "echo": True, "temperature": 0})
    assert with_text["choices"][0]["text"] == "hello" + alone(plain.llm, "hello", max_tokens=4).text
    chunks = stream(
        plain, {"model": NAME, "prompt": "hello", "max_tokens": 4, "echo": True, "temperature": 0, "logprobs": 1}
    )
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == with_text["choices"][0]["text"]
    streamed = [
        t
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for t in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert streamed[0] is None and streamed[1:5] == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)


def test_echo_scoring_takes_a_prompt_one_token_short_of_the_context_and_names_the_limit_beyond(plain) -> None:
    body = {"model": NAME, "max_tokens": 0, "echo": True, "logprobs": 1}
    out = post(plain, {**body, "prompt": "a" * (CONTEXT - 1)})
    assert out["usage"] == {
        "prompt_tokens": CONTEXT - 1,
        "completion_tokens": 0,
        "total_tokens": CONTEXT - 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    r = httpx.post(plain.url + "/v1/completions", json={**body, "prompt": "a" * CONTEXT}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    message = r.json()["error"]["message"]
    assert f"echo with max_tokens 0 scores a prompt of at most {CONTEXT - 1} tokens" in message, message
    assert f"this one has {CONTEXT}" in message and "max_tokens (1)" not in message


@pytest.mark.parametrize("count", [0, 1, 3])
def test_the_chosen_token_is_always_among_the_completion_top_logprobs(plain, count) -> None:
    """As OpenAI and vLLM give them: up to logprobs + 1 entries where the chosen token is not among
    the likeliest (here a logit bias forces one the target itself ranks low)."""
    tok = plain.llm.tokenizer
    raw = direct_logprobs(plain.llm.target, tok.encode("abc"))[-1]
    forced = int(raw.argmin())
    body = {"model": NAME, "prompt": "abc", "max_tokens": 1, "temperature": 0, "logprobs": count}
    body["logit_bias"] = {str(forced): 100}
    lp = post(plain, body)["choices"][0]["logprobs"]
    assert lp["tokens"] == [tok.piece(forced)]
    top = lp["top_logprobs"][0]
    likeliest = [tok.piece(int(t)) for t in raw.topk(count).indices] if count else []
    assert list(top) == [*likeliest, tok.piece(forced)]
    assert top[tok.piece(forced)] == lp["token_logprobs"][0] == pytest.approx(float(raw[forced]), abs=1e-4)
    greedy = post(plain, {**body, "logit_bias": {}})["choices"][0]["logprobs"]
    assert len(greedy["top_logprobs"][0]) == max(count, 1)  # the chosen token is the likeliest: no entry added


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_with_include_usage_every_chunk_before_the_usage_chunk_has_a_null_usage(plain, path) -> None:
    body = {"model": NAME, "max_tokens": 6, "temperature": 0}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "abc"}
    chunks = stream(plain, {**body, "stream_options": {"include_usage": True}}, path)
    assert chunks[-1]["usage"]["completion_tokens"] > 0 and chunks[-1]["choices"] == []
    assert len(chunks) > 2 and all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert all("usage" not in c for c in stream(plain, body, path))  # not asked: no usage field


def test_token_metrics_rise_by_the_usage_of_echo_scoring_and_of_n_samples(plain) -> None:
    def totals() -> tuple[float, float]:
        text = httpx.get(plain.url + "/metrics", headers=AUTH).text
        return _metric(text, "forerun:generation_tokens_total"), _metric(text, "forerun:prompt_tokens_total")

    before = totals()
    bodies = (
        {"model": NAME, "prompt": "hello", "max_tokens": 0, "echo": True, "logprobs": 1},
        {"model": NAME, "prompt": "abc", "max_tokens": 4, "n": 3, "temperature": 0},
        {"model": NAME, "prompt": ["ab", "xyz"], "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 5},
    )
    usages = [post(plain, body)["usage"] for body in bodies]
    after = totals()
    assert after[0] - before[0] == sum(u["completion_tokens"] for u in usages) > 0
    assert after[1] - before[1] == sum(u["prompt_tokens"] for u in usages) == 5 + 3 + 5


# --- speculation figures -------------------------------------------------------------------------


def test_per_request_figures_have_vllm_s_shape_and_add_up_to_the_metrics(target_tok) -> None:
    llm = LLM(target_tok, speculative_method="ngram", num_speculative_tokens=3, speculative_k_policy="fixed")
    served = Served(llm, spec_stats="detailed")
    try:
        figures = []
        for prompt in ("abcabcabcabc", "hello hello hello"):
            out = post(served, {"model": NAME, "prompt": prompt, "max_tokens": 30, "temperature": 0})
            figures.append(out["choices"][0]["speculative_decoding_stats"])
            assert out["speculative_decoding_stats"] == figures[-1]  # n = 1: at the root as well
        chunks = stream(
            served,
            {
                "model": NAME,
                "prompt": "xyzxyzxyz",
                "max_tokens": 30,
                "temperature": 0,
                "n": 2,
                "stream_options": {"include_usage": True},
            },
        )
        last = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert len(last) == 2 and all("speculative_decoding_stats" in ch for ch in last)
        figures += [ch["speculative_decoding_stats"] for ch in last]
        for f in figures:
            assert f["num_spec_tokens"] == 3
            assert sum(f["acceptance_histogram"].values()) == f["num_spec_steps"] == len(f["per_step_drafted"])
            assert sum(int(j) * c for j, c in f["acceptance_histogram"].items()) == f["num_accepted_draft_tokens"]
            assert sum(f["per_step_accepted"]) == f["num_accepted_draft_tokens"]
            assert sum(f["accepted_per_position"]) == f["num_accepted_draft_tokens"]
            assert f["accepted_per_position"] == sorted(f["accepted_per_position"], reverse=True)
            assert sum(f["per_step_drafted"]) == f["num_draft_tokens"]
            assert f["mean_acceptance_length"] == pytest.approx(
                1 + f["num_accepted_draft_tokens"] / f["num_spec_steps"]
            )
            assert f["draft_acceptance_rate"] == pytest.approx(f["num_accepted_draft_tokens"] / f["num_draft_tokens"])
        text = httpx.get(served.url + "/metrics", headers=AUTH).text
        assert _metric(text, "forerun:spec_decode_num_drafts_total") == sum(f["num_spec_steps"] for f in figures)
        drafted = sum(f["num_draft_tokens"] for f in figures)
        accepted = sum(f["num_accepted_draft_tokens"] for f in figures)
        assert _metric(text, "forerun:spec_decode_num_draft_tokens_total") == drafted
        assert _metric(text, "forerun:spec_decode_num_accepted_tokens_total") == accepted
        for position in range(3):
            kept = sum(f["accepted_per_position"][position] for f in figures)
            name = "forerun:spec_decode_num_accepted_tokens_per_pos_total"
            assert _metric(text, name, f'position="{position + 1}"') == kept
        assert accepted > 0
        assert _metric(text, "forerun:spec_decode_draft_acceptance_rate") == pytest.approx(accepted / drafted)
        assert 0 < _metric(text, "forerun:spec_decode_efficiency") <= 1
    finally:
        served.stop()


def test_without_the_flag_responses_carry_no_figures(target_tok) -> None:
    served = Served(LLM(target_tok, speculative_method="ngram", num_speculative_tokens=3))
    try:
        out = post(served, {"model": NAME, "prompt": "abcabc", "max_tokens": 3})
        assert "speculative_decoding_stats" not in out and "speculative_decoding_stats" not in out["choices"][0]
    finally:
        served.stop()


# --- logit bias and penalties ----------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["plain", "speculative"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_logit_bias_and_penalties_write_what_the_engine_writes_with_them(request, fixture, temperature) -> None:
    served = request.getfixturevalue(fixture)
    banned = alone(served.llm, "abc", max_tokens=12).token_ids[1]  # the greedy answer's second token
    fields = {
        "presence_penalty": 0.4,
        "frequency_penalty": 0.3,
        "repetition_penalty": 1.2,
        "min_p": 0.05,
        "min_tokens": 3,
    }
    body = {"model": NAME, "prompt": "abc", "max_tokens": 12, "temperature": temperature, "seed": 5}
    out = post(served, {**body, **fields, "logit_bias": {str(banned): -100}})
    text = out["choices"][0]["text"]
    want = alone(served.llm, "abc", max_tokens=12, temperature=temperature, seed=5, logit_bias={banned: -100}, **fields)
    assert text == want.text and banned not in want.token_ids
    assert text != alone(served.llm, "abc", max_tokens=12, temperature=temperature, seed=5).text  # they matter
    streamed = "".join(
        c["choices"][0]["text"] for c in stream(served, {**body, **fields, "logit_bias": {banned: -100}})
    )
    assert streamed == text


# --- the chat template's options -------------------------------------------------------------------


def test_chat_can_leave_the_assistants_turn_closed_or_continue_its_last_message(plain) -> None:
    tok = plain.llm.tokenizer
    body = {"model": NAME, "max_tokens": 8, "temperature": 0}
    turns = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "xy"}]
    for fields, ids in (
        ({}, tok.apply_chat(turns)),
        ({"add_generation_prompt": False}, tok.apply_chat(turns, False)),
        ({"add_generation_prompt": False, "continue_final_message": True}, tok.apply_chat(turns, False, True)),
    ):
        out = post(plain, {**body, **fields, "messages": turns}, "/v1/chat/completions")
        want = Engine(plain.llm.target).generate(ids, SamplingParams(max_tokens=8))
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert out["choices"][0]["message"]["content"] == tok.decode(want.token_ids)
    opened, closed, continued = tok.apply_chat(turns), tok.apply_chat(turns, False), tok.apply_chat(turns, False, True)
    assert len(continued) < len(closed) < len(opened)  # the turn's end left off; the assistant's opening left off
    assert tok.decode(continued).endswith("xy") and closed[: len(continued)] == continued


@pytest.mark.parametrize(
    "fields, last",
    [
        ({"continue_final_message": True}, "assistant"),  # the assistant's turn would be opened too
        ({"add_generation_prompt": False, "continue_final_message": True}, "user"),
        ({"add_generation_prompt": "no"}, "assistant"),
    ],
)
def test_chat_template_options_that_do_not_fit_are_400s(plain, fields, last) -> None:
    turns = [{"role": "user", "content": "abc"}] + ([{"role": "assistant", "content": "x"}] if last != "user" else [])
    body = {"model": NAME, "max_tokens": 4, "messages": turns, **fields}
    r = httpx.post(plain.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in fields


def test_min_tokens_holds_off_the_end_of_text_over_the_server(plain) -> None:
    body = {"model": NAME, "prompt": "abc", "max_tokens": 20, "temperature": 0, "logit_bias": {"2": 7.0}}
    assert post(plain, body)["choices"][0]["finish_reason"] == "stop"  # the raised end-of-text comes at once
    out = post(plain, {**body, "min_tokens": 6})
    want = alone(plain.llm, "abc", max_tokens=20, logit_bias={2: 7.0}, min_tokens=6)
    assert out["usage"]["completion_tokens"] == len(want.token_ids) >= 6
    assert out["choices"][0]["text"] == want.text


@pytest.mark.parametrize("server", ["plain", "speculative"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_stop_string_and_stop_token_that_ended_a_choice_are_its_stop_reason(server, path, request) -> None:
    served = request.getfixturevalue(server)
    chat = path.endswith("chat/completions")
    ask = {"messages": [{"role": "user", "content": "abc"}]} if chat else {"prompt": "abc"}
    body = {"model": NAME, **ask, "max_tokens": 40, "temperature": 0}

    def text(choice: dict) -> str:
        return choice["message"]["content"] if chat else choice["text"]

    free = post(served, body, path)["choices"][0]
    assert free["stop_reason"] is None and len(text(free)) > 8
    stop = text(free)[5:7]  # a piece of what the model writes: it ends the text there
    cut = text(free)[: text(free).index(stop)]
    whole = post(served, {**body, "stop": [stop, "never"]}, path)["choices"][0]
    assert (text(whole), whole["finish_reason"], whole["stop_reason"]) == (cut, "stop", stop)
    chunks = [c["choices"][0] for c in stream(served, {**body, "stop": [stop]}, path) if c["choices"]]
    assert chunks[-1]["stop_reason"] == stop and all(c["stop_reason"] is None for c in chunks[:-1])
    kept = post(served, {**body, "stop": [stop], "include_stop_str_in_output": True}, path)["choices"][0]
    assert text(kept) == cut + stop and kept["stop_reason"] == stop
    streamed = stream(served, {**body, "stop": [stop], "include_stop_str_in_output": True}, path)
    pieces = [c["choices"][0]["delta"].get("content", "") if chat else c["choices"][0]["text"] for c in streamed]
    assert "".join(pieces) == cut + stop
    token = served.llm.tokenizer.encode(text(free))[3]
    by_token = post(served, {**body, "stop_token_ids": [token]}, path)["choices"][0]
    assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", token)
    ended = post(served, {**body, "max_tokens": 2}, path)["choices"][0]
    assert (ended["finish_reason"], ended["stop_reason"]) == ("length", None)


def test_continuous_usage_puts_the_usage_so_far_in_every_chunk(plain) -> None:
    body = {"model": NAME, "prompt": "abc", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream(plain, {**body, "stream_options": options})
    streamed = [c for c in chunks if c["choices"]]
    done = [u["usage"]["completion_tokens"] for u in streamed]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in chunks)
    assert done == sorted(done) and done[-1] == 12 and done[0] < 12
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    # each chunk counts the tokens streamed with it and before it (one character a token here)
    assert [len("".join(c["choices"][0]["text"] for c in streamed[: i + 1])) for i in range(len(streamed))] == done
    plain_chunks = stream(plain, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain_chunks[:-1])
    r = httpx.post(
        plain.url + "/v1/completions",
        json={**body, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        headers=AUTH,
    )
    assert r.status_code == 400 and "add include_usage" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncate_prompt_tokens_keeps_each_prompts_last_tokens(plain, path) -> None:
    chat = path.endswith("chat/completions")
    ask = {"messages": [{"role": "user", "content": "abcdefghij"}]} if chat else {"prompt": "abcdefghij"}
    body = {"model": NAME, **ask, "max_tokens": 6, "temperature": 0}
    tok = plain.llm.tokenizer
    ids = tok.apply_chat(ask["messages"]) if chat else tok.encode(ask["prompt"])
    out = post(plain, {**body, "truncate_prompt_tokens": 5}, path)
    assert out["usage"]["prompt_tokens"] == 5
    text = out["choices"][0]["message"]["content"] if chat else out["choices"][0]["text"]
    assert text == Engine(plain.llm.target).generate(ids[-5:], SamplingParams(max_tokens=6)).text
    assert post(plain, {**body, "truncate_prompt_tokens": -1}, path)["usage"]["prompt_tokens"] == len(ids)
    if not chat:  # echo gives the text that was kept
        echoed = post(plain, {**body, "truncate_prompt_tokens": 4, "echo": True}, path)["choices"][0]["text"]
        assert echoed == "ghij" + Engine(plain.llm.target).generate(ids[-4:], SamplingParams(max_tokens=6)).text
        whole = post(plain, {**body, "truncate_prompt_tokens": 50, "echo": True}, path)["choices"][0]["text"]
        assert whole.startswith("abcdefghij")  # nothing cut: the prompt as sent
    for bad in (0, -2, CONTEXT + 1, "5"):
        r = httpx.post(plain.url + path, json={**body, "truncate_prompt_tokens": bad}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_a_token_prompt_beyond_the_context_runs_truncated(plain) -> None:
    long = plain.llm.tokenizer.encode("ab" * CONTEXT)  # twice the context
    body = {"model": NAME, "prompt": long, "max_tokens": 3, "temperature": 0}
    r = httpx.post(plain.url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and "over this server's context" in r.json()["error"]["message"]
    assert post(plain, {**body, "truncate_prompt_tokens": 100})["usage"]["prompt_tokens"] == 100
    # echo gives what was kept, which its logprobs score
    echoed = post(plain, {**body, "truncate_prompt_tokens": 4, "echo": True, "logprobs": 0})["choices"][0]
    kept = plain.llm.tokenizer.decode(long[-4:])
    assert echoed["text"].startswith(kept) and len(echoed["logprobs"]["tokens"]) == 4 + 3
    assert "".join(echoed["logprobs"]["tokens"]) == echoed["text"]
    r = httpx.post(plain.url + "/v1/completions", json={**body, "truncate_prompt_tokens": -1}, headers=AUTH)
    assert r.status_code == 400 and "the prompt (512 tokens) plus max_tokens (3)" in r.json()["error"]["message"]


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_400s(plain) -> None:
    turns = [{"role": "user", "content": "abc"}]
    body = {"model": NAME, "messages": turns, "max_tokens": 5, "temperature": 0}
    tok = plain.llm.tokenizer
    ids = tok.apply_chat(turns, template_kwargs={"greeting": "be brief"})
    assert tok.decode(ids, False).startswith("<|im_start|>system\nbe brief<|im_end|>")
    out = post(plain, {**body, "chat_template_kwargs": {"greeting": "be brief"}}, "/v1/chat/completions")
    assert out["usage"]["prompt_tokens"] == len(ids) > len(tok.apply_chat(turns))
    want = Engine(plain.llm.target).generate(ids, SamplingParams(max_tokens=5)).text
    assert out["choices"][0]["message"]["content"] == want
    assert (
        plain.llm.chat(turns, SamplingParams(max_tokens=5), chat_template_kwargs={"greeting": "be brief"})[
            0
        ].prompt_token_ids
        == ids
    )
    counted = httpx.post(
        plain.url + "/tokenize",
        json={"messages": turns, "chat_template_kwargs": {"greeting": "be brief"}},
        headers=AUTH,
    )
    assert counted.json()["tokens"] == ids
    for bad, words in (([1], "an object"), ({"tools": []}, "forerun sets itself"), ({"1x": 1}, "an object")):
        r = httpx.post(plain.url + "/v1/chat/completions", json={**body, "chat_template_kwargs": bad}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert words in r.json()["error"]["message"]
    r = httpx.post(
        plain.url + "/v1/completions", json={"model": NAME, "prompt": "a", "chat_template_kwargs": {}}, headers=AUTH
    )
    assert r.status_code == 400 and "belongs to /v1/chat/completions" in r.json()["error"]["message"]
