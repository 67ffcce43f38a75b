"""Continuous batching: several sequences in one target pass, each exactly as it would run alone.

Row exactness is what makes this testable as bit equality: in w8a8 every row of a product comes out
the same in any batch, and attention runs each sequence's rows on its own cache, so a batched
verification must give every sequence the very logits it gets alone, and a batched request the very
tokens (greedy or sampled with its seed) it gets alone.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forerun import drafters
from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import Engine
from forerun.models.testing import tiny_model
from forerun.models.w8a8 import quantize_decoder_
from forerun.policy.draft_length import DraftLengthPolicy, batch_draft_length, expected_tokens
from forerun.policy.pass_costs import PassCosts
from forerun.verification.tree import DraftTree
from forerun.verification.verify import VerifyJob, verify, verify_many

SLOW = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SAMPLED = SamplingParams(temperature=1.0, max_tokens=8)


@pytest.fixture(scope="module")
def quantized():
    model = tiny_model(seed=1, name="target3", num_layers=3)
    quantize_decoder_(model.decoder)
    return model


def random_tree(draw, size: int) -> DraftTree:
    parents = [draw(st.integers(-1, i - 1)) for i in range(size)]
    return DraftTree([draw(st.integers(0, 98)) for _ in range(size)], parents)


@SLOW
@given(data=st.data(), count=st.integers(1, 6))
def test_a_batched_verification_gives_every_sequence_what_it_gets_alone(quantized, data, count: int) -> None:
    decoder = quantized.decoder
    alone_jobs, batched_jobs = [], []
    for _ in range(count):
        prefix = data.draw(st.lists(st.integers(0, 98), min_size=1, max_size=100))
        tree = random_tree(data.draw, data.draw(st.integers(0, 6)))
        root = data.draw(st.integers(0, 98))
        params = data.draw(st.sampled_from([SAMPLED, SamplingParams(max_tokens=8)]))  # sampled or greedy
        jobs = []
        for _ in range(2):
            cache = decoder.new_cache(len(prefix) + len(tree) + 2)
            decoder(torch.tensor(prefix), torch.arange(len(prefix)), cache)
            jobs.append(VerifyJob(cache, root, tree, params))
        alone_jobs.append(jobs[0])
        batched_jobs.append(jobs[1])
    batched = verify_many(decoder, batched_jobs)
    for i, (job, got) in enumerate(zip(alone_jobs, batched)):
        want = verify(decoder, job.cache, job.root, job.tree, job.params)
        assert torch.equal(got.hidden, want.hidden), f"sequence {i} of {count}: hidden states differ"
        assert torch.equal(got.probs, want.probs), f"sequence {i} of {count}: distributions differ"
        other = batched_jobs[i].cache
        assert other.length == job.cache.length
        assert torch.equal(other.k[:, :, :, : other.length], job.cache.k[:, :, :, : other.length])
        assert torch.equal(other.v[:, :, :, : other.length], job.cache.v[:, :, :, : other.length])


def processed_by_hand(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of logits [V] to its distribution [V] (float64), worked out token by token: the argmax
    under greedy; else the top_k likeliest, cut to the fewest whose mass (at the temperature) reaches
    top_p, then softmax at the temperature over those alone."""
    out = torch.zeros(len(row), dtype=torch.float64)
    order = sorted(range(len(row)), key=lambda t: -float(row[t]))  # likeliest first
    if params.greedy:
        out[order[0]] = 1.0
        return out
    kept = order[: params.top_k] if params.top_k > 0 else order
    scaled = row.double()[kept] / params.temperature
    weights = (scaled - scaled.max()).exp()
    mass, size = 0.0, 0
    for w in (weights / weights.sum()).tolist():
        if size > 0 and mass >= params.top_p:
            break
        mass, size = mass + w, size + 1
    out[kept[:size]] = weights[:size] / weights[:size].sum()
    return out


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 7, 1.0), (0.8, 0, 0.7), (1.5, 12, 0.5)],
)
def test_a_verifications_distribution_is_its_rows_processed(quantized, temperature, top_k, top_p) -> None:
    # Under greedy it keeps only each row's argmax; its one-hot rows, made when asked, are the same.
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=8, logprobs=1)
    decoder = quantized.decoder
    cache = decoder.new_cache(16)
    decoder(torch.tensor([5, 6, 7]), torch.arange(3), cache)
    ver = verify(decoder, cache, 4, DraftTree([8, 9, 10], [-1, 0, -1]), params)
    want = torch.stack([processed_by_hand(row, params) for row in ver.logits.float()])  # [4, vocab]
    assert torch.equal(ver.probs > 0, want > 0)  # the same tokens kept in every row
    torch.testing.assert_close(ver.probs.double(), want, rtol=1e-5, atol=1e-6)
    assert ver.best == ([int(row.argmax()) for row in want] if params.greedy else None)


# --- the batch engine ------------------------------------------------------------------------------


def run_batched(
    batch: BatchEngine, requests: list[tuple[list[int], SamplingParams]], kept: list[int] | None = None
) -> list[list[int]]:
    """Every request through `batch`, joining as lanes free up (first come first served); each
    request's draft tokens kept are added to `kept` when given."""
    waiting = list(enumerate(requests))
    tokens: dict[int, list[int]] = {}
    done: dict[int, list[int]] = {}
    while waiting or batch.lanes:
        while waiting and not batch.full:
            key, (prompt, params) = waiting.pop(0)
            first = batch.add(key, prompt, params)
            tokens[key] = list(first.token_ids)
            if first.finished:
                done[key] = batch.remove(key).token_ids
        for key, result in batch.step().items():
            assert result.error is None, result.error
            tokens[key] += result.output.token_ids
            if result.output.finished:
                output = batch.remove(key)
                assert output.token_ids == tokens[key]
                done[key] = output.token_ids
                if kept is not None:
                    kept.append(output.metrics.num_accepted_tokens)
    return [done[i] for i in range(len(requests))]


REQUESTS = [
    ([5, 6, 7, 5, 6, 7, 5], SamplingParams(max_tokens=30)),
    ([9], SamplingParams(max_tokens=12)),
    ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=25)),
    ([40, 41], SamplingParams(max_tokens=1)),
    ([7, 7, 7, 7], SamplingParams(temperature=1.0, top_k=5, max_tokens=20, seed=3)),
    ([60, 61, 62, 60, 61], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=18, seed=11)),
    ([33, 34, 35], SamplingParams(max_tokens=22)),
]


@pytest.fixture(scope="module")
def w8a8_draft():
    from tests.conftest import perturbed

    draft = perturbed(tiny_model(seed=1, name="draft3", num_layers=3), 0.3)
    quantize_decoder_(draft.decoder)
    return draft


@pytest.mark.parametrize("method", [None, "ngram", "suffix", "draft", "auto"])
@pytest.mark.parametrize("max_seqs", [1, 3, 8])
def test_each_batched_request_equals_its_run_alone(quantized, w8a8_draft, method, max_seqs) -> None:
    model = {"draft": w8a8_draft, "auto": w8a8_draft}.get(method)
    options = {"long_match": 3} if method == "auto" else {}
    llm = LLM(
        quantized,
        speculative_model=model,
        speculative_method=method,
        num_speculative_tokens=3,
        speculative_options=options,
        speculative_k_policy="fixed",  # every step drafts: the equality below is not plain against plain
    )
    alone = [Engine(quantized).generate(prompt, params).token_ids for prompt, params in REQUESTS]
    batch = BatchEngine(llm.new_engine, max_seqs)
    kept: list[int] = []
    got = run_batched(batch, REQUESTS, kept)
    # Greedy: the target's own tokens whatever drafts. Sampled: the same seed gives the same tokens
    # without speculation and with deterministic drafts (each position's token is drawn with its own
    # number, accept.accept_one_hot); a draft model's drafts have a distribution, and the rejection
    # rule spends the seed's randomness on them (the distribution tests cover those).
    for (prompt, params), tokens, want in zip(REQUESTS, got, alone):
        if params.greedy or method in (None, "ngram", "suffix"):
            assert tokens == want, f"prompt {prompt}"
    assert (sum(kept) > 0) == (method is not None)  # drafts were kept where a drafter ran
    assert not batch.lanes and 1 <= len(batch.idle) <= min(max_seqs, len(REQUESTS))  # lanes are reused


def test_sampled_speculation_with_a_seed_gives_the_same_tokens_batched_or_alone(quantized) -> None:
    # Fixed K and a drafter without memory: a request's draws depend on its seed and context alone.
    llm = LLM(quantized, speculative_method="ngram", num_speculative_tokens=3, speculative_k_policy="fixed")
    sampled = [(prompt, params) for prompt, params in REQUESTS if not params.greedy] * 3
    alone = [llm.new_engine().generate(prompt, params).token_ids for prompt, params in sampled]
    assert run_batched(BatchEngine(llm.new_engine, 4), sampled) == alone


def test_a_seeded_sample_batched_with_a_draft_model_is_plain_decodings(quantized) -> None:
    """A draft model's drafts draw with the positions' uniforms: batched, each seeded request writes
    what plain decoding writes alone."""
    from tests.conftest import perturbed

    near = perturbed(tiny_model(seed=1, name="near3", num_layers=3), 0.02)  # the target's weights, a little off
    quantize_decoder_(near.decoder)
    llm = LLM(quantized, speculative_model=near, speculative_method="draft", speculative_k_policy="fixed")
    sampled = [(prompt, params) for prompt, params in REQUESTS if not params.greedy and params.seed is not None] * 2
    plain = [Engine(quantized).generate(prompt, params).token_ids for prompt, params in sampled]
    kept: list[int] = []
    assert run_batched(BatchEngine(llm.new_engine, 4), sampled, kept) == plain
    assert sum(kept) > 0  # drafts were kept


def test_lanes_share_the_draft_weights(quantized, w8a8_draft) -> None:
    llm = LLM(quantized, speculative_model=w8a8_draft, speculative_method="draft")
    assert llm.new_engine().drafter.model is llm.engine.drafter.model
    assert llm.new_engine().drafter is not llm.engine.drafter


def test_checking_a_request_takes_no_lane(quantized) -> None:
    """The server checks every request before queueing it: that must neither use up a prepared
    lane (its drafter's state) nor build new ones."""
    llm = LLM(quantized)
    made = []

    def new_engine() -> Engine:
        made.append(llm.new_engine())
        return made[-1]

    batch = BatchEngine(new_engine, 3)
    batch.prepare()
    idle = list(batch.idle)
    for _ in range(5):
        assert batch.check_fits([1, 2, 3], SamplingParams(max_tokens=4)) > 7
    assert batch.idle == idle and len(made) == 3
    with pytest.raises(ForerunError, match="beyond the model's context"):
        batch.check_fits([1, 2, 3], SamplingParams(max_tokens=10**6))


class FailingEngine(Engine):
    """Fails a step of any request whose prompt starts with token 9."""

    def finish(self, run, plan, ver, timed=True):
        if run.seq.prompt_ids[0] == 9:
            raise RuntimeError("injected")
        return super().finish(run, plan, ver, timed)


def test_a_failing_request_ends_alone_and_the_others_finish(quantized) -> None:
    batch = BatchEngine(lambda: FailingEngine(quantized), max_seqs=3)
    for key, prompt in enumerate([[5, 6], [9, 9], [7, 8]]):
        batch.add(key, prompt, SamplingParams(max_tokens=10))
    failed = None
    outputs = {0: [], 2: []}
    while batch.lanes:
        for key, result in batch.step().items():
            if result.error is not None:
                failed = (key, str(result.error))
                batch.remove(key)
            elif result.output.finished:
                outputs[key] = batch.remove(key).token_ids
    assert failed == (1, "injected")
    for key, prompt in ((0, [5, 6]), (2, [7, 8])):
        assert outputs[key] == Engine(quantized).generate(prompt, SamplingParams(max_tokens=10)).token_ids


# --- speculation under load ------------------------------------------------------------------------


def flat_then_linear(rows: int) -> float:
    """A pass that costs the same up to 8 rows, then grows with every row."""
    return 0.1 * max(1, rows / 8)


def test_speculation_backs_off_as_the_batch_fills() -> None:
    lanes = [(0.8, 0.001, 1.0, 0.0)]
    ks = [batch_draft_length(lanes * b, flat_then_linear, 5) for b in (1, 2, 4, 8, 16, 64)]
    assert ks[0] >= 4  # rows free: draft long
    assert ks == sorted(ks, reverse=True)  # never more as the batch grows
    assert ks[-1] == 0  # every row dear: plain steps
    assert batch_draft_length([(0.0, 0.001, 1.0, 0.0)], flat_then_linear, 5) == 0  # drafts that never hold: none


def test_the_batch_draft_length_is_the_best_common_length() -> None:
    lanes = [(0.9, 0.002, 1.0, 0.0), (0.5, 0.002, 1.0, 0.0), (0.7, 0.0, 1.0, 0.0)]
    chosen = batch_draft_length(lanes, flat_then_linear, 6)

    def rate(k: int) -> float:
        rows = sum(1 + k for _ in lanes)
        return sum(expected_tokens(a, k) for a, _, _, _ in lanes) / (
            flat_then_linear(rows) + sum(k * c for _, c, _, _ in lanes)
        )

    assert all(rate(chosen) >= rate(k) for k in range(1, 7)) and rate(chosen) > rate(0)


def test_the_batch_caps_each_lanes_draft_length_by_the_load(quantized) -> None:
    costs = PassCosts([flat_then_linear(r) for r in range(1, 17)])

    def new_engine() -> Engine:
        return Engine(quantized, drafters.create("ngram", quantized, {}), 4, DraftLengthPolicy(costs, 4))

    prompt = [5, 6, 7, 8] * 6
    one = BatchEngine(new_engine, 1)
    one.add(0, prompt, SamplingParams(max_tokens=20))
    one.step()
    assert one.last_k > 0  # alone, rows are free: it drafts
    many = BatchEngine(new_engine, 40)
    for key in range(40):
        many.add(key, prompt, SamplingParams(max_tokens=20))
    many.step()
    assert many.last_k == 0  # 40 sequences fill every row: plain steps


def test_a_lanes_catch_up_is_priced_for_the_lanes_that_wait_on_it(quantized, w8a8_draft) -> None:
    asked = []

    class Recording(DraftLengthPolicy):
        def pays_catch_up(self, seconds, draft_cost=None, alpha=None, remaining=None, emitted=0) -> bool:
            asked.append(self.waiting)
            return super().pays_catch_up(seconds, draft_cost, alpha, remaining, emitted)

    costs = PassCosts([flat_then_linear(r) for r in range(1, 17)])

    def new_engine() -> Engine:
        drafter = drafters.create("draft", quantized, {"model": w8a8_draft})
        return Engine(quantized, drafter, 3, Recording(costs, 3))

    prompt = list(range(5, 45))  # the draft model's catch-up is longer than it pays unasked
    for lanes in (1, 3):
        asked.clear()
        batch = BatchEngine(new_engine, lanes)
        for key in range(lanes):
            batch.add(key, prompt, SamplingParams(max_tokens=4))
        batch.step()
        assert asked and set(asked) == {lanes - 1}  # each lane's gate counts the others


def test_a_batch_drafts_only_while_drafting_measures_faster() -> None:
    from forerun.policy.batch_rates import EXPLORE_EVERY, Rates

    rates = Rates()
    assert rates.choose_drafting() is True  # each option is tried first
    rates.record(True, 18.0, 0.10)
    assert rates.choose_drafting() is False
    rates.record(False, 20.0, 0.10)  # plain steps measure a little faster
    choices = [rates.choose_drafting() for _ in range(4 * EXPLORE_EVERY)]
    assert choices.count(True) == 4  # drafting again only to re-measure
    rates.record(True, 50.0, 0.10)
    rates.record(True, 50.0, 0.10)  # drafting got faster (say the batch shrank)
    every = rates.explore_every(drafting_better=True)
    picks = [rates.choose_drafting() for _ in range(every)]
    assert picks.count(False) == 1 and picks[-1] is False  # now plain steps are the ones re-measured


def test_drafting_that_measures_only_a_little_faster_is_not_chosen() -> None:
    from forerun.policy.batch_rates import DRAFTING_EDGE, EXPLORE_EVERY, Rates

    rates = Rates()
    rates.record(True, 20.0 * (1 + DRAFTING_EDGE / 2), 0.10)  # within the edge: noise, or no gain
    rates.record(False, 20.0, 0.10)
    assert not rates.drafting_better()
    assert [rates.choose_drafting() for _ in range(EXPLORE_EVERY)].count(True) == 1  # tries only
    rates = Rates()
    rates.record(True, 20.0 * (1 + 2 * DRAFTING_EDGE), 0.10)
    rates.record(False, 20.0, 0.10)
    assert rates.drafting_better()
    assert [rates.choose_drafting() for _ in range(EXPLORE_EVERY)].count(True) == EXPLORE_EVERY - 1


def test_a_dear_option_is_tried_again_only_as_often_as_it_is_cheap_to() -> None:
    from forerun.policy.batch_rates import EXPLORE_SHARE, Rates

    rates = Rates()
    rates.record(True, 10.0, 0.50)  # a drafting step: 0.5 s at half the rate
    rates.record(False, 20.0, 0.10)
    # A try loses 0.5 s x (1 - 10/20) = 0.25 s; at 2 % of 0.1 s steps that is one try per 125 steps.
    assert rates.explore_every(drafting_better=False) == round(0.25 / (EXPLORE_SHARE * 0.10))
    choices = [rates.choose_drafting() for _ in range(250)]
    assert choices.count(True) == 2


def test_tries_that_keep_measuring_worse_fade_out_and_one_that_wins_brings_them_back() -> None:
    from forerun.policy.batch_rates import EXPLORE_EVERY, EXPLORE_MAX, Rates

    rates = Rates()
    rates.record(True, 18.0, 0.10)
    rates.record(False, 20.0, 0.10)  # plain measures faster: a full batch
    gaps, since = [], 0
    for _ in range(12 * EXPLORE_MAX):
        since += 1
        if rates.choose_drafting():
            gaps.append(since)
            since = 0
            rates.record(True, 18.0, 0.10)  # every try measures worse again
        else:
            rates.record(False, 20.0, 0.10)
    assert gaps[:6] == [
        EXPLORE_EVERY,
        2 * EXPLORE_EVERY,
        4 * EXPLORE_EVERY,
        8 * EXPLORE_EVERY,
        16 * EXPLORE_EVERY,
        EXPLORE_MAX,
    ]
    assert set(gaps[5:]) == {EXPLORE_MAX}  # and never stop altogether
    while not rates.choose_drafting():
        rates.record(False, 20.0, 0.10)
    rates.record(True, 60.0, 0.10)  # a try wins (the batch got cheaper to draft for)
    assert rates.losses == 0 and rates.choose_drafting() is True
    rates.record(True, 60.0, 0.10)
    every = rates.explore_every(drafting_better=True)
    assert every < 2 * EXPLORE_EVERY  # the spacing starts over, priced by cost alone
    picks = [rates.choose_drafting() for _ in range(every)]
    assert picks.count(False) == 1


def test_lanes_that_step_plainly_count_as_plain_rows_in_the_batch_length() -> None:

    flat = PassCosts([0.1] * 8 + [0.2] * 8)
    sure = (0.9, 0.0, 1.0, 0.0)
    assert batch_draft_length([sure], flat, 4) == 4  # 5 rows ride on the flat part
    # Four lanes stepping plainly take four of the eight flat rows: three draft tokens still fit.
    assert batch_draft_length([sure], flat, 4, plain_lanes=4) == 3


def test_while_plain_steps_measure_faster_no_lane_is_asked_to_draft(quantized, w8a8_draft) -> None:
    # Not even asked: a lane asked would probe, or pay its draft model's catch-up, for a draft
    # the batch then caps to nothing.
    llm = LLM(quantized, speculative_model=w8a8_draft, speculative_method="auto", num_speculative_tokens=3)
    batch = BatchEngine(llm.new_engine, 2)
    for key, prompt in enumerate([[5, 6, 7], [8, 9]]):
        batch.add(key, prompt, SamplingParams(max_tokens=30))
    asked = []
    for lane in batch.lanes.values():
        choose = lane.engine.choose
        lane.engine.choose = lambda run, choose=choose: asked.append(run) or choose(run)
    bucket = batch.rates[(2).bit_length()]
    bucket.record(True, 5.0, 0.1)
    bucket.record(False, 50.0, 0.1)  # plain steps measured ten times faster
    for _ in range(4):
        batch.step()
        assert batch.last_k == 0
    assert asked == []
    assert all(
        lane.run.metrics.num_drafts == 0 and lane.run.metrics.draft_seconds == 0 for lane in batch.lanes.values()
    )


def test_while_plain_steps_measure_faster_a_long_suffix_match_still_drafts_for_free(quantized, w8a8_draft) -> None:
    llm = LLM(
        quantized,
        speculative_model=w8a8_draft,
        speculative_method="auto",
        num_speculative_tokens=3,
        speculative_options={"long_match": 3},
    )
    batch = BatchEngine(llm.new_engine, 2)
    prompt, params = [5, 6, 7], SamplingParams(max_tokens=16)
    batch.add(0, prompt, params)  # alone: its output is then remembered by its lane
    while not batch.lanes[0].run.seq.finished:
        batch.step()
    earlier = batch.remove(0).token_ids
    assert len(earlier) > 4
    bucket = batch.rates[(2).bit_length()]
    bucket.record(True, 5.0, 0.1)
    bucket.record(False, 50.0, 0.1)  # plain steps measured ten times faster
    batch.add(1, prompt, params)  # the same question again, on the same lane
    # A longer request beside it, so the batch holds two lanes on every step (one lane alone is the
    # single-request engine, whose own policy may run the draft model).
    batch.add(2, [40, 41], SamplingParams(max_tokens=64, ignore_eos=True))
    again, other = batch.lanes[1], batch.lanes[2]
    before = {key: dict(lane.engine.drafter.steps) for key, lane in batch.lanes.items()}
    while not again.run.seq.finished:
        batch.step()
    assert not other.run.seq.finished
    assert again.run.seq.output_ids == earlier
    assert again.engine.drafter.steps["suffix"] > before[1]["suffix"] and again.run.metrics.num_drafts > 0
    for key, lane in batch.lanes.items():  # the draft model never ran
        assert lane.engine.drafter.steps["draft"] == before[key]["draft"]
    assert bucket.drafting == 5.0 and bucket.plain != 50.0  # measured as plain steps


def test_every_lane_drafts_from_what_any_earlier_request_answered(quantized) -> None:
    llm = LLM(quantized, speculative_method="suffix", num_speculative_tokens=3, speculative_k_policy="fixed")
    batch = BatchEngine(llm.new_engine, 2)
    prompt, params = [5, 6, 7], SamplingParams(max_tokens=16)
    batch.add(0, prompt, params)
    batch.add(1, [40, 41], params)
    first, other = batch.lanes[0].engine, batch.lanes[1].engine
    assert first is not other and first.drafter.memory is other.drafter.memory
    while not all(lane.run.seq.finished for lane in batch.lanes.values()):
        batch.step()
    answer = batch.remove(0).token_ids
    assert answer in other.drafter.memory.outputs
    # The same question on the other lane: it drafts the whole answer from the shared memory.
    batch.remove(1)
    batch.idle.remove(other)
    batch.idle.append(other)  # the next request runs on the lane that never saw it
    batch.add(2, prompt, params)
    assert batch.lanes[2].engine is other
    while not batch.lanes[2].run.seq.finished:
        batch.step()
    again = batch.remove(2)
    fresh = LLM(quantized, speculative_method="suffix", num_speculative_tokens=3, speculative_k_policy="fixed")
    alone = fresh.engine.generate(prompt, params)  # a memory without the answer: drafts from the prompt alone
    assert again.token_ids == alone.token_ids == answer
    assert again.metrics.num_accepted_tokens == again.metrics.num_draft_tokens
    assert again.metrics.num_target_forwards < alone.metrics.num_target_forwards
