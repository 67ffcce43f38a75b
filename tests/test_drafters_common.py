"""Checks every drafter without a second model must pass, parametrised over methods and settings.

- Greedy output is token-for-token the plain target's, for every method, setting and K.
- Sampling: the emitted tokens follow the target's exact distribution. Many seeded runs of the
  first speculative step (prefill shared, so it stays fast) are compared with exact marginals of
  the 2nd and 3rd emitted tokens computed from plain forwards; the tolerance comes from the sample
  size. A negative control (an acceptance rule that keeps every draft) must fail the same check.
- A stop inside an accepted run ends the output exactly there.
- The methods are reachable by name from the registry, the Python API and the CLI.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import forerun.engine.engine as engine_module
from forerun import drafters
from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.cli import main
from forerun.drafters.base import Drafter
from forerun.drafters.draft_vocab import choose
from forerun.drafters.vocabulary import full_vocabulary
from forerun.engine.engine import Engine, Running
from forerun.engine.metrics import SpecMetrics
from forerun.engine.sequence import Sequence
from forerun.models.load import LoadedModel
from forerun.models.testing import save_hf_folder, tiny_model
from forerun.verification.accept import Acceptance
from forerun.verification.grammar import Grammar
from forerun.verification.sampling import (
    PositionDraws,
    adjusted,
    draw_tokens,
    make_generator,
    position_uniform,
    probabilities,
    sample,
)
from forerun.verification.tree import DraftTree
from tests.conftest import perturbed

SETTINGS = [
    ("suffix", {}),
    ("suffix", {"min_match": 1, "branch_ratio": 0.3, "min_prob": 0.0}),
    ("ngram", {}),
    ("ngram", {"ngram_max": 2, "ngram_min": 2}),
    ("early-exit", {}),
    ("early-exit", {"layer": 3}),
    ("early-exit", {"skip_layers": [0]}),
    ("early-exit", {"skip_layers": [1, 2]}),
    ("lookahead", {}),
    ("lookahead", {"window": 2, "ngram": 2, "guesses": 1}),
    ("lookahead", {"window": 5, "ngram": 3, "guesses": 6}),
]
ONE_EACH = [("ngram", {}), ("suffix", {}), ("early-exit", {"layer": 3}), ("lookahead", {})]  # on target4
ONE_EACH_SAMPLING = [
    ("ngram", {}),
    ("suffix", {"min_match": 1}),
    ("suffix", {"min_match": 1, "branch_ratio": 0.3, "min_prob": 0.0}),  # two-branch trees
    ("early-exit", {"layer": 1}),
    ("lookahead", {}),
]  # on target2


def setting_id(setting) -> str:
    name, options = setting
    return name + "".join(f"-{k}={v}" for k, v in options.items()).replace(" ", "")


@pytest.fixture(scope="module")
def target4() -> LoadedModel:
    """Four layers (early exit has depths to choose from); this seed writes varied greedy text."""
    return tiny_model(2, name="target4", num_layers=4)


@pytest.fixture(scope="module")
def target2() -> LoadedModel:
    return tiny_model(0, name="target2", num_layers=2)


def self_prompt(target: LoadedModel, seed: int, length: int) -> list[int]:
    """Text the model itself wrote (sampled, top-k 4): its n-grams recur in what the model writes next."""
    out = Engine(target).generate([5, 6, 7], SamplingParams(temperature=1.0, top_k=4, max_tokens=length, seed=seed))
    return [5, 6, 7] + out.token_ids


# --- greedy is exact ------------------------------------------------------------------------------


GREEDY = SamplingParams(max_tokens=32)


@pytest.fixture(scope="module")
def greedy_case(target4: LoadedModel) -> tuple[list[int], list[int]]:
    # A prompt on which every setting both keeps and rejects drafts (skip-layer drafts on a tiny
    # random model rarely agree with it; on some sampled prompts never).
    prompt = self_prompt(target4, 2, 30)
    return prompt, Engine(target4).generate(prompt, GREEDY).token_ids


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("setting", SETTINGS, ids=setting_id)
def test_greedy_output_is_the_plain_targets_token_for_token(target4, greedy_case, setting, k) -> None:
    prompt, plain = greedy_case
    out = Engine(target4, drafters.create(setting[0], target4, setting[1]), k).generate(prompt, GREEDY)
    assert out.token_ids == plain
    # Speculation really happened: drafts were kept (several tokens per pass) and rejected (rollback).
    assert 0 < out.metrics.num_accepted_tokens < out.metrics.num_draft_tokens


# --- sampling follows the target's distribution ----------------------------------------------------


SAMPLING = SamplingParams(temperature=1.0, top_k=4, max_tokens=8)
RUNS, CONTROL_RUNS = 500, 150


def exact_marginals(
    target: LoadedModel, prompt: list[int], params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions [V] of the 2nd and 3rd generated tokens, from plain forwards."""
    decoder = target.decoder

    def next_probs(seq: list[int]) -> torch.Tensor:
        cache = decoder.new_cache(len(seq))
        logits = decoder.forward_ids(seq, cache, last_only=True).logits[0]
        return probabilities(logits, params)[0]

    p1 = next_probs(prompt)
    second, third = torch.zeros_like(p1), torch.zeros_like(p1)
    for t1 in p1.nonzero().flatten().tolist():
        p2 = next_probs(prompt + [t1])
        second += p1[t1] * p2
        for t2 in p2.nonzero().flatten().tolist():
            third += p1[t1] * p2[t2] * next_probs(prompt + [t1, t2])
    return second, third


def speculative_samples(
    target: LoadedModel,
    drafter,
    k: int,
    prompt: list[int],
    runs: int,
    params: SamplingParams = SAMPLING,
    start_grammar: Callable[[], Grammar] | None = None,
) -> tuple[list[list[int]], SpecMetrics]:
    """The 2nd and 3rd emitted tokens of `runs` seeded generations, through the engine's own step.

    The prompt is prefilled once; each run rewinds the cache to it, samples the first token as
    the engine does, then steps until three tokens are out. `start_grammar`: a structured output's
    start, for each run.
    """
    engine = Engine(target, drafter, k)
    decoder = target.decoder
    max_len = engine.check_fits(prompt, params)
    cache = decoder.new_cache(max_len)
    out = decoder.forward_ids(prompt, cache, last_only=True, output_hidden=True, all_hidden=True)
    grammar = start_grammar() if start_grammar is not None else None
    first = probabilities(adjusted(out.logits[0], params, [], [[]], prompt, (), grammar), params)  # [1, V]
    prefilled = cache.length
    metrics = SpecMetrics(num_speculative_tokens=k)
    samples = []
    for seed in range(runs):
        gen = make_generator(seed, decoder.device)
        cache.truncate(prefilled)
        seq = Sequence(prompt, params, None, frozenset(), start_grammar() if start_grammar is not None else None)
        drafter.start(prompt, cache, max_len)
        drafter.follow(seq.grammar)  # as the engine's begin does: a drafter drafts inside the grammar
        if drafter.reads_features:
            drafter.features(out.hidden[0])  # as the engine's prefill gives them
        seq.append(int(sample(first, gen)[0]))
        run = Running(seq, cache, gen, seed, metrics, start=0.0)
        while len(seq.output_ids) < 3:
            engine.step(run)
        samples.append(seq.output_ids[1:3])
    return samples, metrics


def total_variation(tokens: list[int], exact: torch.Tensor) -> tuple[float, float]:
    """(TV distance between the empirical and exact distributions, tolerance for this many samples).

    E|p_hat - p| <= sqrt(p(1-p)/n) per token, so E[TV] <= 0.5 * sum sqrt(p(1-p)/n); the tolerance
    is twice that bound.
    """
    n = len(tokens)
    empirical = torch.bincount(torch.tensor(tokens), minlength=exact.numel()).double() / n
    p = exact.double()
    tolerance = 2 * 0.5 * float((p * (1 - p) / n).sqrt().sum())
    return 0.5 * float((empirical - p).abs().sum()), tolerance


def keep_every_draft(target_probs, tree: DraftTree, generator, greedy: bool) -> Acceptance:
    """The negative control: keeps the first branch whole, then a bonus from the target."""
    path = [tree.children(-1)[0]]
    while tree.children(path[-1]):
        path.append(tree.children(path[-1])[0])
    bonus = int(torch.multinomial(target_probs[path[-1] + 1], 1, generator=generator))
    return Acceptance(path, [tree.tokens[i] for i in path] + [bonus])


def keep_every_draft_at(target_probs, tree: DraftTree, key: int, position: int) -> Acceptance:
    """`keep_every_draft` in the place of `accept_one_hot` (deterministic drafts under sampling)."""
    return keep_every_draft(target_probs, tree, torch.Generator().manual_seed(key + position), False)


def keep_every_draft_always(monkeypatch) -> None:
    """The negative control in the place of both of the engine's sampling rules."""
    monkeypatch.setattr(engine_module, "accept", keep_every_draft)
    monkeypatch.setattr(engine_module, "accept_one_hot", keep_every_draft_at)


@pytest.fixture(scope="module")
def sampling_case(target2: LoadedModel) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    prompt = self_prompt(target2, 1, 120)
    return (prompt, *exact_marginals(target2, prompt, SAMPLING))


def counting_branches(drafter: Drafter) -> Drafter:
    """`drafter`, its proposals with branches (trees rather than chains) counted in `branchy`."""
    propose = drafter.propose
    drafter.branchy = 0

    def counted(*args):
        tree = propose(*args)
        drafter.branchy += tree is not None and not tree.is_chain
        return tree

    drafter.propose = counted  # the protocol's default propose_steps calls it too
    return drafter


@pytest.mark.parametrize("setting", ONE_EACH_SAMPLING, ids=setting_id)
def test_sampled_tokens_follow_the_targets_distribution(target2, sampling_case, setting) -> None:
    prompt, second, third = sampling_case
    drafter = counting_branches(drafters.create(setting[0], target2, setting[1]))
    samples, metrics = speculative_samples(target2, drafter, 2, prompt, RUNS)
    for position, exact in ((0, second), (1, third)):
        tv, tolerance = total_variation([s[position] for s in samples], exact)
        assert tv < tolerance, f"token {position + 2}: TV {tv:.4f} >= {tolerance:.4f}"
    # The check had something to check: drafts were made, some kept and some rejected.
    assert metrics.num_drafts > RUNS // 2
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
    if setting[0] == "lookahead" or "branch_ratio" in setting[1]:
        assert drafter.branchy > 0  # the tree rule, not only the chain rule, was exercised


@pytest.mark.parametrize("setting", ONE_EACH_SAMPLING, ids=setting_id)
def test_negative_control_an_always_accepting_rule_fails_the_same_check(
    target2, sampling_case, setting, monkeypatch
) -> None:
    prompt, second, third = sampling_case
    keep_every_draft_always(monkeypatch)
    samples, _ = speculative_samples(target2, drafters.create(setting[0], target2, setting[1]), 2, prompt, CONTROL_RUNS)
    failures = [total_variation([s[i] for s in samples], exact) for i, exact in ((0, second), (1, third))]
    assert any(tv >= tolerance for tv, tolerance in failures)


# --- stops ----------------------------------------------------------------------------------------


def stop_inside_a_run(steps: list[list[int]]) -> tuple[int, int] | None:
    """(token, index in the output) of a token's first appearance that is not the last token its
    step emitted: a stop there cuts a run of accepted tokens short."""
    out: list[int] = []
    for step in steps:
        for i, token in enumerate(step):
            if token not in out and i < len(step) - 1:
                return token, len(out)
            out.append(token)
    return None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("setting", ONE_EACH, ids=setting_id)
def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(target4, setting, temperature) -> None:
    params = SamplingParams(temperature=temperature, max_tokens=30, seed=3)
    for prompt_seed in range(1, 9):
        prompt = self_prompt(target4, prompt_seed, 30)
        engine = Engine(target4, drafters.create(setting[0], target4, setting[1]), 4)
        steps = [step.token_ids for step in engine.stream(prompt, params)]
        found = stop_inside_a_run(steps)
        if found is not None:
            break
    assert found is not None, "no accepted run to stop inside; pick other prompts"
    full = [t for step in steps for t in step]
    stop, at = found
    # A fresh drafter: the suffix drafter remembers earlier outputs, so a repeat in the same one
    # would draft differently and, sampled, draw different (equally distributed) tokens.
    engine = Engine(target4, drafters.create(setting[0], target4, setting[1]), 4)
    engine.stop_ids = frozenset({stop})
    out = engine.generate(prompt, params)
    assert out.token_ids == full[: at + 1] and out.finish_reason == "stop"
    assert out.metrics.num_emitted_tokens == at + 1
    if temperature == 0:
        plain = Engine(target4)
        plain.stop_ids = frozenset({stop})
        assert plain.generate(prompt, params).token_ids == out.token_ids


def auto_drafter(target: LoadedModel) -> Drafter:
    """`auto` on `target`: suffix drafts on matches of 3 tokens or more, else a draft model that agrees
    with the target often but not always (its drafts have a distribution; the suffix's do not)."""
    return drafters.create("auto", target, {"model": perturbed(target, 0.05), "dtype": "float32", "long_match": 3})


def test_sampled_tokens_of_auto_follow_the_targets_distribution_from_either_source(target2, sampling_case) -> None:
    prompt, second, third = sampling_case
    drafter = auto_drafter(target2)
    samples, metrics = speculative_samples(target2, drafter, 2, prompt, RUNS)
    for position, exact in ((0, second), (1, third)):
        tv, tolerance = total_variation([s[position] for s in samples], exact)
        assert tv < tolerance, f"token {position + 2}: TV {tv:.4f} >= {tolerance:.4f}"
    assert min(drafter.steps.values()) > RUNS // 10, drafter.steps  # both rules ran: suffix's and the draft model's
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens


def test_negative_control_an_always_accepting_rule_fails_auto_too(target2, sampling_case, monkeypatch) -> None:
    prompt, second, third = sampling_case
    keep_every_draft_always(monkeypatch)
    samples, _ = speculative_samples(target2, auto_drafter(target2), 2, prompt, CONTROL_RUNS)
    failures = [total_variation([s[i] for s in samples], exact) for i, exact in ((0, second), (1, third))]
    assert any(tv >= tolerance for tv, tolerance in failures)


@pytest.mark.parametrize("setting", ONE_EACH_SAMPLING, ids=setting_id)
def test_a_seeded_sample_is_plain_decodings_with_that_seed_whatever_a_drafter_drafts(target2, setting) -> None:
    """Deterministic drafts, and early exit's drawn from its distribution with the positions'
    uniforms: the target's own draw at each position is what is emitted."""
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=40, seed=11)
    kept = 0
    for prompt_seed in range(1, 5):
        prompt = self_prompt(target2, prompt_seed, 30)
        plain = Engine(target2).generate(prompt, params)
        spec = Engine(target2, drafters.create(setting[0], target2, setting[1]), 4).generate(prompt, params)
        assert spec.token_ids == plain.token_ids, prompt_seed
        kept += spec.metrics.num_accepted_tokens
    assert kept > 0  # drafts were kept, and the text is plain decoding's all the same


def test_a_draw_over_a_subset_of_ascending_ids_is_the_draw_over_the_whole_vocabulary() -> None:
    """A draft model's reduced vocabulary draws over its columns: the same token as over every id."""
    gen = torch.Generator().manual_seed(0)
    vocab = choose(torch.randint(0, 1000, (400,), generator=gen), 60, [399, 3])  # as a draft model's is chosen
    for trial in range(50):
        q = torch.rand(1, 60, generator=gen) ** 4
        q[0, trial % 60] += 0.5
        q /= q.sum()
        draws = PositionDraws(key=trial, first=trial * 7)
        columns = draw_tokens(q, draws, [2])[0]
        assert int(vocab[columns]) == draw_tokens(full_vocabulary(q, vocab, 400), draws, [2])[0]


def test_position_draws_are_uniform_and_keyed_by_seed_and_position() -> None:
    draws = [position_uniform(7, t) for t in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws) and abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert len(set(draws)) == len(draws)  # no repeats over the positions
    assert position_uniform(7, 3) == position_uniform(7, 3) != position_uniform(8, 3)
    counts = torch.histc(torch.tensor(draws), bins=10, min=0.0, max=1.0)
    assert float(counts.min()) > 0.9 * len(draws) / 10  # every tenth of [0, 1) about as full


# --- reachable by name ----------------------------------------------------------------------------


def test_every_method_is_in_the_registry() -> None:
    assert {"auto", "draft", "suffix", "ngram", "early-exit", "lookahead"} <= set(drafters.available())


@pytest.mark.parametrize("setting", ONE_EACH, ids=setting_id)
def test_llm_api_takes_the_method_by_name_and_reports_spec_metrics(target4, setting) -> None:
    prompt = self_prompt(target4, 1, 30)
    params = SamplingParams(max_tokens=20)
    plain = LLM(model=target4).generate([prompt], params)[0]
    spec = LLM(
        model=target4, speculative_method=setting[0], speculative_options=setting[1], num_speculative_tokens=3
    ).generate([prompt], params)[0]
    assert spec.token_ids == plain.token_ids
    m = spec.metrics.to_dict()
    assert m["num_speculative_tokens"] == 3 and m["num_emitted_tokens"] == 20
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] == sum(m["accepted_per_position"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tiny_model(seed=0, num_layers=3), tmp_path_factory.mktemp("methods") / "tiny")


CLI_BASE = ["--prompt", "abcabcabc", "--max-tokens", "16", "--ignore-eos", "--json"]


@pytest.fixture(scope="module")
def plain_record(folder: Path) -> dict:
    (row,) = [json.loads(line) for line in _cli(["generate", "--model", str(folder), "--dtype", "float32", *CLI_BASE])]
    return row


def _cli(argv: list[str]) -> list[str]:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(argv) == 0
    return buffer.getvalue().splitlines()


@pytest.mark.parametrize(
    "flags",
    [
        ["--speculative-method", "ngram", "--ngram-max", "2"],
        ["--speculative-method", "suffix", "--suffix-min-match", "1", "--suffix-branch-ratio", "0.3"],
        ["--speculative-method", "early-exit", "--early-exit-layer", "2"],
        ["--speculative-method", "early-exit", "--skip-layers", "1"],
        ["--speculative-method", "lookahead", "--lookahead-window", "3", "--lookahead-guesses", "2"],
    ],
    ids=lambda f: " ".join(f[1:]),
)
def test_generate_command_runs_each_method_with_its_flags(folder, plain_record, flags) -> None:
    (line,) = _cli(
        ["generate", "--model", str(folder), "--dtype", "float32", *CLI_BASE, *flags, "--num-speculative-tokens", "3"]
    )
    spec = json.loads(line)
    assert spec["token_ids"] == plain_record["token_ids"]
    assert spec["spec"]["num_emitted_tokens"] == 16 and spec["spec"]["num_speculative_tokens"] == 3
