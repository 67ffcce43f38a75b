"""The speculative engine on tiny fp32 models: greedy output identical to plain decoding, stops that
fall inside an accepted run, seeded reproducibility and metrics that add up."""

from __future__ import annotations

import pytest
from conftest import perturbed

import forerun.engine.engine as engine_module
from forerun import LLM
from forerun.base.config import SamplingParams
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.engine.engine import Engine, RequestOutput
from forerun.engine.metrics import SpecMetrics
from forerun.models.load import LoadedModel
from forerun.models.testing import tiny_model
from forerun.models.tokenizer import Tokenizer
from forerun.policy.draft_length import DecayedCounts
from forerun.policy.pass_costs import PassCosts
from forerun.verification.sampling import make_generator

PROMPT = [5, 6, 7, 8, 40, 41]
MAX = 32


@pytest.fixture(scope="module")
def drafts(target: LoadedModel) -> dict[str, LoadedModel]:
    """Draft = target (always right), a noisy copy (right about half the time), an unrelated model."""
    return {"same": target, "noisy": perturbed(target, 0.05), "other": tiny_model(1, name="other")}


@pytest.fixture(scope="module")
def plain_greedy(target: LoadedModel) -> RequestOutput:
    return Engine(target).generate(PROMPT, SamplingParams(max_tokens=MAX))


def spec(target: LoadedModel, draft: LoadedModel, k: int, second_choice: float = 2.0, branch: int = 0) -> Engine:
    """A draft model's chains (no second-choice leaves unless `second_choice` asks for them)."""
    return Engine(target, DraftModelDrafter(target, draft, second_choice=second_choice, branch=branch), k)


def check_metrics(out: RequestOutput, k: int, leaves: bool = False, branch: int = 0) -> None:
    """`leaves`: the drafts also carry up to k second-choice leaves and `branch` tokens after one."""
    m = out.metrics
    assert m.num_speculative_tokens == k
    assert m.num_emitted_tokens == len(out.token_ids)
    assert m.num_accepted_tokens <= m.num_draft_tokens <= m.num_drafts * (2 * k + branch if leaves else k)
    if m.num_draft_tokens:
        assert m.acceptance_rate == pytest.approx(m.num_accepted_tokens / m.num_draft_tokens)
    assert m.mean_accepted_length == pytest.approx(m.num_emitted_tokens / m.num_target_forwards)
    assert len(m.accepted_per_position) == k and sum(m.accepted_per_position) == m.num_accepted_tokens
    assert all(a >= b for a, b in zip(m.accepted_per_position, m.accepted_per_position[1:]))
    # Every target forward (prefill included) emits at least one token and at most k + 1.
    assert m.num_target_forwards <= m.num_emitted_tokens <= m.num_target_forwards * (k + 1)
    assert 0.0 <= m.efficiency <= 1.0


@pytest.mark.parametrize("which", ["same", "noisy", "other"])
def test_greedy_speculation_reproduces_plain_decoding_for_every_k(target, drafts, plain_greedy, which):
    assert len(plain_greedy.token_ids) == MAX and plain_greedy.finish_reason == "length"
    for k in range(1, 9):
        out = spec(target, drafts[which], k).generate(PROMPT, SamplingParams(max_tokens=MAX))
        assert out.token_ids == plain_greedy.token_ids, f"K={k}"
        assert out.finish_reason == "length"
        check_metrics(out, k)
        if which == "same":
            assert out.metrics.acceptance_rate >= 0.98, f"K={k}"
        if which == "noisy":  # the noisy draft is a real test: it is sometimes right, sometimes wrong
            assert 0.05 < out.metrics.acceptance_rate < 0.95, f"K={k}"


@pytest.mark.parametrize("branch", [0, 2], ids=["leaves", "a leaf continued"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_second_choice_leaves_keep_greedy_output_and_save_target_passes(target, drafts, plain_greedy, k, branch):
    # The noisy draft's first choice is often wrong; where it is, its second is often the target's.
    chain = spec(target, drafts["noisy"], k).generate(PROMPT, SamplingParams(max_tokens=MAX))
    tree = spec(target, drafts["noisy"], k, 0.0, branch).generate(PROMPT, SamplingParams(max_tokens=MAX))
    assert tree.token_ids == plain_greedy.token_ids == chain.token_ids
    check_metrics(tree, k, leaves=True, branch=branch)
    assert tree.metrics.num_draft_tokens > chain.metrics.num_draft_tokens  # the leaves were verified
    assert tree.metrics.num_target_forwards < chain.metrics.num_target_forwards


@pytest.mark.parametrize("row_seconds,leaves", [(0.0, True), (0.1, False)], ids=["free rows", "dear rows"])
def test_a_second_choice_leaf_is_proposed_only_where_its_row_pays(target, drafts, row_seconds, leaves) -> None:
    drafter = DraftModelDrafter(target, drafts["noisy"], second_choice=0.0)
    drafter.start(PROMPT, None, 64)
    drafter.set_pass_cost(PassCosts([0.1 + row_seconds * r for r in range(16)]))
    drafter.costs.token_seconds = 1e-6
    tree = drafter.propose(PROMPT, 4, SamplingParams(), None)
    # A row as dear as a whole pass never pays for a leaf the target keeps less than always.
    assert (not tree.is_chain) == leaves


def test_a_branch_continues_the_first_leaf_with_the_drafts_own_greedy_tokens(target, drafts) -> None:
    def proposal(context: list[int], k: int, **options):
        drafter = DraftModelDrafter(target, drafts["noisy"], **options)
        drafter.start(PROMPT, None, 64)
        return drafter.propose(context, k, SamplingParams(), None)

    # Without the target's costs every leaf pays: a leaf at every depth, the first beside token 0.
    leaves = proposal(PROMPT, 4, second_choice=0.0, branch=0)
    tree = proposal(PROMPT, 4, second_choice=0.0, branch=2)
    n = len(leaves.tokens)
    assert leaves.parents[:5] == [-1, 0, 1, 2, -1] and n == 8
    assert tree.tokens[:n] == leaves.tokens and tree.parents[:n] == leaves.parents  # the rest unchanged
    assert tree.parents[n:] == [4, n]  # two tokens below the first leaf (node 4)
    # They are what the draft model writes greedily after the leaf.
    assert tree.tokens[n:] == proposal(PROMPT + [leaves.tokens[4]], 2, second_choice=2.0).tokens
    assert proposal(PROMPT, 4, second_choice=2.0, branch=2).is_chain  # no leaf, no branch
    with pytest.raises(ValueError, match="draft branch"):
        proposal(PROMPT, 4, branch=-1)


def test_a_draft_model_shut_out_by_a_stalled_pass_gets_its_timed_cost_back_by_degrees(target, drafts) -> None:
    # The gate admits a catch-up on the drafter's token cost, which only drafting updates: after
    # a stalled pass, requests without drafting age it toward the timed figure.
    drafter = DraftModelDrafter(target, drafts["noisy"])
    drafter.setup.timed = (0.001, 0.01)
    drafter.start(PROMPT, None, 64)
    drafter.costs.acceptance, drafter.costs.token_seconds = DecayedCounts(1.0, 9.0), 1.0
    costs = []
    for _ in range(5):
        drafter.start(PROMPT, None, 64)  # the request before drafted nothing
        costs.append(drafter.costs.token_seconds)
    assert costs == sorted(costs, reverse=True) and costs[-1] < 0.05
    assert drafter.costs.acceptance.alpha == pytest.approx(0.1)  # what the drafts showed stands
    # A request that drafted keeps its figures as they are.
    drafter.propose(PROMPT, 2, SamplingParams(), None)
    drafter.costs.token_seconds = 1.0
    drafter.start(PROMPT, None, 64)
    assert drafter.costs.token_seconds == 1.0


def test_with_the_target_as_draft_each_step_emits_k_plus_one_tokens(target, drafts):
    k = 4
    out = spec(target, drafts["same"], k).generate(PROMPT, SamplingParams(max_tokens=1 + 3 * (k + 1)))
    m = out.metrics
    assert m.num_target_forwards == 1 + 3 and m.num_drafts == 3
    assert m.accepted_per_position == [3, 3, 3, 3]
    assert m.efficiency == 1.0 and m.mean_accepted_length == pytest.approx(16 / 4)


def test_plain_decoding_has_no_speculation_metrics(plain_greedy):
    m = plain_greedy.metrics
    assert m.num_drafts == m.num_draft_tokens == m.num_accepted_tokens == 0
    assert m.num_target_forwards == m.num_emitted_tokens == MAX
    assert m.acceptance_rate == 0.0 and m.efficiency == 0.0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 11])
def test_max_tokens_ends_speculation_exactly_where_plain_decoding_ends(target, drafts, plain_greedy, max_tokens):
    out = spec(target, drafts["same"], 4).generate(PROMPT, SamplingParams(max_tokens=max_tokens))
    assert out.token_ids == plain_greedy.token_ids[:max_tokens]
    assert out.finish_reason == "length"
    check_metrics(out, 4)


def first_new_token(tokens: list[int], start: int, avoid: set[int]) -> int:
    """Index of the first token at or after `start` that did not occur before it and is not in `avoid`."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i] and tokens[i] not in avoid:
            return i
    raise AssertionError("the plain output has no new token to stop on; change the prompt")


@pytest.mark.parametrize("k", [3, 5, 8])
def test_a_stop_token_inside_an_accepted_run_ends_where_plain_decoding_ends(target, drafts, plain_greedy, k, tokenizer):
    # Declare a token that plain decoding emits mid-run a stop token, via the tokenizer's extra stop ids.
    i = first_new_token(plain_greedy.token_ids, 2, set())
    while i % (k + 1) in (0, k):  # neither a step's bonus nor its last draft: inside the run
        i = first_new_token(plain_greedy.token_ids, i + 1, set())
    stop_tok = Tokenizer(tokenizer.hf, extra_stop_ids=[plain_greedy.token_ids[i]])
    tgt = LoadedModel("target", target.decoder, stop_tok, target.source)
    drf = LoadedModel("same", drafts["same"].decoder, stop_tok, target.source)
    plain = Engine(tgt).generate(PROMPT, SamplingParams(max_tokens=MAX))
    out = spec(tgt, drf, k).generate(PROMPT, SamplingParams(max_tokens=MAX))
    assert plain.token_ids == plain_greedy.token_ids[: i + 1] and plain.finish_reason == "stop"
    assert (out.token_ids, out.text, out.finish_reason) == (plain.token_ids, plain.text, "stop")
    m = out.metrics
    assert m.num_emitted_tokens == len(out.token_ids) == i + 1
    assert m.num_accepted_tokens == i - i // (k + 1)  # all emitted but the first and each step's bonus
    assert m.num_draft_tokens > m.num_accepted_tokens  # ... and the stop cut an accepted run short
    check_metrics(out, k)


@pytest.mark.parametrize("k", [4, 7])
def test_a_stop_string_inside_an_accepted_run_ends_where_plain_decoding_ends(target_tok, tokenizer, k):
    params = SamplingParams(max_tokens=MAX, ignore_eos=True)
    full = Engine(target_tok).generate(PROMPT, params)
    text, ids = full.text, full.token_ids

    def completes_at(stop: str) -> int:
        """Index of the token whose text completes the first occurrence of `stop`."""
        return next(n for n in range(len(ids)) if stop in tokenizer.decode(ids[: n + 1]))

    # A two-character stop string, new where it first appears, completed by a draft strictly inside a run.
    stop = next(
        text[j : j + 2]
        for j in range(2, len(text) - 2)
        if text.find(text[j : j + 2]) == j and completes_at(text[j : j + 2]) % (k + 1) not in (0, k)
    )
    params = SamplingParams(max_tokens=MAX, ignore_eos=True, stop=(stop,))
    plain = Engine(target_tok).generate(PROMPT, params)
    out = spec(target_tok, target_tok, k).generate(PROMPT, params)
    assert plain.finish_reason == "stop" and plain.text == text[: text.find(stop)]
    assert (out.token_ids, out.text, out.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    assert len(out.token_ids) == completes_at(stop) + 1 == out.metrics.num_emitted_tokens
    assert out.metrics.num_draft_tokens > out.metrics.num_accepted_tokens  # the stop cut a run short
    check_metrics(out, k)


def test_streamed_text_joins_to_the_final_text_and_holds_no_stop_string(target_tok):
    params = SamplingParams(max_tokens=MAX, ignore_eos=True)
    text = Engine(target_tok).generate(PROMPT, params).text
    stop = text[9:12]
    llm = LLM(target_tok, speculative_model=target_tok, num_speculative_tokens=4)
    pieces = list(llm.stream(PROMPT, SamplingParams(max_tokens=MAX, ignore_eos=True, stop=(stop,))))
    result = llm.last_result
    assert result.finish_reason == "stop" and result.text == text[: text.find(stop)]
    assert "".join(pieces) == result.text
    assert all(stop not in p for p in pieces)


@pytest.mark.parametrize("which", [None, "noisy", "same"])
def test_seeded_sampling_is_reproducible(target, drafts, which):
    def run(seed: int) -> list[int]:
        engine = Engine(target) if which is None else spec(target, drafts[which], 4)
        return engine.generate(PROMPT, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=seed)).token_ids

    first = run(11)
    assert run(11) == first
    assert run(12) != first


SEEDED = [
    SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=11),
    SamplingParams(temperature=0.7, top_k=5, max_tokens=24, seed=2**40 + 3),
    SamplingParams(temperature=1.3, min_p=0.02, max_tokens=24, seed=-5),
]


@pytest.mark.parametrize("which", ["same", "noisy", "other"])
@pytest.mark.parametrize("params", SEEDED, ids=["top-p", "top-k", "min-p"])
def test_a_seeded_sample_is_plain_decodings_with_that_seed_whatever_the_draft_model_drafts(
    target, drafts, which, params
):
    """Drafts with a distribution, drawn with the positions' own uniforms: every token emitted is the
    target's own draw at its position, so the text is plain decoding's, for every K."""
    plain = Engine(target).generate(PROMPT, params).token_ids
    kept = 0
    for k in (1, 3, 6):
        out = spec(target, drafts[which], k).generate(PROMPT, params)
        assert out.token_ids == plain, k
        kept += out.metrics.num_accepted_tokens
    assert kept > 0 or which == "other"  # drafts were kept, and the text is plain decoding's all the same


def test_a_seeded_draft_of_the_target_itself_is_kept_whole_because_it_draws_the_targets_numbers(
    target, drafts, monkeypatch
):
    params = SamplingParams(temperature=1.0, max_tokens=MAX, seed=3)
    out = spec(target, drafts["same"], 5).generate(PROMPT, params)
    assert out.metrics.acceptance_rate >= 0.98  # q == p: the same uniform draws the same token
    # The control: drafts drawn from a generator of their own are kept only where the two draws meet.
    monkeypatch.setattr(engine_module, "PositionDraws", lambda key, first: make_generator(key + first))
    uncoupled = spec(target, drafts["same"], 5).generate(PROMPT, params)
    assert uncoupled.token_ids == out.token_ids  # the text stays plain decoding's
    assert uncoupled.metrics.acceptance_rate < 0.9


def test_sampling_with_the_target_as_draft_accepts_nearly_everything(target, drafts):
    # p == q up to float noise, so min(1, p/q) is ~1 at every draft.
    out = spec(target, drafts["same"], 5).generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=MAX, seed=0))
    assert out.metrics.acceptance_rate >= 0.98
    check_metrics(out, 5)


@pytest.mark.parametrize("k", [2, 6])
def test_sampling_metrics_add_up_with_a_partial_draft(target, drafts, k):
    out = spec(target, drafts["noisy"], k).generate(PROMPT, SamplingParams(temperature=0.8, max_tokens=MAX, seed=3))
    assert len(out.token_ids) == MAX
    check_metrics(out, k)
    assert 0 < out.metrics.num_accepted_tokens < out.metrics.num_draft_tokens


def test_llm_api_matches_the_engine(target, drafts, plain_greedy):
    llm = LLM(target, speculative_model=drafts["noisy"], num_speculative_tokens=3)
    [result] = llm.generate(PROMPT, SamplingParams(max_tokens=MAX))
    assert result.token_ids == plain_greedy.token_ids and result.finish_reason == "length"
    assert result.metrics.num_emitted_tokens == MAX
    assert result.metrics.num_draft_tokens > 0  # the API's engine drafted: not plain against plain


# --- the counters on their own -------------------------------------------------------------------


def test_a_stop_inside_a_run_counts_only_the_emitted_drafts():
    m = SpecMetrics(num_speculative_tokens=4)
    m.record_step(0, 0, 1)  # prefill
    m.record_step(4, 4, 5)  # all kept + bonus
    m.record_step(4, 3, 2)  # three kept, but a stop came at the second
    m.record_step(4, 1, 2)  # one kept + recovered
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens, m.num_emitted_tokens) == (3, 12, 7, 10)
    assert m.accepted_per_position == [3, 2, 1, 1]
    assert m.num_target_forwards == 4 and m.mean_accepted_length == 10 / 4
    assert m.acceptance_rate == 7 / 12
    assert m.efficiency == 9 / 15  # the prefill token has no slot


def test_efficiency_ignores_steps_without_a_draft():
    m = SpecMetrics(num_speculative_tokens=1)
    m.record_step(0, 0, 1)
    m.record_step(1, 1, 2)
    m.record_step(0, 0, 1)  # too close to max_tokens to draft
    assert m.efficiency == 1.0


def test_merge_sums_counters_and_widens_positions():
    a, b = SpecMetrics(num_speculative_tokens=2), SpecMetrics(num_speculative_tokens=3)
    a.record_step(2, 2, 3)
    b.record_step(3, 1, 2)
    b.record_step(0, 0, 1)
    a.merge(b)
    assert a.num_speculative_tokens == 3 and a.accepted_per_position == [2, 1, 0]
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens, a.num_emitted_tokens, a.num_target_forwards) == (
        2,
        5,
        3,
        6,
        3,
    )
    assert a.efficiency == 5 / 8


@pytest.mark.parametrize("rate,k,expected", [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 2, 1.75), (0.8, 3, 2.952)])
def test_predicted_mean_accepted_length_is_the_geometric_series(rate, k, expected):
    m = SpecMetrics(num_speculative_tokens=k, num_draft_tokens=1000, num_accepted_tokens=int(rate * 1000))
    assert m.predicted_mean_accepted_length == pytest.approx(expected)


@pytest.mark.parametrize("token_seconds,drafted", [(1e-6, 6), (1.0, 1)], ids=["cheap", "dear"])
def test_a_draft_ends_once_another_token_cannot_pay(target, drafts, token_seconds, drafted) -> None:
    drafter = DraftModelDrafter(target, drafts["same"], second_choice=2.0)  # chains
    drafter.start(PROMPT, None, 64)
    drafter.set_pass_cost(PassCosts([0.1] * 16))  # one target pass: 0.1 s; extra rows free
    drafter.costs.token_seconds = token_seconds
    tree = drafter.propose(PROMPT, 6, SamplingParams(), None)
    # A draft forward dearer than a whole target pass never pays for a second token; a free one
    # is worth drafting while the draft's own probability of its tokens stays above ~0.
    assert len(tree) == drafted
    # Greedy output is the target's whatever the draft lengths.
    engine = Engine(target, drafter, 6)
    assert (
        engine.generate(PROMPT, SamplingParams(max_tokens=MAX)).token_ids
        == Engine(target).generate(PROMPT, SamplingParams(max_tokens=MAX)).token_ids
    )


def test_the_draft_cache_is_made_at_the_first_proposal_and_kept_for_the_next_request(target, drafts) -> None:
    drafter = DraftModelDrafter(target, drafts["noisy"], second_choice=2.0)
    drafter.start(PROMPT, None, 64)
    assert drafter.cache is None  # a request it never drafts for needs none
    first = drafter.propose(PROMPT, 4, SamplingParams(), None)
    cache = drafter.cache
    assert cache is not None and cache.length == len(PROMPT) + len(first) - 1  # the last draft token not fed
    # The next request on this drafter reuses the cache, which still holds the last one's entries
    # past its new length: its proposals are those of a fresh drafter all the same.
    other = [9, 3, 70, 71, 72]
    drafter.start(other, None, 64)
    assert drafter.cache is cache and cache.length == 0
    fresh = DraftModelDrafter(target, drafts["noisy"], second_choice=2.0)
    fresh.start(other, None, 64)
    assert (
        drafter.propose(other, 4, SamplingParams(), None).tokens
        == fresh.propose(other, 4, SamplingParams(), None).tokens
    )
    # A request needing more slots than it has gets a new one.
    drafter.start(PROMPT, None, cache.max_len + 1)
    assert drafter.cache is None
    assert drafter.propose(PROMPT, 4, SamplingParams(), None).tokens == first.tokens
    assert drafter.cache.max_len > cache.max_len
