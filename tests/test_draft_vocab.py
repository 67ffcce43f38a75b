"""A draft model scoring a reduced vocabulary: chosen from the target's own choices, cached, and exact.

Tokens outside the draft's vocabulary get draft probability 0; the target decides every token, so
greedy output equals plain decoding and sampled output follows the target's distribution, even when
the target likes tokens the draft cannot propose.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from forerun import drafters
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters import draft_vocab
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.engine.engine import Engine
from forerun.models.load import LoadedModel
from forerun.models.testing import TINY_VOCAB, tiny_decoder, tiny_model
from forerun.models.w8a8 import quantize_decoder_
from tests.conftest import perturbed
from tests.test_drafters_common import (
    CONTROL_RUNS,
    RUNS,
    SAMPLING,
    exact_marginals,
    keep_every_draft_always,
    self_prompt,
    speculative_samples,
    total_variation,
)


def test_the_choice_keeps_stop_tokens_then_the_most_chosen_then_the_lowest_ids() -> None:
    counts = torch.zeros(20, dtype=torch.long)
    counts[[17, 9, 12]] = torch.tensor([5, 9, 5])
    ids = draft_vocab.choose(counts, 6, always=[19])
    # 19 (a stop), 9 (most chosen), 12 and 17 (tied: lower id first), then ids 0 and 1.
    assert ids.tolist() == [0, 1, 9, 12, 17, 19]


def test_a_vocabulary_as_large_as_the_targets_means_no_reduction(target_tok: LoadedModel) -> None:
    assert draft_vocab.draft_vocabulary(target_tok, target_tok.decoder.cfg.vocab_size) is None


def test_the_vocabulary_comes_from_the_targets_top_choices_on_held_out_prompts(target_tok: LoadedModel) -> None:
    prompts = draft_vocab.calibration_prompts(target_tok)
    assert prompts and all(0 < len(p) <= draft_vocab.MAX_PROMPT_TOKENS for p in prompts)
    counts = draft_vocab.target_choice_counts(target_tok, prompts)
    assert int(counts.sum()) == draft_vocab.TOP * min(sum(map(len, prompts)), draft_vocab.MAX_POSITIONS)
    ids = draft_vocab.draft_vocabulary(target_tok, 40)
    top = torch.argsort(-counts, stable=True)[:30].tolist()
    assert len(ids) == 40 and set(target_tok.tokenizer.stop_ids) <= set(ids.tolist())
    assert len(set(top) & set(ids.tolist())) >= 25


def test_the_choice_is_cached_per_target_and_size(
    target_tok: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path))
    monkeypatch.setattr(draft_vocab, "model_identity", lambda model: "tiny-target")
    first = draft_vocab.draft_vocabulary(target_tok, 50)
    cached = tmp_path / "draft-vocab" / "tiny-target-50.json"
    assert cached.is_file()
    measured = []
    real = draft_vocab.target_choice_counts
    monkeypatch.setattr(draft_vocab, "target_choice_counts", lambda *a: measured.append(1) or real(*a))
    assert torch.equal(draft_vocab.draft_vocabulary(target_tok, 50), first) and not measured
    cached.write_text("{not json")  # a damaged cache is measured again, not a crash
    assert torch.equal(draft_vocab.draft_vocabulary(target_tok, 50), first) and measured == [1]


@pytest.mark.parametrize("quantize", [None, "w8a8"])
def test_the_reduced_head_scores_exactly_the_rows_it_keeps(quantize) -> None:
    model = tiny_model(seed=3)
    if quantize:
        quantize_decoder_(model.decoder)
    ids = torch.tensor([0, 5, 17, 60, 98])
    head = draft_vocab.reduced_head(model.decoder.lm_head, ids)
    x = torch.randn(3, model.decoder.cfg.hidden_size)
    assert torch.equal(head(x), model.decoder.lm_head(x)[:, ids])


# --- exactness ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target2() -> LoadedModel:
    return tiny_model(0, name="target2", num_layers=2)


def restricted_drafter(
    target: LoadedModel, draft: LoadedModel, ids: list[int], monkeypatch: pytest.MonkeyPatch, **options
) -> DraftModelDrafter:
    """A draft model restricted to `ids`, whatever the calibration would choose."""
    monkeypatch.setattr("forerun.drafters.draft_setup.draft_vocabulary", lambda t, n: torch.tensor(ids))
    drafter = DraftModelDrafter(target, draft, draft_vocab=len(ids), **options)
    assert drafter.vocab.tolist() == ids
    return drafter


@pytest.fixture(scope="module")
def case(target2: LoadedModel) -> tuple[list[int], torch.Tensor, torch.Tensor, list[int]]:
    """A prompt, the exact marginals of the 2nd and 3rd tokens, and a vocabulary that keeps only
    some of the tokens the target samples there."""
    prompt = self_prompt(target2, 1, 60)
    second, third = exact_marginals(target2, prompt, SAMPLING)
    likely = ((second + third) > 0).nonzero().flatten().tolist()
    kept = likely[::2]  # half of the target's candidates out
    ids = sorted(set(kept) | set(range(0, 99, 3)) - set(likely[1::2]))
    return prompt, second, third, ids


def test_sampled_tokens_follow_the_target_with_a_reduced_draft_vocabulary(target2, case, monkeypatch) -> None:
    prompt, second, third, ids = case
    drafter = restricted_drafter(target2, perturbed(target2, 0.05), ids, monkeypatch)
    samples, metrics = speculative_samples(target2, drafter, 2, prompt, RUNS)
    for position, exact in ((0, second), (1, third)):
        tv, tolerance = total_variation([s[position] for s in samples], exact)
        assert tv < tolerance, f"token {position + 2}: TV {tv:.4f} >= {tolerance:.4f}"
    emitted = {s[i] for s in samples for i in (0, 1)}
    assert emitted - set(ids), "the target's own tokens outside the draft vocabulary must still appear"
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens


def test_negative_control_an_always_accepting_rule_fails_with_the_reduced_vocabulary(
    target2, case, monkeypatch
) -> None:
    prompt, second, third, ids = case
    keep_every_draft_always(monkeypatch)
    drafter = restricted_drafter(target2, perturbed(target2, 0.05), ids, monkeypatch)
    samples, _ = speculative_samples(target2, drafter, 2, prompt, CONTROL_RUNS)
    failures = [total_variation([s[i] for s in samples], exact) for i, exact in ((0, second), (1, third))]
    assert any(tv >= tolerance for tv, tolerance in failures)


@pytest.mark.parametrize("quantize", [None, "w8a8"])
def test_greedy_output_with_a_reduced_draft_vocabulary_equals_plain(quantize, monkeypatch) -> None:
    target = tiny_model(seed=2, name="target", num_layers=4)
    if quantize:
        quantize_decoder_(target.decoder)
    prompt = self_prompt(target, 1, 30)
    params = SamplingParams(max_tokens=32)
    plain = Engine(target).generate(prompt, params).token_ids
    ids = sorted(set(range(0, 99, 2)) | set(plain[:10]))
    draft = perturbed(tiny_model(seed=2, name="draft", num_layers=4), 0.1)
    drafter = restricted_drafter(target, draft, ids, monkeypatch, quantize=quantize)
    out = Engine(target, drafter, 3).generate(prompt, params)
    assert out.token_ids == plain
    assert 0 < out.metrics.num_accepted_tokens < out.metrics.num_draft_tokens
    assert set(plain) - set(ids), "some of the target's tokens lie outside the draft vocabulary"


# --- heads of different sizes (a family pads its vocabulary differently by size) --------------------


def padded(model: LoadedModel, rows: int, name: str) -> LoadedModel:
    """`model` with its embedding and head grown to `rows` rows: the first as they were, the rest
    padding rows no tokenizer token names, as a larger sibling's head has (random embeddings, zero
    head rows: a logit of 0, below the likeliest real token's)."""
    decoder = tiny_decoder(dataclasses.replace(model.decoder.cfg, vocab_size=rows), seed=7)
    state = decoder.state_dict()
    state["lm_head.weight"].zero_()
    for key, value in model.decoder.state_dict().items():
        state[key][: value.shape[0]] = value
    decoder.load_state_dict(state)
    return LoadedModel(name, decoder, model.tokenizer, model.source)


@pytest.mark.filterwarnings("ignore:draft draft is larger than target")  # its padding rows make it so here
@pytest.mark.parametrize("larger", ["target", "draft"])
@pytest.mark.parametrize("method", ["draft", "auto"])
def test_a_draft_whose_head_has_other_rows_drafts_and_greedy_output_is_plain(tokenizer, larger, method) -> None:
    target = tiny_model(seed=2, tokenizer=tokenizer, name="target", num_layers=4)
    draft = perturbed(tiny_model(seed=2, tokenizer=tokenizer, name="draft", num_layers=4), 0.1)
    if larger == "target":
        target = padded(target, TINY_VOCAB + 13, "target")
    else:
        draft = padded(draft, TINY_VOCAB + 13, "draft")
    prompt = self_prompt(target, 1, 30)
    params = SamplingParams(max_tokens=32)
    plain = Engine(target).generate(prompt, params).token_ids
    drafter = drafters.create(
        method, target, {"model": draft, "long_match": 3} if method == "auto" else {"model": draft}
    )
    out = Engine(target, drafter, 3).generate(prompt, params)
    assert out.token_ids == plain
    assert out.metrics.num_accepted_tokens > 0
    # Sampled drafts over the shared rows are spread over the target's (full_vocabulary): a run
    # goes through (the distribution tests check that path with a reduced vocabulary).
    sampled = SamplingParams(max_tokens=32, temperature=1.0, seed=3, ignore_eos=True)
    assert len(Engine(target, drafter, 3).generate(prompt, sampled).token_ids) == 32


def test_a_token_only_the_targets_larger_head_has_leaves_the_draft_model_out_not_failing(tokenizer) -> None:
    target = padded(tiny_model(seed=2, tokenizer=tokenizer, name="target", num_layers=4), TINY_VOCAB + 13, "target")
    draft = perturbed(tiny_model(seed=2, tokenizer=tokenizer, name="draft", num_layers=4), 0.1)
    prompt = self_prompt(target, 1, 30) + [TINY_VOCAB + 5]  # a padding row's id, as a client may send
    params = SamplingParams(max_tokens=16)
    out = Engine(target, DraftModelDrafter(target, draft), 3).generate(prompt, params)
    assert out.token_ids == Engine(target).generate(prompt, params).token_ids
    assert out.metrics.num_drafts == 0  # the draft model cannot read that token


def test_heads_of_other_sizes_without_tokenizers_to_compare_are_refused() -> None:
    target = padded(tiny_model(seed=2, name="target"), TINY_VOCAB + 13, "target")
    with pytest.raises(ForerunError, match="without both tokenizers forerun cannot tell whether their tokens agree"):
        DraftModelDrafter(target, tiny_model(seed=3, name="draft"))
