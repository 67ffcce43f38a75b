"""Suffix drafting on hand-made contexts: the longest match, the most frequent continuation, a
two-branch tree, nothing without a match, earlier outputs remembered, a rebuilt index for a new
text, proposal sizes within max_rows, the combining method, and clear errors for bad settings."""

from __future__ import annotations

import pytest

from forerun import drafters
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters.passes import run_alone
from forerun.drafters.suffix import SuffixDrafter, SuffixMemory
from forerun.models.testing import tiny_model

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
    drafter.propose(prompt + output, 2, GREEDY, None)
    drafter.end(output)  # the engine tells it the request's output
    drafter.start([50, 51, 10, 11], None, 0)  # a new request whose prompt ends like it
    tree, length = drafter.propose_with_match([50, 51, 10, 11], 3, GREEDY, None)
    assert tree.tokens == [12, 13, 14] and length == 2
    # the earlier prompt is not remembered, only the output
    drafter.start([7, 40], None, 0)
    assert drafter.propose([7, 40], 2, GREEDY, None) is None


def test_an_output_not_ended_is_not_remembered() -> None:
    drafter = SuffixDrafter(None)
    drafter.start([40, 41], None, 0)
    drafter.propose([40, 41, 10, 11, 12, 13], 2, GREEDY, None)
    drafter.start([50, 51, 10, 11], None, 0)
    assert drafter.propose([50, 51, 10, 11], 3, GREEDY, None) is None


def test_the_remembered_outputs_are_bounded() -> None:
    drafter = SuffixDrafter(None, max_global_tokens=100)
    for i in range(30):
        drafter.start([1000 + i], None, 0)
        drafter.end(list(range(i * 10, i * 10 + 10)))
    drafter.start([5000], None, 0)
    assert sum(map(len, drafter.memory.outputs)) <= 100
    assert drafter.memory.trie.size <= 100
    drafter.start([5001, 288], None, 0)  # the latest output (280..289) is still there
    assert drafter.propose([5001, 288], 1, GREEDY, None) is None  # min_match 2: one token is too short
    assert drafter.propose([5001, 287, 288], 1, GREEDY, None).tokens == [289]
    assert drafter.propose([5001, 17, 18], 1, GREEDY, None) is None  # an early one (10..19) is gone


def test_drafters_sharing_a_memory_draft_from_each_others_outputs() -> None:
    memory = SuffixMemory(depth=16, max_tokens=1000)
    first, second = SuffixDrafter(None, memory=memory), SuffixDrafter(None, memory=memory)
    alone = SuffixDrafter(None)
    for drafter in (first, second, alone):
        drafter.start([40, 41], None, 0)
    first.end([10, 11, 12, 13, 14])
    for drafter in (second, alone):
        drafter.start([50, 10, 11], None, 0)
    assert second.propose([50, 10, 11], 3, GREEDY, None).tokens == [12, 13, 14]
    assert alone.propose([50, 10, 11], 3, GREEDY, None) is None  # a memory of its own: nothing


def test_a_shared_memory_of_another_depth_is_refused() -> None:
    with pytest.raises(ForerunError, match="depth 8"):
        SuffixDrafter(None, depth=16, memory=SuffixMemory(depth=8, max_tokens=100))


# --- auto: the suffix draft on long matches, else the draft model -----------------------------------


def test_auto_takes_the_suffix_draft_on_a_long_match_and_the_draft_model_elsewhere() -> None:
    target = tiny_model(0, name="auto-target")
    auto = drafters.create("auto", target, {"model": target, "long_match": 4})
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7, 8]  # ends with a 4-token repeat
    auto.start(prompt, None, 64)
    tree = auto.propose(prompt, 3, GREEDY, None)
    assert tree.tokens == [9, 10, 11] and auto.steps == {"suffix": 1, "draft": 0}
    other = [3, 4, 5, 6, 7, 8, 20, 21, 7, 8]  # only a 2-token repeat
    auto.start(other, None, 64)
    tree = auto.propose(other, 3, GREEDY, None)
    assert max(tree.depths) == 3 and auto.steps == {"suffix": 1, "draft": 1}  # (with second-choice leaves)


def test_auto_keeps_the_suffix_guess_while_the_draft_models_catch_up_is_declined() -> None:
    target = tiny_model(0, name="auto-target")
    auto = drafters.create("auto", target, {"model": target, "long_match": 8})
    asked: list[tuple[float, float | None, float]] = []
    auto.set_gate(lambda seconds, token_cost, alpha, *_: asked.append((seconds, token_cost, alpha)) or False)
    prompt = list(range(30, 50)) + [3, 4, 5, 6, 1, 2, 3, 4]  # a 20-token catch-up, a short match
    auto.start(prompt, None, 64)
    tree = auto.propose(prompt, 3, GREEDY, None)
    assert tree.tokens[:2] == [5, 6] and auto.steps == {"suffix": 1, "draft": 0}
    ((seconds, token_cost, alpha),) = asked
    assert seconds > 0 and token_cost > 0  # timed when the gate was set
    assert alpha == pytest.approx(0.8)  # no verdict yet: the draft model's prior
    auto.set_gate(lambda seconds, token_cost, alpha, remaining, emitted: True)
    tree = auto.propose(prompt, 3, GREEDY, None)
    assert max(tree.depths) == 3 and auto.steps == {"suffix": 1, "draft": 1}  # (with second-choice leaves)


def test_a_catch_up_the_gate_paid_for_waits_through_plain_steps_until_it_is_made() -> None:
    # A batch's load may turn a step the gate admitted into a plain one: the admission stands
    # until a proposal makes the catch-up, and the gate is not asked (and charged) again meanwhile.
    target = tiny_model(0, name="auto-target")
    auto = drafters.create("auto", target, {"model": target, "long_match": 8})
    answers = iter([True])
    asked = []
    auto.set_gate(lambda seconds, token_cost, alpha, remaining, emitted: asked.append(seconds) or next(answers, False))
    prompt = list(range(30, 50)) + [3, 4, 5, 6, 1, 2, 3, 4]
    auto.start(prompt, None, 64)
    assert auto.next_source(prompt, GREEDY) == "draft"  # admitted; then the step goes plain
    assert auto.next_source(prompt + [7], GREEDY) == "draft"  # still admitted, not asked again
    assert len(asked) == 1
    tree = run_alone(auto.propose_steps(prompt + [7], 3, GREEDY, None, source="draft"))
    assert max(tree.depths) == 3 and auto.steps == {"suffix": 0, "draft": 1}
    auto.start(prompt, None, 64)  # a new request asks afresh
    assert auto.next_source(prompt, GREEDY) == "suffix" and len(asked) == 2


def test_a_match_longer_than_the_trie_is_deep_names_the_longest_allowed() -> None:
    with pytest.raises(ForerunError, match=r"--suffix-max-match 16 is too long .* depth of 16: use at most 15"):
        SuffixDrafter(None, max_match=16, depth=16)
    assert SuffixDrafter(None, max_match=15, depth=16).max_match == 15
