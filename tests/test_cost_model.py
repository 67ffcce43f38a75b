"""The cost model: draft lengths chosen from synthetic cost curves, acceptance tracking, probes and
shadow proposals, the engine under an adaptive policy (output unchanged), and cached pass costs."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest
import torch

from forerun import drafters
from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters.base import Drafter
from forerun.engine import engine as engine_module
from forerun.engine.engine import Engine
from forerun.models.load import LoadedModel, load_model
from forerun.models.testing import save_hf_folder, tiny_model
from forerun.policy import pass_costs as pass_costs_module
from forerun.policy.draft_length import (
    LENGTHS_KEPT,
    DraftLengthPolicy,
    batch_draft_length,
    best_k,
    draft_rows,
    expected_tokens,
)
from forerun.policy.pass_costs import PassCosts, cached_pass_costs, measure_pass_costs
from forerun.verification.tree import DraftTree
from tests.conftest import perturbed

FLAT = PassCosts([0.100] * 4 + [0.110] * 4 + [0.200] * 8)  # w8a8-like: flat to four rows, then steps
LINEAR = PassCosts([0.050 * r for r in range(1, 17)])  # every row costs a full pass (bf16 on AVX2)
SLOPED = PassCosts([0.100 * (1 + 0.05 * r) for r in range(16)])  # each extra row adds 5 % of a pass


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_failing_drafts_choose_a_plain_step() -> None:
    assert best_k(0.0, FLAT, draft_cost=0.0, k_max=8) == 0
    for alpha in (0.05, 0.2, 0.4):
        assert best_k(alpha, FLAT, draft_cost=0.05, k_max=8) == 0  # a draft token at half a pass


def test_free_drafts_on_flat_rows_pay_even_at_low_acceptance() -> None:
    assert best_k(0.2, FLAT, draft_cost=0.0, k_max=8) >= 1


def test_high_acceptance_and_flat_rows_choose_a_long_draft() -> None:
    assert best_k(0.95, FLAT, draft_cost=0.0, k_max=3) == 3
    assert best_k(0.95, FLAT, draft_cost=0.001, k_max=16) >= 7  # the step at eight rows is worth it at 0.95
    assert best_k(0.4, FLAT, draft_cost=0.0, k_max=16) == 3  # three drafts ride on the flat part for free


def test_rows_that_cost_a_pass_each_never_pay() -> None:
    """With c(r) = r·c(1) a step of K drafts costs K+1 passes for fewer than K+1 tokens."""
    for alpha in (0.3, 0.8, 0.99):
        assert best_k(alpha, LINEAR, draft_cost=0.0, k_max=8) == 0


def test_an_expensive_draft_shortens_the_draft() -> None:
    cheap = best_k(0.8, FLAT, draft_cost=0.002, k_max=8)
    dear = best_k(0.8, FLAT, draft_cost=0.05, k_max=8)
    assert dear < cheap


def test_tree_rows_count_against_the_draft() -> None:
    """Proposals that add two rows per token asked reach the costly rows sooner."""
    assert best_k(0.7, FLAT, 0.0, 8, rows_per_token=2.0) < best_k(0.7, FLAT, 0.0, 8, rows_per_token=1.0)


def test_pass_costs_extend_linearly_past_the_measured_rows() -> None:
    costs = PassCosts([1.0, 2.0, 3.0])
    assert costs(2) == 2.0 and costs(5) == 5.0


def test_wider_passes_measured_past_the_rows_are_interpolated_and_their_slope_extended() -> None:
    costs = PassCosts([1.0, 2.0, 3.0], {5: 4.0, 9: 12.0})  # flatter to 5 rows, then steeper
    assert costs(4) == 3.5 and costs(5) == 4.0 and costs(7) == 8.0
    assert costs(11) == 16.0  # past 9: the slope from 5 to 9 (2 a row)


def test_a_slow_moment_in_the_measurement_comes_down_to_the_wider_passes() -> None:
    # Noise only adds time: a timing above a wider pass's comes down to it, and one slow moment
    # does not spread over every wider pass after it.
    assert PassCosts([0.10, 0.09, 0.12, 0.11]).seconds == [0.09, 0.09, 0.11, 0.11]
    costs = PassCosts([0.08, 0.09, 0.17, 0.10], {8: 0.15, 6: 0.17, 2: 0.5, 12: 0.14})
    assert costs.seconds == [0.08, 0.09, 0.10, 0.10] and costs.wide == {6: 0.14, 8: 0.14, 12: 0.14}


def test_drafts_that_promise_too_little_are_not_worth_the_step() -> None:
    """Flat rows, free drafts, but almost nothing kept: the margin keeps the step plain."""
    assert best_k(0.01, FLAT, draft_cost=0.0, k_max=8) == 0


def test_the_policy_stops_drafting_when_drafts_fail_and_probes_ever_less_often() -> None:
    policy = DraftLengthPolicy(FLAT, k_max=5)
    policy.start()
    policy.record_proposal(0.02, 5, 5)  # a draft model: a fifth of a pass per token
    kinds = []
    for _ in range(300):
        k, probe = policy.choose()
        if k == 0:
            policy.record_plain()
            kinds.append("plain")
        else:
            policy.record_drafted(k, 0, probe)  # every draft rejected at once
            kinds.append("probe" if probe else "draft")
    assert kinds[:2] == ["draft", "draft"]  # starts optimistic (α prior 0.5)
    probes = [i for i, kind in enumerate(kinds) if kind == "probe"]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 65  # waits double up to 64 plain steps
    assert kinds[-150:].count("plain") >= 147  # on failing text: a probe in ~65 steps at most


def test_probes_of_a_dear_drafter_are_spaced_to_cost_at_most_two_percent() -> None:
    policy = DraftLengthPolicy(FLAT, k_max=5)
    policy.start()
    policy.record_proposal(0.05, 1, 1)  # half a pass per draft token (early exit)
    policy.record_drafted(1, 1, probe=True)  # a probe that was kept
    # The probe cost half a pass beyond a plain step; 25 plain steps make that 2 % of them.
    assert policy.probe_wait == 25
    cheap = DraftLengthPolicy(FLAT, k_max=5)
    cheap.start()
    cheap.record_proposal(0.0001, 1, 1)
    cheap.record_drafted(1, 1, probe=True)
    assert cheap.probe_wait == 4  # a nearly free probe may come again soon


def test_a_free_stateless_drafter_is_measured_in_the_shadow_without_probes() -> None:
    policy = DraftLengthPolicy(FLAT, k_max=5)
    policy.start()
    policy.record_proposal(1e-6, 1, 1)
    for _ in range(30):
        policy.record_shadow(0.0)
    assert policy.choose(can_shadow=True) == (0, False)
    for _ in range(30):
        policy.record_plain()
    assert policy.choose(can_shadow=True) == (0, False)  # no probe: shadows keep measuring
    for _ in range(40):
        policy.record_shadow(1.0)  # the text turned repetitive
    k, probe = policy.choose(can_shadow=True)
    assert k >= 3 and not probe


def test_a_request_starts_from_the_acceptance_of_earlier_requests() -> None:
    policy = DraftLengthPolicy(FLAT, k_max=5)
    policy.start()
    for _ in range(20):
        policy.record_drafted(5, 5, False)
    policy.start()
    assert policy.figures().alpha > 0.9


def test_a_request_unlike_earlier_ones_moves_off_their_acceptance_within_a_few_steps() -> None:
    policy = DraftLengthPolicy(FLAT, k_max=5)
    policy.start()
    for _ in range(50):
        policy.record_drafted(5, 5, False)  # earlier requests: every draft kept
    policy.start()
    for _ in range(4):
        policy.record_drafted(5, 0, False)  # this one: the first token always rejected
    assert policy.figures().alpha < 0.5  # with all earlier requests' weight it would be ~0.85


def test_each_source_of_drafts_has_its_own_acceptance() -> None:
    policy = DraftLengthPolicy(FLAT, k_max=4)
    policy.start()
    for _ in range(10):
        policy.record_drafted(4, 0, False, source="suffix")
    for _ in range(10):
        policy.record_drafted(4, 4, False, source="draft")
    assert policy.figures("draft").alpha > 0.9
    assert policy.figures("suffix").alpha < 0.2
    policy.start()  # a new request starts from each one's history
    assert policy.figures("suffix").alpha < 0.2
    assert policy.figures("draft").alpha > 0.9


def test_fixed_always_drafts_k() -> None:
    policy = DraftLengthPolicy(LINEAR, k_max=4, fixed=True)
    policy.start()
    policy.record_drafted(4, 0, False)
    assert policy.choose() == (4, False)


def test_a_catch_up_is_paid_once_what_drafting_would_have_saved_reaches_its_cost() -> None:
    policy = DraftLengthPolicy(FLAT, k_max=4)
    policy.start()
    for _ in range(20):
        policy.record_drafted(4, 4, False)  # drafts that are always kept
    saving = policy.saving(draft_cost=0.01)
    assert 0 < saving < FLAT(1)
    cost = 5.5 * saving  # the catch-up costs five and a half steps' saving
    answers = [policy.pays_catch_up(cost, 0.01) for _ in range(8)]
    assert policy.saving(0.01, alpha=0.1) < saving  # drafts kept less often save less
    assert answers == [False] * 6 + [True, False]  # paid on the 7th step; the count starts again
    assert policy.pays_catch_up(0.0)  # nothing to catch up: always
    policy.start()
    assert policy.catch_up.forgone == 0.0  # a new request starts from nothing


def test_a_catch_up_in_a_batch_costs_every_lane_that_waits_on_it() -> None:
    def first_paid(waiting: int) -> int:
        policy = DraftLengthPolicy(FLAT, k_max=4)
        policy.start()
        for _ in range(20):
            policy.record_drafted(4, 4, False)
        policy.waiting = waiting
        cost = 5.4 * policy.saving(draft_cost=0.01)  # five and some steps' saving, for one lane
        return next(i for i in range(1, 100) if policy.pays_catch_up(cost, 0.01))

    assert first_paid(0) == 7  # alone: once six steps' saving is forgone
    assert first_paid(3) == 23  # three more lanes wait on it: four times the seconds to win back


def test_a_catch_up_the_tokens_left_cannot_win_back_is_never_paid() -> None:
    policy = DraftLengthPolicy(FLAT, k_max=4)
    policy.start()
    saving = policy.saving(draft_cost=0.01, alpha=0.9)
    # The request may emit 10 more tokens at most: never; 100: within a hundred asks.
    assert not any(policy.pays_catch_up(11 * saving, 0.01, 0.9, remaining=10) for _ in range(100))
    assert any(policy.pays_catch_up(11 * saving, 0.01, 0.9, remaining=100) for _ in range(100))
    policy.start()
    assert policy.catch_up.asked_at is None  # a new request's tokens left are unknown until it asks


def _always_kept() -> DraftLengthPolicy:
    policy = DraftLengthPolicy(FLAT, k_max=4)
    policy.start()
    for _ in range(20):
        policy.record_drafted(4, 4, False)
    return policy


def test_a_catch_up_a_long_answer_is_expected_to_win_back_is_paid_at_a_share_of_its_cost() -> None:
    saving = _always_kept().saving(draft_cost=0.01)
    # 5.5 steps' saving: no prediction (remaining unknown) waits for all of it, a request that may
    # emit 1000 more tokens (and no finished request says otherwise) pays once TRUST of it is
    # forgone, counting the coming step: on the 2nd ask; one of 3 steps' saving at once.
    unknown = _always_kept()
    assert [unknown.pays_catch_up(5.5 * saving, 0.01) for _ in range(8)].index(True) == 6
    expected_long = _always_kept()
    assert [expected_long.pays_catch_up(5.5 * saving, 0.01, None, 1000) for _ in range(3)] == [False, True, False]
    assert _always_kept().pays_catch_up(3 * saving, 0.01, 0.9, remaining=1000)
    # 20 tokens left win 5.5 steps' saving back, but not four times over: plain ski rental.
    short_margin = _always_kept()
    assert [short_margin.pays_catch_up(5.5 * saving, 0.01, None, 20 - i, i) for i in range(8)].index(True) == 6


def test_finished_requests_lengths_predict_whether_a_catch_up_wins_back() -> None:
    policy = _always_kept()
    saving = policy.saving(draft_cost=0.01)
    for length in (4, 5, 6, 5, 300):
        policy.record_length(length)
    assert policy.expected_tokens_left(1000, emitted=2) == 3  # the median, 5, less the 2 emitted
    assert policy.expected_tokens_left(1000, emitted=9) == 0
    assert policy.expected_tokens_left(1, emitted=2) == 1  # never beyond max_tokens
    # Answers of about five tokens cannot win back 5.5 steps' saving: plain ski rental, however
    # many tokens max_tokens leaves.
    answers = [policy.pays_catch_up(5.5 * saving, 0.01, None, 1000 - i, emitted=i) for i in range(8)]
    assert answers.index(True) == 6
    for _ in range(LENGTHS_KEPT):
        policy.record_length(400)  # only the latest requests count
    assert policy.expected_tokens_left(1000, emitted=0) == 400
    policy.start()
    assert policy.pays_catch_up(3 * saving, 0.01, 0.9, 1000) and len(policy.lengths) == LENGTHS_KEPT


def test_the_engine_tells_the_policy_the_lengths_of_finished_requests_only(target4) -> None:
    policy = DraftLengthPolicy(FLAT, k_max=3)
    engine = Engine(target4, drafters.create("ngram", target4, {}), 3, policy)
    out = engine.generate(PROMPT, SamplingParams(max_tokens=7, ignore_eos=True))
    assert len(out.token_ids) == 7 and policy.lengths == [7]
    run, _ = engine.begin(PROMPT, GREEDY)
    engine.step(run)
    engine.end(run)  # given up before it finished
    assert policy.lengths == [7]


def test_a_catch_up_is_never_paid_for_drafts_that_do_not_pay() -> None:
    policy = DraftLengthPolicy(LINEAR, k_max=4)  # every row costs a full pass
    policy.start()
    assert policy.saving(draft_cost=0.01) == 0.0
    assert not any(policy.pays_catch_up(0.001, 0.01) for _ in range(100))
    assert DraftLengthPolicy(LINEAR, k_max=4, fixed=True).pays_catch_up(100.0)  # fixed K: the experiment pays


# --- the engine under a policy ---------------------------------------------------------------------


class WrongDrafter(Drafter):
    """Proposes a token the target never writes: every draft fails."""

    def __init__(self, token: int, stateless: bool) -> None:
        self.token, self.stateless, self.calls = token, stateless, 0

    def start(self, prompt_ids, target_cache, max_len) -> None:
        pass

    def propose(self, context, k, params, generator) -> DraftTree:
        self.calls += 1
        return DraftTree.chain([self.token] * k)

    def observe(self, num_accepted, aux_logits=None) -> None:
        pass


@pytest.fixture(scope="module")
def target4() -> LoadedModel:
    return tiny_model(2, name="target4", num_layers=4)


PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
GREEDY = SamplingParams(max_tokens=60)


def steady_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's clock advances 0.1 ms a reading: every measured draft costs the same small time,
    so a policy's choices follow its tables, not a pause of the machine's (one slow draft once turned
    early exit off here before its first kept token, which comes at about its tenth draft)."""
    readings = itertools.count()
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: next(readings) * 1e-4))


@pytest.mark.parametrize("stateless", [False, True])
def test_the_engine_stops_verifying_drafts_that_keep_failing(target4, stateless, monkeypatch) -> None:
    steady_clock(monkeypatch)
    plain = Engine(target4).generate(PROMPT, GREEDY).token_ids
    unused = next(t for t in range(target4.decoder.cfg.vocab_size) if t not in plain)
    drafter = WrongDrafter(unused, stateless)
    policy = DraftLengthPolicy(SLOPED, k_max=4)
    out = Engine(target4, drafter, 4, policy).generate(PROMPT, GREEDY)
    assert out.token_ids == plain
    m = out.metrics
    assert m.num_accepted_tokens == 0
    # α falls from its prior of 0.5 one rejection per step until a row's 5 % is no longer worth it;
    # then only probes (a non-free drafter) or nothing (shadows) are verified: 16 of 59 steps at most.
    assert m.num_drafts <= 16
    assert policy.figures().alpha < 0.2
    if stateless:
        assert drafter.calls > 50  # still proposing, in the shadow of plain steps


@pytest.mark.parametrize("method,options", [("ngram", {}), ("early-exit", {"layer": 3}), ("lookahead", {})])
@pytest.mark.parametrize("costs", [FLAT, LINEAR], ids=["flat", "linear"])
def test_greedy_output_is_plain_under_any_policy(target4, method, options, costs, monkeypatch) -> None:
    steady_clock(monkeypatch)
    plain = Engine(target4).generate(PROMPT, GREEDY).token_ids
    policy = DraftLengthPolicy(costs, k_max=5)
    out = Engine(target4, drafters.create(method, target4, options), 5, policy).generate(PROMPT, GREEDY)
    assert out.token_ids == plain
    if method == "lookahead":
        # Its window rides on every drafting step (12 aux rows by the third step, past FLAT's and
        # LINEAR's cheap rows) and offers no guess while it warms up: these tables turn it off
        # (the tests below show it drafting where rows are cheaper).
        return
    if costs is LINEAR:
        # Rows that cost a pass each: after the optimistic start only probes are verified.
        assert 1 <= out.metrics.num_drafts < 15
    else:
        assert out.metrics.num_accepted_tokens > 0  # rows nearly free: it drafts, and drafts are kept


@pytest.mark.parametrize("costs,kept", [(PassCosts([0.100] * 64), 30), (SLOPED, 10)], ids=["free", "sloped"])
def test_lookahead_drafts_under_the_policy_where_its_window_rows_are_cheap(target4, costs, kept, monkeypatch) -> None:
    """Free rows (a GPU at batch one), or 5 % of a pass each: once its window has warmed up, its
    guesses pay for the 12 rows it adds (priced once a step, `draft_rows`)."""
    steady_clock(monkeypatch)
    plain = Engine(target4).generate(PROMPT, GREEDY).token_ids
    policy = DraftLengthPolicy(costs, k_max=5)
    out = Engine(target4, drafters.create("lookahead", target4, {}), 5, policy).generate(PROMPT, GREEDY)
    assert out.token_ids == plain
    assert out.metrics.num_accepted_tokens > kept  # the Jacobi window warmed up and its n-grams were kept


def test_the_api_defaults_to_the_adaptive_policy_and_fixed_keeps_k(target4) -> None:
    adaptive = LLM(target4, speculative_method="ngram", num_speculative_tokens=3)
    assert adaptive.engine.policy is not None and not adaptive.engine.policy.fixed
    fixed = LLM(target4, speculative_method="ngram", num_speculative_tokens=3, speculative_k_policy="fixed")
    assert fixed.engine.policy is None
    out = fixed.generate(PROMPT, SamplingParams(max_tokens=30))[0]
    # Fixed K: every drafting step asks for 3 (shorter only when the match runs out or at the end).
    assert out.metrics.num_drafts > 0
    with pytest.raises(ForerunError, match="speculative_k_policy must be adaptive or fixed"):
        LLM(target4, speculative_method="ngram", speculative_k_policy="sometimes")


# --- measured costs --------------------------------------------------------------------------------


def test_measured_pass_costs_cover_every_row_count(target4) -> None:
    limit = target4.decoder.cfg.max_position
    costs = measure_pass_costs(target4.decoder, rows=6, context=20, repeats=1, wide=(4, 8, 12, limit))
    assert len(costs.seconds) == 6 and all(s > 0 for s in costs.seconds)
    assert list(costs.wide) == [8, 12] and costs.wide[8] >= costs.seconds[-1]  # past the rows, within the context


def test_pass_costs_are_cached_per_model_and_measured_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    folder = save_hf_folder(tiny_model(0, name="cached"), tmp_path / "model")
    model = load_model(str(folder), "float32")
    first = cached_pass_costs(model, rows=4)
    files = list((tmp_path / "home" / "costs").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["seconds"] == first.seconds

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(pass_costs_module, "measure_pass_costs", no_measuring)
    cached = cached_pass_costs(model, rows=4)
    assert cached.seconds == first.seconds and first.wide and cached.wide == first.wide  # the wider passes too
    files[0].write_text("not json")  # a damaged cache is measured again, not fatal
    monkeypatch.setattr(pass_costs_module, "measure_pass_costs", measure_pass_costs)
    assert len(cached_pass_costs(model, rows=4).seconds) == 4
    assert len(json.loads(files[0].read_text())["seconds"]) == 4


@pytest.mark.skipif(not pass_costs_module.native.available(), reason="native kernels unavailable")
def test_a_new_build_of_the_kernels_is_timed_again(tmp_path, monkeypatch) -> None:
    from tests.test_load import write_gguf

    base = tiny_model(0, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
    model = load_model(
        str(write_gguf(base, tmp_path / "t.gguf", quant=lambda name: "Q8_0")), with_tokenizer=False, quantization="gguf"
    )
    before = pass_costs_module._cost_key(model, 4)
    assert before is not None and before == pass_costs_module._cost_key(model, 4)
    monkeypatch.setattr(pass_costs_module.native, "version", lambda: "another build")
    assert pass_costs_module._cost_key(model, 4) != before


@pytest.mark.skipif(not pass_costs_module.native.available(), reason="native kernels unavailable")
def test_another_cpu_generation_is_timed_again(tmp_path, monkeypatch) -> None:
    # One name ("AMD EPYC") has booted as an AVX2-only CPU, a half-width and a full-width AVX-512 one.
    from forerun.base import cpu
    from tests.test_cpu import ZEN5
    from tests.test_load import write_gguf

    base = tiny_model(0, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
    model = load_model(
        str(write_gguf(base, tmp_path / "t.gguf", quant=lambda name: "Q8_0")), with_tokenizer=False, quantization="gguf"
    )
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: cpu.parse_cpuinfo(ZEN5))
    zen5 = pass_costs_module._cost_key(model, 4)
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: cpu.parse_cpuinfo(ZEN5.replace("family\t: 26", "family\t: 25")))
    assert pass_costs_module._cost_key(model, 4) != zen5
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: cpu.parse_cpuinfo(ZEN5))
    assert pass_costs_module._cost_key(model, 4) == zen5


def test_a_model_built_in_memory_is_measured_not_cached(tmp_path, monkeypatch, target4) -> None:
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path))
    assert len(cached_pass_costs(target4, rows=3).seconds) == 3
    assert not (tmp_path / "costs").exists()


class CostlyDrafter(WrongDrafter):
    """Says its own token cost, as a draft model does."""

    def cost_per_token(self) -> float:
        return 0.5


def test_a_drafter_that_knows_its_token_cost_is_believed_over_the_call_time(target4) -> None:
    policy = DraftLengthPolicy(SLOPED, k_max=3)
    engine = Engine(target4, CostlyDrafter(0, stateless=False), 3, policy)
    engine.generate(PROMPT, SamplingParams(max_tokens=3))
    assert policy.figures().draft_cost == pytest.approx(0.5)  # not the microseconds its call took
    assert policy.choose() == (0, False)  # half a second per token never pays here


class WindowDrafter(WrongDrafter):
    """Every proposal carries eight aux rows beside its nodes, as lookahead's window does."""

    def propose(self, context, k, params, generator) -> DraftTree:
        self.calls += 1
        return DraftTree(
            [self.token] * k,
            list(range(-1, k - 1)),
            aux_tokens=[self.token] * 8,
            aux_offsets=list(range(1, 9)),
            aux_mask=torch.ones(8, 9, dtype=torch.bool),
        )


def test_aux_rows_count_as_rows_the_draft_adds(target4) -> None:
    policy = DraftLengthPolicy(SLOPED, k_max=2)
    engine = Engine(target4, WindowDrafter(0, stateless=False), 2, policy)
    engine.generate(PROMPT, SamplingParams(max_tokens=3))  # one step: the one-token first draft
    figures = policy.figures()
    assert (figures.rows_per_token, figures.aux_rows) == (pytest.approx(1.0), pytest.approx(8.0))  # node, window
    assert draft_rows(3, *figures.rows) == 1 + 3 + 8  # the window rides once, whatever the length


def test_rows_that_come_with_every_draft_are_priced_once_not_per_token() -> None:
    # Each row adds 5 % of a pass: eight aux rows cost 40 % whatever the length, so long drafts pay.
    assert best_k(0.7, SLOPED, 0.0, 5, rows_per_token=1.0, aux_rows=8.0) == 5
    assert best_k(0.7, SLOPED, 0.0, 5, rows_per_token=9.0) < 5  # priced per token, nine rows each
    window = (0.7, 0.0, 1.0, 8.0)  # a batch lane (α, c_draft, rows per token, aux rows)
    assert batch_draft_length([window], SLOPED, 5) == 5
    assert batch_draft_length([(0.7, 0.0, 9.0, 0.0)], SLOPED, 5) < 5


class GuesslessWindowDrafter(WrongDrafter):
    """A window of aux rows and no guess, as lookahead proposes when no n-gram matches."""

    def propose(self, context, k, params, generator) -> DraftTree:
        self.calls += 1
        return DraftTree(
            [],
            [],
            aux_tokens=[self.token] * 8,
            aux_offsets=list(range(1, 9)),
            aux_mask=torch.ones(8, 9, dtype=torch.bool),
        )


def test_a_window_without_guesses_counts_as_a_failed_draft(target4) -> None:
    policy = DraftLengthPolicy(FLAT, k_max=2)  # rows cheap: only acceptance can say no
    drafter = GuesslessWindowDrafter(0, stateless=False)
    engine = Engine(target4, drafter, 2, policy)
    out = engine.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))
    assert len(out.token_ids) == 24 and out.metrics.num_draft_tokens == 0
    assert policy.figures().alpha < 0.4  # below the prior: each window a failed draft
    assert drafter.calls <= 6  # first draft and a few probes, not every step


def test_learned_costs_follow_the_steps_the_engine_times() -> None:
    costs = PassCosts([0.10, 0.10, 0.11, 0.12], learn=True)
    costs.observe(1, 0.20)  # the machine is twice as busy as when measured
    assert costs(1) == pytest.approx(0.20) and costs(3) == pytest.approx(0.22)  # scaled offline figures
    for _ in range(10):
        costs.observe(2, 0.30)  # drafting steps cost more than the offline pass said
    assert costs(2) == pytest.approx(0.30, rel=0.02)  # its own running mean
    assert costs(3) >= costs(2)  # never cheaper for more rows
    assert costs(6) >= costs(4)


def test_verifications_of_changing_size_are_priced_by_what_verifications_cost() -> None:
    costs = PassCosts([0.10 + 0.003 * r for r in range(16)], learn=True)
    for _ in range(20):
        costs.observe(1, 0.10)  # plain steps cost what was measured
    for rows in range(18, 26):
        costs.observe(rows, 1.6 * costs.offline(rows))  # each count once: none is its own mean yet
    assert costs(1) == pytest.approx(0.10)
    assert costs(23) > 1.45 * costs.offline(23)  # not the one-row steps' ratio of 1
    assert costs(30) > 1.45 * costs.offline(30)


def test_synthetic_curves_do_not_learn() -> None:
    costs = PassCosts([0.1, 0.1])
    costs.observe(1, 5.0)
    assert costs(1) == 0.1


@pytest.mark.parametrize("read_seconds,drafts", [(1.0, False), (1e-6, True)], ids=["dear", "cheap"])
def test_a_draft_model_reads_a_long_prompt_only_when_the_answer_can_pay_for_it(target4, read_seconds, drafts) -> None:
    prompt = [(7 * i) % 50 + 3 for i in range(40)]  # a 40-token catch-up before the first draft
    plain = Engine(target4).generate(prompt, GREEDY).token_ids
    drafter = drafters.create("draft", target4, {"model": perturbed(target4, 0.05)})
    engine = Engine(target4, drafter, 3, DraftLengthPolicy(FLAT, k_max=3))
    drafter.costs.read_seconds = read_seconds  # seconds per token of catch-up
    out = engine.generate(prompt, GREEDY)
    assert out.token_ids == plain
    # Dear: 40 s of catch-up against at most a pass saved per step, never paid in 60 steps.
    assert (out.metrics.num_drafts > 0) == drafts
    assert (len(drafter.fed) > len(prompt)) == drafts


def test_auto_keeps_the_acceptance_of_its_suffix_and_draft_model_apart(target4) -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3 + [20, 21]  # copies, then new text
    plain = Engine(target4).generate(prompt, GREEDY).token_ids
    auto = drafters.create("auto", target4, {"model": target4, "long_match": 4})  # the target drafts: always kept
    policy = DraftLengthPolicy(FLAT, k_max=3)
    out = Engine(target4, auto, 3, policy).generate(prompt, GREEDY)
    assert out.token_ids == plain
    assert auto.steps["draft"] > 0 and set(policy.sources) <= {"suffix", "draft"}
    draft = policy.sources["draft"]
    assert draft.current.alpha > 0.9 and draft.timed and draft.draft_cost > 0
    assert auto.draft.costs.acceptance.alpha > 0.9  # the draft model's own count, for its catch-up gate


def test_the_engine_times_its_steps_into_learned_costs(target4) -> None:
    costs = PassCosts([1.0] * 16, learn=True)  # absurd offline figures, corrected by timing
    policy = DraftLengthPolicy(costs, k_max=3)
    Engine(target4, drafters.create("ngram", target4, {}), 3, policy).generate(PROMPT, GREEDY)
    assert costs.seen and costs(1) < 0.5


def test_a_waiting_catch_up_is_owed_what_the_steps_meanwhile_cost_beyond_drafted_tokens() -> None:
    # A plain step forgoes one token's saving; a step whose kept suffix drafts emitted four
    # tokens for one pass forgoes nothing (those tokens came cheaper than drafting them would).
    def forgone_after(steps: list[tuple[int, int, float]]) -> float:
        policy = DraftLengthPolicy(FLAT, k_max=4)
        policy.start()
        remaining = 1000
        policy.pays_catch_up(10.0, 0.01, 0.9, remaining)  # the first ask: one token's saving
        before = policy.catch_up.forgone
        for rows, tokens, seconds in steps:
            policy.record_timed_step(rows, seconds)
            remaining -= tokens
            policy.pays_catch_up(10.0, 0.01, 0.9, remaining)
        return policy.catch_up.forgone - before

    saving = DraftLengthPolicy(FLAT, k_max=4).saving(0.01, 0.9)
    assert 0 < saving < FLAT(1)
    assert forgone_after([(1, 1, FLAT(1))] * 3) == pytest.approx(3 * saving)
    assert forgone_after([(5, 4, FLAT(5))] * 3) == 0.0
    assert forgone_after([(5, 1, FLAT(5))]) == pytest.approx(FLAT(5) - FLAT(1) + saving)  # a failed draft: its rows too
