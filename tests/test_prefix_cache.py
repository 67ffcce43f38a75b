"""The prefix cache (models/prefix_cache.py): a prompt that starts as an earlier one starts its
prefill after their common blocks, its rows and output bit for bit as without the cache."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import Engine
from forerun.models.load import load_model
from forerun.models.prefix_cache import BLOCK, PrefixCache
from forerun.models.testing import tiny_model
from tests.conftest import perturbed
from tests.test_gguf_format import K_SIZES, k_quant_mix
from tests.test_load import write_gguf
from tests.test_server import KEY, NAME, Served, _metric

AUTH = {"Authorization": f"Bearer {KEY}"}

HEAD = [3 + i % 50 for i in range(27)]  # a shared head: three whole blocks and three tokens
FIRST = HEAD + [60 + i for i in range(20)]
SECOND = HEAD + [90 - i for i in range(13)]
PARAMS = [SamplingParams(max_tokens=12), SamplingParams(temperature=1.0, top_k=8, max_tokens=12, seed=5)]


@pytest.fixture(scope="module")
def k_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("prefix_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_HOME", str(folder / "home"))
        yield write_gguf(tiny_model(seed=7, num_layers=3, **K_SIZES), folder / "k.gguf", quant=k_quant_mix)


@pytest.fixture(scope="module")
def model(k_file: Path):
    return load_model(str(k_file), with_tokenizer=False, quantization="gguf")


def prefilled(engine: Engine, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The prompt's cache rows (keys, values) after its prefill, and how many were restored."""
    run, _ = engine.begin(prompt, SamplingParams(max_tokens=1))
    n = len(prompt)
    return run.cache.k[:, :, :, :n].clone(), run.cache.v[:, :, :, :n].clone(), run.cached_tokens


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_a_prompt_that_starts_as_an_earlier_one_comes_out_as_without_the_cache(model, params) -> None:
    alone = [Engine(model).generate(p, params) for p in (FIRST, SECOND, SECOND)]
    llm = LLM(model)
    cached = [llm.new_engine().generate(p, params) for p in (FIRST, SECOND, SECOND)]
    assert [o.token_ids for o in cached] == [o.token_ids for o in alone]
    # The second starts after the head's three whole blocks; the same prompt again after all its
    # whole blocks short of its last token.
    assert [o.num_cached_tokens for o in cached] == [0, 3 * BLOCK, (len(SECOND) - 1) // BLOCK * BLOCK]
    assert llm.prefix_cache.queries == 2 * len(SECOND) + len(FIRST)


def test_restored_rows_are_the_rows_the_prefill_computes(model) -> None:
    k, v, restored = prefilled(Engine(model), SECOND)
    assert restored == 0
    llm = LLM(model)
    prefilled(llm.new_engine(), FIRST)
    k2, v2, restored = prefilled(llm.new_engine(), SECOND)
    assert restored == 3 * BLOCK
    assert torch.equal(k2, k) and torch.equal(v2, v)
    # The check sees a wrong row: the rows of a prompt whose second block differs are not these.
    other = HEAD[:BLOCK] + [98] + HEAD[BLOCK + 1 :] + SECOND[len(HEAD) :]
    k3, _, _ = prefilled(Engine(model), other)
    assert not torch.equal(k3[:, :, :, : 3 * BLOCK], k[:, :, :, : 3 * BLOCK])
    assert torch.equal(k3[:, :, :, :BLOCK], k[:, :, :, :BLOCK])


def test_a_block_is_found_only_after_the_same_blocks_before_it(model) -> None:
    llm = LLM(model)
    llm.new_engine().generate(FIRST, SamplingParams(max_tokens=1))
    first_block_differs = [98] + FIRST[1:]
    assert llm.new_engine().generate(first_block_differs, SamplingParams(max_tokens=1)).num_cached_tokens == 0
    second_differs = FIRST[: BLOCK + 2] + [98] + FIRST[BLOCK + 3 :]
    assert llm.new_engine().generate(second_differs, SamplingParams(max_tokens=1)).num_cached_tokens == BLOCK


def test_the_blocks_stay_within_their_budget_and_the_least_recent_go_first(model) -> None:
    cache = Engine(model).target.decoder.new_cache(64)
    cache.advance(64)
    torch.manual_seed(0)
    cache.k.normal_()
    block = PrefixCache._block_bytes(cache)
    prefixes = PrefixCache(5 * block)
    a, b = list(range(100, 140)), list(range(200, 240))  # five blocks each
    prefixes.store(a[:24], cache)
    prefixes.store(b[:24], cache)  # six blocks held in all: a's last (its third) goes
    assert len(prefixes) == 5 and prefixes.bytes <= 5 * block
    empty = Engine(model).target.decoder.new_cache(64)
    assert prefixes.restore(a[:25], empty) == 2 * BLOCK
    assert torch.equal(empty.k[:, :, :, : 2 * BLOCK], cache.k[:, :, :, : 2 * BLOCK])
    prefixes.store(a, cache)  # a's five blocks: b's go, its later blocks before its first
    assert len(prefixes) == 5
    assert prefixes.restore(b[:25], Engine(model).target.decoder.new_cache(64)) == 0
    assert prefixes.restore(a, Engine(model).target.decoder.new_cache(64)) == 4 * BLOCK


def test_no_rows_are_restored_where_a_prefill_is_no_chain_of_exact_rows_or_keeps_every_row(k_file) -> None:
    w8a8 = load_model(str(k_file), with_tokenizer=False, quantization="w8a8")
    llm = LLM(w8a8)
    outputs = [llm.new_engine().generate(p, SamplingParams(max_tokens=8)) for p in (FIRST, SECOND)]
    assert [o.num_cached_tokens for o in outputs] == [0, 0]
    assert [o.token_ids for o in outputs] == [
        Engine(w8a8).generate(p, SamplingParams(max_tokens=8)).token_ids for p in (FIRST, SECOND)
    ]
    gguf = LLM(load_model(str(k_file), with_tokenizer=False, quantization="gguf"))
    gguf.new_engine().generate(FIRST, SamplingParams(max_tokens=1))
    scored = gguf.new_engine().generate(SECOND, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert scored.num_cached_tokens == 0 and len(scored.prompt_logprobs) == len(SECOND)


def test_a_batch_prefilling_prompts_that_share_a_head_steps_them_out_as_alone(model) -> None:
    llm = LLM(model)
    batch = BatchEngine(llm.new_engine, 4)
    prompts = [HEAD + [70 + i, 71, 72 + 2 * i] * (i + 1) for i in range(4)]
    params = SamplingParams(max_tokens=10)
    tokens = {key: batch.add(key, p, params).token_ids for key, p in enumerate(prompts[:1])}
    for key, prompt in enumerate(prompts[1:], 1):
        batch.start(key, prompt, params)
    while batch.lanes or batch.prefilling:
        results = batch.step(1.5) if any(not lane.run.seq.finished for lane in batch.lanes.values()) else {}
        results = results or batch.prefill(1.0)
        for key, result in results.items():
            tokens.setdefault(key, []).extend(result.output.token_ids)
        for key in [k for k, lane in batch.lanes.items() if lane.run.seq.finished]:
            batch.remove(key)
    assert [tokens[key] for key in range(4)] == [Engine(model).generate(p, params).token_ids for p in prompts]
    assert llm.prefix_cache.hits == 3 * 3 * BLOCK  # every prompt after the first restored the head


def test_the_server_reports_the_cached_tokens_in_the_usage_and_in_metrics(k_file, tokenizer) -> None:
    model = load_model(str(k_file), with_tokenizer=False, quantization="gguf")
    model.tokenizer = tokenizer
    served = Served(LLM(model))
    try:
        head = "the same system turn, then "
        usage = []
        for prompt in (head + "one question", head + "another", head + "another"):
            body = {"model": NAME, "prompt": prompt, "max_tokens": 4}
            r = httpx.post(served.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"])
        ids = [tokenizer.encode(head + p) for p in ("one question", "another")]
        common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
        expected = [0, common // BLOCK * BLOCK, (len(ids[1]) - 1) // BLOCK * BLOCK]
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == expected and expected[1] > 0
        text = httpx.get(served.url + "/metrics", headers=AUTH, timeout=10).text
        assert _metric(text, "forerun:prefix_cache_hits_total") == sum(expected)
        assert _metric(text, "forerun:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usage)
    finally:
        served.stop()


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory):
    """A gguf draft that agrees with the target often: the target's weights with noise."""
    folder = tmp_path_factory.mktemp("prefix_cache_draft")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_HOME", str(folder / "home"))
        noisy = perturbed(tiny_model(seed=7, num_layers=3, **K_SIZES), 0.2)
        path = write_gguf(noisy, folder / "draft.gguf", quant=k_quant_mix)
    return load_model(str(path), with_tokenizer=False, quantization="gguf")


def with_draft(model, draft, **options) -> LLM:
    # A fixed draft length: no cost policy, so every proposal pays its catch-up (the prompt's rows).
    return LLM(
        model,
        speculative_model=draft,
        speculative_method="draft",
        num_speculative_tokens=3,
        speculative_k_policy="fixed",
        **options,
    )


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_a_draft_model_restores_its_prompt_rows_and_every_output_is_as_without(model, draft, params) -> None:
    uncached = with_draft(model, draft, prefix_cache_mb=0)
    alone = [uncached.new_engine().generate(p, params) for p in (FIRST, SECOND, SECOND)]
    assert uncached.draft_prefix_cache is None and uncached.engine.drafter.prefixes is None
    llm = with_draft(model, draft)
    cached = [llm.new_engine().generate(p, params) for p in (FIRST, SECOND, SECOND)]
    assert [o.token_ids for o in cached] == [o.token_ids for o in alone]
    if params.greedy:
        plain = [Engine(model).generate(p, params).token_ids for p in (FIRST, SECOND, SECOND)]
        assert [o.token_ids for o in alone] == plain
    assert sum(o.metrics.num_draft_tokens for o in cached) > 0
    # The draft's cache, shared by the LLM's drafters, restored the head, then SECOND's whole blocks.
    prefixes = llm.draft_prefix_cache
    assert prefixes is not None and all(llm.new_engine().drafter.prefixes is prefixes for _ in range(2))
    assert prefixes.hits == 3 * BLOCK + (len(SECOND) - 1) // BLOCK * BLOCK


def test_a_draft_models_restored_rows_are_the_rows_its_catch_up_computes(model, draft) -> None:
    def draft_rows(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        engine = llm.new_engine()
        engine.generate(prompt, SamplingParams(max_tokens=4))
        cache = engine.drafter.cache
        n = len(prompt)
        return cache.k[:, :, :, :n].clone(), cache.v[:, :, :, :n].clone()

    k, v = draft_rows(with_draft(model, draft, prefix_cache_mb=0), SECOND)
    llm = with_draft(model, draft)
    draft_rows(llm, FIRST)
    k2, v2 = draft_rows(llm, SECOND)
    assert llm.draft_prefix_cache.hits == 3 * BLOCK
    assert torch.equal(k2, k) and torch.equal(v2, v)
    # The comparison sees a wrong row: a prompt whose second block differs has other rows there.
    other = HEAD[:BLOCK] + [98] + HEAD[BLOCK + 1 :] + SECOND[len(HEAD) :]
    k3, _ = draft_rows(with_draft(model, draft, prefix_cache_mb=0), other)
    assert not torch.equal(k3[:, :, :, : 3 * BLOCK], k[:, :, :, : 3 * BLOCK])
