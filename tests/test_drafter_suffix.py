"""Suffix drafting on hand-made contexts: the longest match, the most frequent continuation, a
two-branch tree, nothing without a match, earlier outputs remembered, a rebuilt index for a new
text, proposal sizes within max_rows, the combining method, and clear errors for bad settings."""
from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forerun import drafters
from forerun.config import SamplingParams
from forerun.drafters.suffix import SuffixDrafter, SuffixTrie
from forerun.errors import ForerunError
from forerun.testing import tiny_model

GREEDY = SamplingParams()


def propose(context: list[int], k: int = 4, **options):
    drafter = SuffixDrafter(None, **options)
    drafter.start(context, None, 0)
    return drafter.propose_with_match(context, k, GREEDY, None)


def test_the_longest_match_wins() -> None:
    # [7, 1, 2] occurred once (-> 3); the shorter [1, 2] occurred after it with 5 more often.
    context = [7, 1, 2, 3, 0, 1, 2, 5, 0, 1, 2, 5, 0, 7, 1, 2]
    tree, length = propose(context, 1, branch_ratio=2.0)
    assert tree.tokens == [3] and length == 3


def test_the_most_frequent_continuation_wins_over_the_most_recent() -> None:
    # After [1, 2]: 5 three times, then 6 once (the latest).
    context = [1, 2, 5, 0, 1, 2, 5, 0, 1, 2, 5, 0, 1, 2, 6, 0, 4, 1, 2]
    tree, length = propose(context, 2, branch_ratio=2.0, min_match=2)
    assert tree.tokens == [5, 0] and tree.is_chain and length == 2


def test_the_most_recent_wins_a_tie() -> None:
    context = [1, 2, 5, 0, 1, 2, 6, 0, 1, 2]
    tree, _ = propose(context, 1, branch_ratio=2.0)
    assert tree.tokens == [6]


def test_two_likely_continuations_make_a_two_branch_tree() -> None:
    # After [8, 1, 2]: 3 4 twice, 5 6 once; with branch_ratio 0.5 the runner-up gets its own branch.
    context = [20, 8, 1, 2, 3, 4, 21, 8, 1, 2, 5, 6, 22, 8, 1, 2, 3, 4, 23, 8, 1, 2]
    tree, length = propose(context, 2, branch_ratio=0.5)
    assert length == 3
    assert tree.tokens == [3, 4, 5, 6] and tree.parents == [-1, 0, -1, 2]
    # A stricter ratio keeps it one chain.
    tree, _ = propose(context, 2, branch_ratio=0.9)
    assert tree.tokens == [3, 4] and tree.is_chain


def test_a_branch_deeper_in_the_walk_shares_the_prefix() -> None:
    # After [9, 9]: always 1, then 2 or 3 once each (3 the more recent, so first).
    context = [20, 9, 9, 1, 2, 21, 9, 9, 1, 3, 22, 9, 9]
    tree, _ = propose(context, 2, branch_ratio=0.5, min_prob=0.0)
    assert tree.tokens == [1, 3, 2] and tree.parents == [-1, 0, 0]


@pytest.mark.parametrize("context", [[1, 2, 3, 4], [8], [1, 2, 3, 1]])
def test_nothing_without_a_match(context) -> None:
    tree, length = propose(context, min_match=2)
    assert tree is None and length == 0


def test_the_walk_stops_where_the_continuation_becomes_unlikely() -> None:
    # After [1, 2]: 3, then one of four different tokens: a 1/4 share is below min_prob 0.3.
    context = [20, 1, 2, 3, 4, 21, 1, 2, 3, 5, 22, 1, 2, 3, 6, 23, 1, 2, 3, 7, 24, 1, 2]
    tree, _ = propose(context, 3, min_prob=0.3, branch_ratio=2.0)
    assert tree.tokens == [3]


def test_earlier_outputs_are_remembered() -> None:
    drafter = SuffixDrafter(None)
    prompt = [40, 41]
    drafter.start(prompt, None, 0)
    output = [10, 11, 12, 13, 14, 15]
    drafter.propose(prompt + output, 2, GREEDY, None)      # the engine's last call saw the output
    drafter.start([50, 51, 10, 11], None, 0)               # a new request whose prompt ends like it
    tree, length = drafter.propose_with_match([50, 51, 10, 11], 3, GREEDY, None)
    assert tree.tokens == [12, 13, 14] and length == 2
    # the earlier prompt is not remembered, only the output
    drafter.start([7, 40], None, 0)
    assert drafter.propose([7, 40], 2, GREEDY, None) is None


def test_the_remembered_outputs_are_bounded() -> None:
    drafter = SuffixDrafter(None, max_global_tokens=100)
    for i in range(30):
        drafter.start([1000 + i], None, 0)
        drafter.propose([1000 + i] + list(range(i * 10, i * 10 + 10)), 1, GREEDY, None)
    drafter.start([5000], None, 0)
    assert sum(map(len, drafter.outputs)) <= 100
    assert drafter.global_trie.size <= 100
    drafter.start([5001, 288], None, 0)                    # the latest output (280..289) is still there
    assert drafter.propose([5001, 288], 1, GREEDY, None) is None   # min_match 2: one token is too short
    assert drafter.propose([5001, 287, 288], 1, GREEDY, None).tokens == [289]


def test_a_context_that_does_not_continue_rebuilds_the_index() -> None:
    drafter = SuffixDrafter(None)
    drafter.start([1, 2, 3, 1, 2], None, 0)
    assert drafter.propose([1, 2, 3, 1, 2], 1, GREEDY, None).tokens == [3]
    assert drafter.propose([4, 5, 6, 4, 5], 1, GREEDY, None).tokens == [6]
    assert drafter.local.walk([1, 2, 3]) is None


def naive_counts(texts: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for text in texts:
        for i in range(len(text)):
            for n in range(1, depth + 1):
                if i + n <= len(text):
                    gram = tuple(text[i:i + n])
                    counts[gram] = counts.get(gram, 0) + 1
    return counts


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=3), st.integers(1, 5))
def test_the_trie_counts_every_substring_up_to_its_depth(texts, depth) -> None:
    trie = SuffixTrie(depth)
    for text in texts:
        trie.begin_text()
        for t in text:
            trie.append(t)
    for gram, count in naive_counts(texts, depth).items():
        node = trie.walk(list(gram))
        assert node is not None and trie.count[node] == count
    assert len(trie.count) - 1 == len(naive_counts(texts, depth))      # nothing else is in it


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 8), st.floats(0.0, 1.0))
def test_every_proposal_fits_max_rows_and_its_tree_is_well_formed(context, k, ratio) -> None:
    drafter = SuffixDrafter(None, branch_ratio=ratio, min_prob=0.0)
    drafter.start(context, None, 0)
    tree, length = drafter.propose_with_match(context, k, GREEDY, None)
    if tree is None:
        assert length == 0
        return
    assert 1 <= len(tree) <= drafter.max_rows(k) and max(tree.depths) <= k
    assert len(tree.children(-1)) <= 2 and drafter.min_match <= length <= drafter.max_match
    assert context[-length:] in [context[i:i + length] for i in range(len(context) - length)]


def test_proposing_on_a_long_context_costs_microseconds() -> None:
    rng = random.Random(0)
    context = [rng.randrange(50) for _ in range(4000)]
    drafter = SuffixDrafter(None)
    drafter.start(context, None, 0)
    drafter.propose(context, 5, GREEDY, None)
    begin = time.perf_counter()
    for _ in range(1000):
        context.append(rng.randrange(50))
        drafter.propose(context, 5, GREEDY, None)
    per_call = (time.perf_counter() - begin) / 1000
    assert per_call < 1e-3, f"{per_call * 1e6:.0f} us per proposal"


@pytest.mark.parametrize("options, flag", [
    ({"min_match": 0}, "--suffix-min-match"),
    ({"max_match": 2, "min_match": 3}, "--suffix-max-match"),
    ({"min_prob": 1.5}, "--suffix-min-prob"),
])
def test_bad_settings_name_the_flag(options, flag) -> None:
    with pytest.raises(ForerunError, match=flag):
        drafters.create("suffix", tiny_model(0), options)


# --- auto: the suffix draft on long matches, else the draft model -----------------------------------


def test_auto_takes_the_suffix_draft_on_a_long_match_and_the_draft_model_elsewhere() -> None:
    target = tiny_model(0, name="auto-target")
    auto = drafters.create("auto", target, {"model": target, "long_match": 4})
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7, 8]      # ends with a 4-token repeat
    auto.start(prompt, None, 64)
    tree = auto.propose(prompt, 3, GREEDY, None)
    assert tree.tokens == [9, 10, 11] and auto.steps == {"suffix": 1, "draft": 0}
    other = [3, 4, 5, 6, 7, 8, 20, 21, 7, 8]                       # only a 2-token repeat
    auto.start(other, None, 64)
    tree = auto.propose(other, 3, GREEDY, None)
    assert max(tree.depths) == 3 and auto.steps == {"suffix": 1, "draft": 1}   # (with second-choice leaves)


def test_auto_keeps_the_suffix_guess_while_the_draft_models_catch_up_is_declined() -> None:
    target = tiny_model(0, name="auto-target")
    auto = drafters.create("auto", target, {"model": target, "long_match": 8})
    asked: list[tuple[float, float | None, float]] = []
    auto.set_gate(lambda seconds, token_cost, alpha: asked.append((seconds, token_cost, alpha)) or False)
    prompt = list(range(30, 50)) + [3, 4, 5, 6, 1, 2, 3, 4]    # a 20-token catch-up, a short match
    auto.start(prompt, None, 64)
    tree = auto.propose(prompt, 3, GREEDY, None)
    assert tree.tokens[:2] == [5, 6] and auto.steps == {"suffix": 1, "draft": 0}
    (seconds, token_cost, alpha), = asked
    assert seconds > 0 and token_cost > 0                        # timed when the gate was set
    assert alpha == pytest.approx(0.8)                           # no verdict yet: the draft model's prior
    auto.set_gate(lambda seconds, token_cost, alpha: True)
    tree = auto.propose(prompt, 3, GREEDY, None)
    assert max(tree.depths) == 3 and auto.steps == {"suffix": 1, "draft": 1}   # (with second-choice leaves)


def test_a_catch_up_the_gate_paid_for_waits_through_plain_steps_until_it_is_made() -> None:
    # A batch's load may turn a step the gate admitted into a plain one: the admission stands
    # until a proposal makes the catch-up, and the gate is not asked (and charged) again meanwhile.
    target = tiny_model(0, name="auto-target")
    auto = drafters.create("auto", target, {"model": target, "long_match": 8})
    answers = iter([True])
    asked = []
    auto.set_gate(lambda seconds, token_cost, alpha: asked.append(seconds) or next(answers, False))
    prompt = list(range(30, 50)) + [3, 4, 5, 6, 1, 2, 3, 4]
    auto.start(prompt, None, 64)
    assert auto.next_source(prompt) == "draft"                  # admitted; then the step goes plain
    assert auto.next_source(prompt + [7]) == "draft"            # still admitted, not asked again
    assert len(asked) == 1
    tree = auto.propose(prompt + [7], 3, GREEDY, None)
    assert max(tree.depths) == 3 and auto.steps == {"suffix": 0, "draft": 1}
    auto.start(prompt, None, 64)                                 # a new request asks afresh
    assert auto.next_source(prompt) == "suffix" and len(asked) == 2
