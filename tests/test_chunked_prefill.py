"""Chunked prefill: a long prompt goes through PREFILL_CHUNK tokens a forward with the running
requests' steps between its chunks, and every request's output is the one it gets alone."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import PREFILL_CHUNK, Engine
from forerun.models.testing import tiny_model
from forerun.models.w8a8 import quantize_decoder_
from forerun.serve.scheduler import Done, Request, Scheduler

LONG = [(7 * i) % 90 + 4 for i in range(PREFILL_CHUNK * 5 + 9)]  # 5 whole chunks and a part


@pytest.fixture(scope="module")
def quantized():
    model = tiny_model(seed=4, max_position=1024)
    quantize_decoder_(model.decoder)  # rows bit-exact alone or batched
    return model


def test_a_prompt_yields_its_chunks_in_turn_and_ends_as_begin_does(quantized) -> None:
    engine = Engine(quantized)
    steps = engine.begin_steps(LONG, SamplingParams(max_tokens=4))
    starts = []
    try:
        chunk = next(steps)
        while True:
            starts.append(chunk.start)
            assert chunk.cache.length == chunk.start and chunk.left == len(LONG) - chunk.start
            done = chunk.alone(quantized.decoder)
            # Only the last chunk is scored: the ones before it need no LM head.
            assert done.logits.shape[-1] == (0 if chunk.left > PREFILL_CHUNK else quantized.decoder.cfg.vocab_size)
            chunk = steps.send(done)
    except StopIteration as stop:
        run, first = stop.value
    assert starts == list(range(0, len(LONG), PREFILL_CHUNK))  # PREFILL_CHUNK rows a forward alone
    assert run.cache.length == len(LONG)
    _, alone = Engine(quantized).begin(LONG, SamplingParams(max_tokens=4))
    assert first.token_ids == alone.token_ids


def test_the_chunks_give_the_prompt_s_cache_of_a_whole_prefill_within_rounding(quantized) -> None:
    # Chunks change only how the rows are grouped: with float32 weights, the same numbers to rounding.
    model = tiny_model(seed=4, max_position=1024)
    decoder = model.decoder
    whole_cache = decoder.new_cache(len(LONG) + 1)
    with torch.inference_mode():
        whole = decoder(torch.tensor(LONG), torch.arange(len(LONG)), whole_cache, last_only=True).logits[0]
    run, _ = Engine(model).begin(LONG, SamplingParams(max_tokens=2))
    torch.testing.assert_close(run.prefill_logits, whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        run.cache.k[..., : len(LONG), :], whole_cache.k[..., : len(LONG), :], rtol=1e-4, atol=1e-4
    )


def test_steps_run_between_a_long_prompt_s_chunks_and_outputs_equal_their_runs_alone(quantized) -> None:
    llm = LLM(quantized, speculative_method="ngram", num_speculative_tokens=3)
    short, long_ = [5, 6, 7, 5, 6, 7], LONG
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = {key: Engine(quantized).generate(prompt, params).token_ids for key, prompt in (("s", short), ("l", long_))}
    batch = BatchEngine(llm.new_engine, 4)
    batch.start("s", short, params)
    got = {"s": list(batch.prefill(float("inf"))["s"].output.token_ids)}
    batch.start("l", long_, params)
    steps_during = 0
    while "l" not in got:
        results = batch.prefill(1e-9)  # one chunk a call
        if "l" in results:
            got["l"] = list(results["l"].output.token_ids)
        for key, result in batch.step().items():
            got[key] += result.output.token_ids
            steps_during += key == "s"
    assert steps_during >= len(long_) // PREFILL_CHUNK  # the short one kept stepping
    while any(not lane.run.seq.finished for lane in batch.lanes.values()):
        for key, result in batch.step().items():
            got[key] += result.output.token_ids
    assert got == want


def test_a_request_removed_while_prefilling_frees_its_lane(quantized) -> None:
    batch = BatchEngine(lambda: Engine(quantized), 2)
    batch.start("a", LONG, SamplingParams(max_tokens=3))
    batch.prefill(1e-9)
    assert batch.size == 1 and "a" in batch.prefilling
    assert batch.remove("a") is None
    assert batch.size == 0 and not batch.prefilling


def test_waiting_prompts_take_their_chunks_in_turn_so_a_short_one_waits_a_chunk_not_a_long_prefill(
    quantized,
) -> None:
    batch = BatchEngine(lambda: Engine(quantized), 3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    short = [5, 6, 7, 8]
    batch.start("long", LONG, params)
    batch.start("other", LONG[:100], params)
    batch.prefill(1e-9)  # the long prompt's first chunk
    batch.start("short", short, params)
    done = [sorted(batch.prefill(1e-9)) for _ in range(3)]
    assert done == [[], [], ["short"]]  # the other's first chunk, the long one's second, the short prompt whole
    assert list(batch.prefilling) == ["other", "long"]  # in turn still
    firsts = {"short": None}
    while batch.prefilling:
        firsts |= {key: r.output.token_ids for key, r in batch.prefill(1e-9).items()}
    for key, prompt in (("long", LONG), ("other", LONG[:100])):
        assert firsts[key] == Engine(quantized).begin(prompt, params)[1].token_ids


def test_followers_share_the_prefill_once_it_is_done(quantized) -> None:
    batch = BatchEngine(lambda: Engine(quantized), 3)
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s) for s in (1, 2, 3)]
    batch.start("a", LONG, params[0])
    batch.start("b", LONG, params[1], like="a")
    batch.start("c", LONG, params[2], like="a")
    assert batch.size == 3 and list(batch.prefilling) == ["a"]
    firsts = batch.prefill(float("inf"))
    assert set(firsts) == {"a", "b", "c"}
    for key, p in zip("abc", params):
        assert firsts[key].output.token_ids == Engine(quantized).begin(LONG, p)[1].token_ids


@pytest.mark.parametrize("share", [1.0, math.inf])
def test_the_server_loop_keeps_decoding_while_a_long_prompt_prefills(quantized, share) -> None:
    """Between the long request's submission and its first token the running request keeps
    stepping; with an unlimited share (`--prefill-share inf`, each prompt whole, as before chunked
    prefill) it gets a step at most."""
    llm = LLM(quantized)
    scheduler = Scheduler(BatchEngine(llm.new_engine, 4, engines=[llm.engine]), prefill_share=share)
    events: list[tuple[str, object]] = []  # appended from the loop thread and this one
    stepping, done = threading.Event(), threading.Event()

    def recorder(name: str):
        def on_event(request, event) -> None:
            events.append((name, event))
            stepping.set()
            if isinstance(event, Done) and name == "long":
                done.set()

        return on_event

    scheduler.start()
    try:
        scheduler.submit(Request([5, 6, 7], SamplingParams(max_tokens=900, ignore_eos=True), recorder("short")))
        assert stepping.wait(10)
        events.append(("submitted", None))
        scheduler.submit(Request(LONG, SamplingParams(max_tokens=2), recorder("long")))
        assert done.wait(60)
    finally:
        scheduler.stop()
    names = [name for name, _ in events]
    between = names[names.index("submitted") : names.index("long")]
    if share == 1.0:
        assert between.count("short") >= len(LONG) // PREFILL_CHUNK, between
    else:
        assert between.count("short") <= 1, between
