"""Draft forwards shared across sequences (drafters/passes.py): one forward for every lane's pass,
each lane getting exactly what its pass gets alone (w8a8 rows are independent), fewer forwards for
the batch, and one lane's failure its own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.drafters.passes import DraftPass, forward, run_alone, run_passes
from forerun.engine.batch import BatchEngine
from forerun.models.testing import tiny_model
from forerun.models.w8a8 import quantize_decoder_
from forerun.policy.draft_length import batch_draft_length

SLOW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
GREEDY = SamplingParams(max_tokens=40)


@pytest.fixture(scope="module")
def target():
    model = tiny_model(seed=1, name="target3", num_layers=3)
    quantize_decoder_(model.decoder)
    return model


@pytest.fixture(scope="module")
def draft(target):
    from tests.conftest import perturbed

    model = perturbed(tiny_model(seed=1, name="draft3", num_layers=3), 0.3)
    quantize_decoder_(model.decoder)
    return model


def filled_cache(decoder, prefix: list[int], room: int):
    cache = decoder.new_cache(len(prefix) + room)
    decoder(torch.tensor(prefix), torch.arange(len(prefix)), cache)
    return cache


@SLOW
@given(data=st.data(), count=st.integers(2, 6))
def test_a_shared_forward_gives_every_pass_its_logits_alone(draft, data, count: int) -> None:
    decoder = draft.decoder
    alone, shared = [], []
    for _ in range(count):
        prefix = data.draw(st.lists(st.integers(0, 98), min_size=1, max_size=60))
        tokens = data.draw(st.lists(st.integers(0, 98), min_size=1, max_size=5))
        for passes in (alone, shared):
            passes.append(DraftPass(decoder, filled_cache(decoder, prefix, len(tokens)), tokens, len(prefix)))
    got = forward(shared)
    for i, (p, logits) in enumerate(zip(alone, got)):
        want = forward([p])[0]
        assert torch.equal(logits, want), f"pass {i} of {count}"
        q = shared[i]
        assert q.cache.length == p.cache.length == p.start + len(p.tokens)
        assert torch.equal(q.cache.k[:, :, :, : q.cache.length], p.cache.k[:, :, :, : p.cache.length])
    assert all(q.passes == count and q.rows == sum(len(p.tokens) for p in shared) for q in shared)
    assert [q.lead for q in shared] == [True] + [False] * (count - 1)


def proposer(target, draft, prompt: list[int], **options) -> tuple[DraftModelDrafter, list[int]]:
    drafter = DraftModelDrafter(target, draft, **options)
    drafter.start(prompt, None, len(prompt) + 16)
    return drafter, prompt


PROMPTS = [[5, 6, 7, 5, 6], [9], [1, 2, 3, 4, 1, 2, 3, 4, 1], [40, 41, 42], [7] * 20]


@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_proposals_made_together_equal_proposals_made_alone(target, draft, draft_vocab) -> None:
    sampled = SamplingParams(temperature=1.0, max_tokens=8)
    for params in (GREEDY, sampled):
        alone = [proposer(target, draft, p, draft_vocab=draft_vocab) for p in PROMPTS]
        together = [proposer(target, draft, p, draft_vocab=draft_vocab) for p in PROMPTS]
        want = [d.propose(p, 4, params, torch.Generator().manual_seed(i)) for i, (d, p) in enumerate(alone)]
        got = run_passes(
            [d.propose_steps(p, 4, params, torch.Generator().manual_seed(i)) for i, (d, p) in enumerate(together)]
        )
        for w, g in zip(want, got):
            assert g.tokens == w.tokens and g.parents == w.parents
            if not params.greedy:
                assert torch.equal(g.probs, w.probs)


def test_one_proposal_that_fails_leaves_the_others_their_drafts(target, draft) -> None:
    good = [proposer(target, draft, p) for p in PROMPTS[:2]]

    def raising():
        yield DraftPass(draft.decoder, filled_cache(draft.decoder, [1, 2], 4), [3], 2)
        raise RuntimeError("drafter broke")

    def out_of_vocabulary():  # its forward cannot run
        yield DraftPass(draft.decoder, filled_cache(draft.decoder, [1, 2], 4), [3, 10**6], 2)
        return "unreachable"

    steps = [
        good[0][0].propose_steps(PROMPTS[0], 3, GREEDY, None),
        raising(),
        out_of_vocabulary(),
        good[1][0].propose_steps(PROMPTS[1], 3, GREEDY, None),
    ]
    got = run_passes(steps)
    assert isinstance(got[1], RuntimeError) and str(got[1]) == "drafter broke"
    assert isinstance(got[2], IndexError)
    want = [proposer(target, draft, p)[0].propose(p, 3, GREEDY, None) for p in PROMPTS[:2]]
    assert got[0].tokens == want[0].tokens and got[3].tokens == want[1].tokens
    with pytest.raises(RuntimeError, match="drafter broke"):
        run_alone(raising())


class CountingForwards:
    """Counts a decoder's forwards (patched onto its instance)."""

    def __init__(self, decoder) -> None:
        self.calls = 0
        self.inner = decoder.forward
        decoder.forward = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("method", ["draft", "auto"])
def test_lanes_drafting_together_share_each_draft_forward(target, draft, method) -> None:
    options = {"long_match": 99} if method == "auto" else {}  # auto: the draft model every step
    llm = LLM(
        target,
        speculative_model=draft,
        speculative_method=method,
        num_speculative_tokens=3,
        speculative_k_policy="fixed",
        speculative_options=options,
    )
    batch = BatchEngine(llm.new_engine, 4)
    prompts = [[11, 12, 13], [21, 22], [31, 32, 33, 34], [41]]
    for key, prompt in enumerate(prompts):
        batch.add(key, prompt, GREEDY)
    decoder = draft.decoder
    counter = CountingForwards(decoder)
    try:
        for _ in range(3):
            results = batch.step()
            assert all(r.error is None for r in results.values())
    finally:
        del decoder.forward  # the class's forward again
    # Four lanes drafting three tokens a step: three shared forwards a step, not twelve.
    assert counter.calls == 9


def test_shared_draft_forwards_let_a_batch_draft_where_one_after_another_would_not() -> None:
    def flat(rows: int) -> float:  # the target: rows free up to 16
        return 0.1 * max(1, rows / 16)

    one_after_another = [(0.8, 0.05, 1.0, 0.0)] * 4
    assert batch_draft_length(one_after_another, flat, 4) == 0
    shared = [(0.8, 0.0, 1.0, 0.0)] * 4
    assert batch_draft_length(shared, flat, 4, draft_pass=0.05) >= 2
    assert batch_draft_length(shared, flat, 4, draft_pass=0.5) == 0  # a dear shared forward: none


@SLOW
@given(data=st.data())
def test_a_branch_rides_along_exactly_and_leaves_only_the_chain_in_the_cache(draft, data) -> None:
    # A branch forks from the cache at `fork`: its rows must come out as the branch's own path fed
    # after the first `fork` tokens, the chain's as the chain alone, alone or beside another pass.
    decoder = draft.decoder
    prefix = data.draw(st.lists(st.integers(0, 98), min_size=2, max_size=60))
    tokens = data.draw(st.lists(st.integers(0, 98), min_size=1, max_size=3))
    branch = data.draw(st.lists(st.integers(0, 98), min_size=1, max_size=4))
    fork = data.draw(st.integers(1, len(prefix)))
    chain_alone = DraftPass(decoder, filled_cache(decoder, prefix, len(tokens)), tokens, len(prefix))
    want_chain = forward([chain_alone])[0]
    forked = filled_cache(decoder, prefix, len(branch))
    forked.truncate(fork)
    want_branch = forward([DraftPass(decoder, forked, branch, fork)])[0]
    for beside in ([], [DraftPass(decoder, filled_cache(decoder, [3, 4], 1), [5], 2)]):
        cache = filled_cache(decoder, prefix, len(tokens) + len(branch))
        p = DraftPass(decoder, cache, tokens, len(prefix), branch=branch, fork=fork)
        got = forward(beside + [p])[-1]  # [2, N]
        assert torch.equal(got[0:1], want_chain) and torch.equal(got[1:2], want_branch), f"{len(beside)} beside"
        assert cache.length == chain_alone.cache.length == len(prefix) + len(tokens)
        assert torch.equal(cache.k[:, :, :, : cache.length], chain_alone.cache.k[:, :, :, : cache.length])
        assert p.rows == len(tokens) + len(branch) + (1 if beside else 0)


def test_a_draft_pass_starts_where_its_cache_ends(draft) -> None:
    # A pass's rows go at its cache's next slots; one that says otherwise is turned away, not run
    # at the wrong positions.
    cache = filled_cache(draft.decoder, [3, 4, 5], 8)
    with pytest.raises(ValueError, match=r"starts at its cache's length \(3\), not at 2"):
        DraftPass(draft.decoder, cache, [6], 2)
    assert forward([DraftPass(draft.decoder, cache, [6], 3)])[0].shape[0] == 1 and cache.length == 4
