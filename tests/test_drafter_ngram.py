"""Prompt lookup: the right continuation on hand-made contexts, nothing without a match, an index
kept incrementally (same answers as a rescan, at microsecond cost), and clear errors for bad flags."""

from __future__ import annotations

import random
import time

import pytest

from forerun import drafters
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters.ngram import NgramDrafter
from forerun.models.testing import tiny_model

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=1.0)


def first_branch(tree) -> list[int]:
    """The tokens down the first child at every level: the latest occurrence's continuation."""
    path = [tree.children(-1)[0]]
    while tree.children(path[-1]):
        path.append(tree.children(path[-1])[0])
    return [tree.tokens[i] for i in path]


def propose(context: list[int], k: int = 4, ngram_max: int = 3, ngram_min: int = 1) -> list[int] | None:
    drafter = NgramDrafter(None, ngram_max=ngram_max, ngram_min=ngram_min)
    drafter.start(context, None, 0)
    tree = drafter.propose(context, k, GREEDY, None)
    return None if tree is None else first_branch(tree)


@pytest.mark.parametrize(
    "context, k, expected",
    [
        # the suffix [1, 2] appeared at the start, followed by 3 4
        ([1, 2, 3, 4, 9, 1, 2], 2, [3, 4]),
        # the longest suffix wins: [5, 1, 2] matched at the start (-> 7) beats the later [1, 2] (-> 8)
        ([5, 1, 2, 7, 6, 1, 2, 8, 5, 1, 2], 1, [7]),
        # among equally long matches the most recent wins
        ([1, 2, 9, 1, 2, 8, 1, 2], 1, [8]),
        # the continuation runs into the context's end and on into the proposal itself: a loop repeats
        ([7, 3, 7], 4, [3, 7, 3, 7]),
        ([4, 4], 3, [4, 4, 4]),
        # k caps the draft
        ([1, 2, 3, 4, 5, 6, 1], 3, [2, 3, 4]),
    ],
)
def test_proposes_what_followed_the_longest_most_recent_match(context, k, expected) -> None:
    assert propose(context, k) == expected


@pytest.mark.parametrize("context", [[1, 2, 3, 4], [8]])
def test_proposes_nothing_without_a_match(context) -> None:
    assert propose(context) is None


def test_ngram_min_ignores_shorter_matches() -> None:
    assert propose([1, 2, 3, 1], ngram_min=1) == [2, 3, 1, 2]
    assert propose([1, 2, 3, 1], ngram_min=2) is None
    assert propose([1, 2, 3, 9, 2, 3], ngram_min=2, k=1) == [9]


def test_ngram_max_caps_the_match_length() -> None:
    # [5, 1, 2] would win with max 3; with max 2 the most recent [1, 2] does.
    assert propose([5, 1, 2, 7, 6, 1, 2, 8, 5, 1, 2], k=1, ngram_max=2) == [8]


def test_the_draft_is_one_hot_so_sampling_uses_the_exact_deterministic_rule() -> None:
    drafter = NgramDrafter(None)
    drafter.start([1, 2, 1], None, 0)
    tree = drafter.propose([1, 2, 1], 2, SAMPLED, None)
    assert tree.tokens == [2, 1] and tree.probs is None and tree.is_chain


def test_the_earliest_continuation_is_a_second_branch_when_it_differs() -> None:
    drafter = NgramDrafter(None)
    context = [5, 1, 2, 9, 5, 1, 2, 8, 5, 1, 2]  # [5, 1, 2] was followed by 9 5 first, by 8 5 lately
    drafter.start(context, None, 0)
    tree = drafter.propose(context, 2, GREEDY, None)
    assert tree.tokens == [8, 5, 9, 5] and tree.parents == [-1, 0, -1, 2]
    assert drafter.max_rows(2) == 4
    # a shared prefix is proposed once
    context = [9, 3, 4, 5, 6, 9, 3, 4, 5, 7, 9, 3, 4]
    drafter.start(context, None, 0)
    tree = drafter.propose(context, 2, GREEDY, None)
    assert tree.tokens == [5, 7, 6] and tree.parents == [-1, 0, 0]


def test_one_chain_when_earliest_and_latest_agree() -> None:
    drafter = NgramDrafter(None)
    context = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    drafter.start(context, None, 0)
    tree = drafter.propose(context, 3, GREEDY, None)
    assert tree.is_chain and tree.tokens == [3, 0, 1]


def rescan(context: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The obvious quadratic reference: scan the whole context for every suffix length."""
    for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
        suffix = context[len(context) - n :]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                follow = start + n
                draft = []
                for i in range(k):
                    at = follow + i
                    draft.append(context[at] if at < len(context) else draft[at - len(context)])
                return draft
    return []


@pytest.mark.parametrize("seed", range(5))
def test_the_incremental_index_answers_as_a_full_rescan_would(seed) -> None:
    rng = random.Random(seed)
    n_max, n_min = rng.choice([(3, 1), (2, 2), (4, 2), (1, 1)])
    drafter = NgramDrafter(None, ngram_max=n_max, ngram_min=n_min)
    context = [rng.randrange(4) for _ in range(5)]
    drafter.start(context, None, 0)
    for _ in range(60):
        k = rng.randrange(1, 6)
        tree = drafter.propose(context, k, GREEDY, None)
        assert (first_branch(tree) if tree else []) == rescan(context, k, n_max, n_min)
        assert tree is None or len(tree) <= drafter.max_rows(k)
        context = context + [rng.randrange(4) for _ in range(rng.randrange(1, 4))]  # accepted + bonus


def test_a_new_request_starts_a_fresh_index() -> None:
    drafter = NgramDrafter(None)
    drafter.start([1, 2, 3, 1], None, 0)
    assert drafter.propose([1, 2, 3, 1], 2, GREEDY, None).tokens == [2, 3]
    drafter.start([5, 6], None, 0)
    assert drafter.propose([5, 6], 2, GREEDY, None) is None


def test_proposing_on_a_long_context_costs_microseconds_not_a_rescan() -> None:
    rng = random.Random(0)
    context = [rng.randrange(50) for _ in range(20_000)]
    drafter = NgramDrafter(None)
    drafter.start(context, None, 0)
    drafter.propose(context, 5, GREEDY, None)  # indexes the prompt once
    begin = time.perf_counter()
    for _ in range(2000):
        context.append(rng.randrange(50))
        drafter.propose(context, 5, GREEDY, None)
    per_call = (time.perf_counter() - begin) / 2000
    # A rescan of 20k tokens per call takes milliseconds; the index takes tens of microseconds.
    assert per_call < 0.5e-3, f"{per_call * 1e6:.0f} us per proposal"


@pytest.mark.parametrize(
    "options, flag",
    [
        ({"ngram_min": 0}, "--ngram-min"),
        ({"ngram_max": 1, "ngram_min": 2}, "--ngram-max"),
    ],
)
def test_bad_settings_name_the_flag(options, flag) -> None:
    with pytest.raises(ForerunError, match=flag):
        drafters.create("ngram", tiny_model(0), options)
