"""Logit bias, presence / frequency / repetition penalties and min-p: what they do to a row, and that
speculation stays exact under them (greedy token for token, sampled in distribution, batched as alone).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from forerun import drafters
from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.cli import main
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import Engine
from forerun.engine.sequence import Sequence
from forerun.models.load import LoadedModel
from forerun.models.testing import save_hf_folder, tiny_model
from forerun.verification.grammar import Grammar
from forerun.verification.sampling import adjusted, probabilities
from forerun.verification.tree import DraftTree
from forerun.verification.verify import Past, verify
from tests.test_batch import run_batched
from tests.test_drafters_common import (
    CONTROL_RUNS,
    ONE_EACH_SAMPLING,
    RUNS,
    SETTINGS,
    _cli,
    keep_every_draft_always,
    self_prompt,
    setting_id,
    speculative_samples,
    total_variation,
)

PENALIZED = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.6)
MILD = dict(presence_penalty=0.2, frequency_penalty=0.1, repetition_penalty=1.1)  # copying drafts still kept


def test_a_row_is_biased_then_penalized_for_its_own_history() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0], [2.0, -1.0, 0.5, 3.0, 0.0]])
    params = SamplingParams(
        logit_bias={4: 1.5, 0: -0.5}, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0
    )
    out = adjusted(logits, params, [], [[3, 3], [1]], prompt=[2])
    # Row 0 (token 3 written twice; token 2 in the prompt): bias first, then repetition (2.0 > 0 halved,
    # 0.5 > 0 halved), then 3 less 0.5 (presence) and 2 x 0.25 (frequency).
    assert out[0].tolist() == pytest.approx([1.5, -1.0, 0.25, 1.5 - 0.5 - 0.5, 1.5])
    # Row 1 (token 1 written once): -1 is multiplied by 2, less 0.5 and 0.25.
    assert out[1].tolist() == pytest.approx([1.5, -2.0 - 0.75, 0.25, 3.0, 1.5])
    assert logits[0, 0] == 2.0  # the pass's logits are left as they were
    plain = SamplingParams()
    assert not plain.adjusts and torch.equal(adjusted(logits, plain, [], [[3], [1]]), logits)


def test_min_p_drops_tokens_below_its_share_of_the_likeliest() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.14, 0.06]]))
    kept = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.25)) > 0  # 0.125 and above
    assert kept.tolist() == [[True, True, True, False]]
    assert (probabilities(logits, SamplingParams(temperature=1.0, min_p=1.0)) > 0).sum() == 1


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"logit_bias": {5: 101}}, "logit_bias values must be numbers in"),
        ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
        ({"min_p": 1.5}, "min_p must be a number in"),
        # Integers too big for a float: named like any other number out of range, not an OverflowError.
        ({"logit_bias": {5: 10**400}}, "logit_bias values must be numbers in"),
        ({"min_p": 10**400}, "min_p must be a number in"),
        ({"temperature": 10**400}, "temperature must be a finite number"),
    ],
)
def test_bad_adjustments_are_named(fields, message) -> None:
    with pytest.raises(ForerunError, match=message):
        SamplingParams(**fields)


def test_a_bias_outside_the_vocabulary_is_refused_before_any_work() -> None:
    target = tiny_model(0)
    vocab = target.decoder.cfg.vocab_size
    with pytest.raises(ForerunError, match=f"logit_bias names token {vocab}, beyond the vocabulary"):
        Engine(target).generate([5, 6, 7], SamplingParams(logit_bias={vocab: 5.0}))


def test_a_verification_row_is_adjusted_as_plain_decoding_adjusts_that_position() -> None:
    decoder = tiny_model(0).decoder
    params = SamplingParams(temperature=1.0, logit_bias={9: 2.0}, **PENALIZED)
    prompt, output, tree = [5, 6, 7], [4, 4, 9], DraftTree([8, 4, 3], [-1, 0, -1])
    cache = decoder.new_cache(16)
    decoder(torch.tensor(prompt + output[:-1]), torch.arange(5), cache)
    ver = verify(decoder, cache, output[-1], tree, params, Past(prompt, output))
    for row, path in enumerate([[], [8], [8, 4], [3]]):
        seq = prompt + output + path
        alone = decoder.forward_ids(seq, decoder.new_cache(len(seq)), last_only=True).logits[0]
        want = probabilities(adjusted(alone, params, output + path, [[]], prompt), params)[0]
        torch.testing.assert_close(ver.probs[row], want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def target4() -> LoadedModel:
    return tiny_model(2, name="target4", num_layers=4)


@pytest.mark.parametrize("setting", SETTINGS, ids=setting_id)
def test_greedy_output_under_a_bias_and_penalties_is_plain_decodings(target4, setting) -> None:
    prompt = self_prompt(target4, 2, 30)
    params = SamplingParams(max_tokens=32, logit_bias={prompt[-1]: -3.0}, **MILD)  # PENALIZED stops copying
    plain = Engine(target4).generate(prompt, params).token_ids
    assert plain != Engine(target4).generate(prompt, SamplingParams(max_tokens=32)).token_ids  # they matter
    out = Engine(target4, drafters.create(setting[0], target4, setting[1]), 3).generate(prompt, params)
    assert out.token_ids == plain
    assert out.metrics.num_accepted_tokens > 0  # drafts were kept under the adjusted rows


# The strongest penalties OpenAI allows: a row that misses a draft token of its path is far off, so
# the negative control below fails plainly; the sampled drafts are still kept at times.
STRONG = dict(presence_penalty=2.0, frequency_penalty=2.0)
ADJUSTED = SamplingParams(temperature=1.0, top_k=4, max_tokens=8, min_p=0.05, logit_bias={3: 1.0}, **STRONG)


def exact_adjusted_marginals(
    target: LoadedModel, prompt: list[int], params: SamplingParams, start_grammar: Callable[[], Grammar] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions [V] of the 2nd and 3rd generated tokens, each position adjusted for the
    tokens generated before it (plain forwards, one sequence at a time); `start_grammar`: a
    structured output's start, taken along the tokens before each position."""
    decoder = target.decoder

    def next_probs(output: list[int]) -> torch.Tensor:
        grammar = start_grammar() if start_grammar is not None else None
        for token in output if grammar is not None else ():
            grammar.advance(token)
        seq = prompt + output
        logits = decoder.forward_ids(seq, decoder.new_cache(len(seq)), last_only=True).logits[0]
        return probabilities(adjusted(logits, params, output, [[]], prompt, (), grammar), params)[0]

    p1 = next_probs([])
    second, third = torch.zeros_like(p1), torch.zeros_like(p1)
    for t1 in p1.nonzero().flatten().tolist():
        p2 = next_probs([t1])
        second += p1[t1] * p2
        for t2 in p2.nonzero().flatten().tolist():
            third += p1[t1] * p2[t2] * next_probs([t1, t2])
    return second, third


@pytest.fixture(scope="module")
def adjusted_case() -> tuple[LoadedModel, list[int], torch.Tensor, torch.Tensor]:
    target = tiny_model(0, name="target2", num_layers=2)
    prompt = self_prompt(target, 1, 120)
    return (target, prompt, *exact_adjusted_marginals(target, prompt, ADJUSTED))


@pytest.mark.parametrize("setting", ONE_EACH_SAMPLING, ids=setting_id)
def test_sampled_tokens_follow_the_adjusted_distribution(adjusted_case, setting) -> None:
    target, prompt, second, third = adjusted_case
    drafter = drafters.create(setting[0], target, setting[1])
    samples, metrics = speculative_samples(target, drafter, 2, prompt, RUNS, ADJUSTED)
    for position, exact in ((0, second), (1, third)):
        tv, tolerance = total_variation([s[position] for s in samples], exact)
        assert tv < tolerance, f"token {position + 2}: TV {tv:.4f} >= {tolerance:.4f}"
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens


def test_negative_control_unadjusted_targets_rows_fail_the_same_check(adjusted_case, monkeypatch) -> None:
    # Verification that forgets the request's past (each row adjusted as the root): the check fails.
    target, prompt, second, third = adjusted_case
    monkeypatch.setattr(Past, "paths", staticmethod(lambda tree: [[]] * (len(tree) + 1)))
    samples, _ = speculative_samples(target, drafters.create("ngram", target, {}), 2, prompt, CONTROL_RUNS, ADJUSTED)
    failures = [total_variation([s[i] for s in samples], exact) for i, exact in ((0, second), (1, third))]
    assert any(tv >= tolerance for tv, tolerance in failures)


def test_negative_control_an_always_accepting_rule_fails_under_adjustments(adjusted_case, monkeypatch) -> None:
    target, prompt, second, third = adjusted_case
    keep_every_draft_always(monkeypatch)
    samples, _ = speculative_samples(target, drafters.create("ngram", target, {}), 2, prompt, CONTROL_RUNS, ADJUSTED)
    failures = [total_variation([s[i] for s in samples], exact) for i, exact in ((0, second), (1, third))]
    assert any(tv >= tolerance for tv, tolerance in failures)


def test_batched_requests_with_their_own_adjustments_equal_each_run_alone(target4) -> None:
    prompt = self_prompt(target4, 2, 30)
    requests = [
        (prompt, SamplingParams(max_tokens=20, **PENALIZED)),
        (prompt, SamplingParams(max_tokens=20)),
        (prompt[:20], SamplingParams(max_tokens=20, logit_bias={prompt[5]: 4.0})),
        (prompt, SamplingParams(temperature=0.8, max_tokens=20, seed=4, min_p=0.1, **PENALIZED)),
    ]
    alone = [Engine(target4).generate(p, params).token_ids for p, params in requests]
    assert len({tuple(tokens) for tokens in alone[:3]}) == 3  # the adjustments change what is written

    def new_engine() -> Engine:
        return Engine(target4, drafters.create("ngram", target4, {}), 3)

    assert run_batched(BatchEngine(new_engine, 4), requests) == alone


# --- the command line ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tiny_model(seed=0, num_layers=3), tmp_path_factory.mktemp("adjust") / "tiny")


def test_generate_takes_the_adjustments_and_writes_what_the_api_writes(folder) -> None:
    flags = ["--presence-penalty", "0.5", "--frequency-penalty", "0.2", "--repetition-penalty", "1.2"]
    flags += ["--min-p", "0.05", "--min-tokens", "4", "--logit-bias", "7=-100", "9=2.5"]
    argv = ["generate", "--model", str(folder), "--dtype", "float32", "--prompt", "abcabcabc", "--max-tokens", "16"]
    # the API's weights: float32 as stored (the CLI's default `auto` picks w8a8 on a CPU)
    argv += ["--quantization", "none"]
    (line,) = _cli([*argv, "--ignore-eos", "--json", *flags, "--speculative-method", "ngram"])
    params = SamplingParams(
        max_tokens=16,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        repetition_penalty=1.2,
        min_p=0.05,
        min_tokens=4,
        logit_bias={7: -100.0, 9: 2.5},
    )
    want = LLM(str(folder), dtype="float32").generate("abcabcabc", params)[0]
    assert json.loads(line)["token_ids"] == want.token_ids and 7 not in want.token_ids


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--logit-bias", "x=1"], "is not ID=BIAS"),
        (["--presence-penalty", "3"], "presence_penalty must be a number in"),
        (["--logit-bias", "5=200"], "logit_bias values must be numbers in"),
    ],
)
def test_generate_names_a_bad_adjustment(folder, argv, message, capsys) -> None:
    try:
        code = main(["generate", "--model", str(folder), "--dtype", "float32", "--prompt", "abc", *argv])
    except SystemExit as exc:  # argparse's refusal of a flag's value
        code = exc.code
    assert code != 0 and message in capsys.readouterr().err


def test_bench_refuses_adjustments_its_peers_would_not_be_sent(folder, capsys) -> None:
    argv = ["bench", "--model", str(folder), "--peers", "llama-plain", "--presence-penalty", "0.5"]
    assert main(argv) != 0
    assert "the peers are sent temperature, top-k and top-p only" in capsys.readouterr().err


# --- min_tokens ------------------------------------------------------------------------------------


def test_rows_before_min_tokens_cannot_give_a_stop_token() -> None:
    logits = torch.zeros(3, 6)
    out = adjusted(logits, SamplingParams(min_tokens=2), [4], [[], [5], [5, 1]], stop_ids={0, 3})
    assert torch.isinf(out[0, [0, 3]]).all() and torch.isfinite(out[0, [1, 2, 4, 5]]).all()
    assert torch.isfinite(out[1:]).all()  # rows predicting the third token and later: stops allowed


@pytest.mark.parametrize("setting", [("ngram", {}), ("suffix", {}), ("lookahead", {}), ("early-exit", {"layer": 1})])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_min_tokens_holds_off_a_stop_token_and_speculation_writes_what_plain_does(
    target_tok, setting, temperature
) -> None:
    prompt = target_tok.tokenizer.encode("abc")
    eager = {2: 7.0}  # the end-of-text token's logit raised: plain decoding stops at once
    stop = Engine(target_tok).generate(prompt, SamplingParams(max_tokens=40, logit_bias=eager))
    assert stop.finish_reason == "stop" and len(stop.token_ids) <= 2
    params = SamplingParams(max_tokens=40, logit_bias=eager, min_tokens=6, temperature=temperature, seed=2)
    plain = Engine(target_tok).generate(prompt, params)
    assert len(plain.token_ids) > 6 and not set(plain.token_ids[:6]) & target_tok.tokenizer.stop_ids
    out = Engine(target_tok, drafters.create(setting[0], target_tok, setting[1]), 3).generate(prompt, params)
    if temperature == 0 or setting[0] != "early-exit":  # deterministic drafts: plain decoding's draws
        assert out.token_ids == plain.token_ids
    assert not set(out.token_ids[:6]) & target_tok.tokenizer.stop_ids
    assert out.metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("stop", [("ab",), ("ab", "zzzzzz")], ids=["one", "with-a-longer-one"])
def test_a_stop_string_ending_before_min_tokens_does_not_end_the_output(tokenizer, stop) -> None:
    ids = tokenizer.encode("abxabyy")
    seq = Sequence([1], SamplingParams(max_tokens=20, stop=stop, min_tokens=4), tokenizer, frozenset())
    appended = 0
    while not seq.append(ids[appended]):
        appended += 1
    # "ab" ends at the 2nd token, then at the 5th: only the second, past min_tokens, ends it.
    assert appended + 1 == 5 and seq.text == "abx" and seq.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [None, "5", 0])
def test_a_bad_max_tokens_is_named_before_min_tokens_is_compared_with_it(max_tokens) -> None:
    with pytest.raises(ForerunError, match="max_tokens must be a whole number >= 1"):
        SamplingParams(max_tokens=max_tokens, min_tokens=2)
