"""Lookahead decoding: the window's attention mask against a hand-built one, aux rows that compute
exactly the sequences they stand for without disturbing the draft nodes, the Jacobi window and the
n-gram pool, and a cache sized for the extra rows."""

from __future__ import annotations

import pytest
import torch

from forerun import drafters
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters.lookahead import (
    LookaheadDrafter,
    NgramPool,
    window_mask,
    window_offsets,
)
from forerun.engine.engine import Engine
from forerun.models.load import LoadedModel
from forerun.models.testing import tiny_model
from forerun.verification.sampling import probabilities
from forerun.verification.tree import DraftTree
from forerun.verification.verify import verify


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_model(0, name="target", num_layers=2)


def b(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row.replace(" ", "")] for row in rows])


def test_window_mask_matches_the_hand_built_one() -> None:
    # W = 3, two levels. Columns: root | level 0: a0 a1 a2 | level 1: b0 b1 b2.
    # Row (l, c) sees the root, level 0 up to column c, and column c of levels 1..l.
    assert torch.equal(
        window_mask(2, 3),
        b(
            [
                "1 100 000",  # a0
                "1 110 000",  # a1
                "1 111 000",  # a2
                "1 100 100",  # b0: root a0 b0
                "1 110 010",  # b1: root a0 a1 b1
                "1 111 001",  # b2: root a0 a1 a2 b2
            ]
        ),
    )
    assert window_offsets(2, 3) == [1, 2, 3, 2, 3, 4]


def test_full_verifier_mask_with_draft_nodes_and_window_matches_the_hand_built_one() -> None:
    # Two cached slots; nodes x (child of root), y (child of x), z (child of root); window W=2, 2 levels.
    trie = DraftTree.trie([[10, 11], [12]])
    assert (trie.tokens, trie.parents) == ([10, 11, 12], [-1, 0, -1])
    tree = DraftTree(
        trie.tokens,
        trie.parents,
        aux_tokens=[20, 21, 30, 31],
        aux_offsets=window_offsets(2, 2),
        aux_mask=window_mask(2, 2),
    )
    # columns: cache cache | root | x y z | a0 a1 b0 b1
    assert torch.equal(
        tree.attention_mask(2),
        b(
            [
                "11 1 000 0000",  # root
                "11 1 100 0000",  # x
                "11 1 110 0000",  # y
                "11 1 001 0000",  # z
                "11 1 000 1000",  # a0
                "11 1 000 1100",  # a1
                "11 1 000 1010",  # b0
                "11 1 000 1101",  # b1
            ]
        ),
    )
    assert tree.positions(7).tolist() == [7, 8, 9, 8, 8, 9, 9, 10]
    assert tree.num_rows == 8 and len(tree) == 3 and tree.needs_mask


def test_a_chain_with_aux_rows_still_gets_an_explicit_mask() -> None:
    tree = DraftTree([4, 5], [-1, 0], aux_tokens=[6], aux_offsets=[1], aux_mask=window_mask(1, 1))
    assert tree.is_chain and tree.needs_mask
    assert not DraftTree.chain([4, 5]).needs_mask


def test_aux_rows_compute_the_sequences_they_stand_for_and_leave_the_nodes_alone(target) -> None:
    decoder = target.decoder
    params = SamplingParams(temperature=1.0)
    context, root, width = [5, 6, 7, 8, 9], 10, 3
    levels = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    trie = DraftTree.trie([[40, 41], [40, 42], [43]])
    tree = DraftTree(
        trie.tokens,
        trie.parents,
        aux_tokens=[t for level in levels for t in level],
        aux_offsets=window_offsets(3, width),
        aux_mask=window_mask(3, width),
    )

    def last_logits(seq: list[int]) -> torch.Tensor:
        cache = decoder.new_cache(len(seq))
        return decoder(torch.tensor(seq), torch.arange(len(seq)), cache, last_only=True).logits[0, -1]

    def run(t: DraftTree):
        cache = decoder.new_cache(64)
        decoder(torch.tensor(context), torch.arange(len(context)), cache)
        return verify(decoder, cache, root, t, params)

    ver = run(tree)
    assert ver.probs.shape[0] == 5 and ver.hidden.shape[0] == 5 and ver.aux_logits.shape[0] == 9
    for level in range(3):
        for col in range(width):
            seq = context + [root] + levels[0][: col + 1] + [levels[u][col] for u in range(1, level + 1)]
            assert torch.allclose(ver.aux_logits[level * width + col], last_logits(seq), atol=1e-5)
    for node in range(len(tree)):
        seq = context + [root] + [tree.tokens[i] for i in tree.path_to(node)]
        assert torch.allclose(ver.probs[node + 1], probabilities(last_logits(seq)[None], params)[0], atol=1e-5)
    alone = run(DraftTree(trie.tokens, trie.parents))
    assert alone.aux_logits is None
    assert torch.allclose(alone.probs, ver.probs, atol=1e-5)


def test_the_trie_merges_shared_prefixes_and_keeps_proposal_order() -> None:
    tree = DraftTree.trie([[1, 2, 3], [1, 2, 4], [5], [1, 6]])
    assert tree.tokens == [1, 2, 3, 4, 5, 6]
    assert tree.parents == [-1, 0, 1, 1, -1, 0]
    assert tree.children(-1) == [0, 4] and tree.probs is None


def test_the_pool_keeps_the_most_recent_continuations_per_first_token() -> None:
    pool = NgramPool(size=2)
    pool.add(1, (2, 3))
    pool.add(1, (4, 5))
    pool.add(1, (2, 3))  # seen again: most recent now
    pool.add(1, (6, 7))  # over the cap: the least recent, (4, 5), goes
    assert pool.candidates(1) == [(6, 7), (2, 3)]
    assert pool.candidates(9) == []


def one_hot_logits(tokens: list[int], vocab: int = 99) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def test_the_window_fills_then_each_iteration_pools_its_columns_and_moves_up() -> None:
    drafter = LookaheadDrafter(None, window=2, ngram=3, guesses=4)
    prompt = [50, 51, 52]
    drafter.start(prompt, None, 0)
    assert len(drafter.levels) == 1 and set(drafter.levels[0]) <= set(prompt)
    drafter.levels = [[1, 2]]
    tree = drafter.propose(prompt, 2, SamplingParams(), None)
    assert tree.aux_tokens == [1, 2] and len(tree) == 0  # nothing in the pool starts with 52
    drafter.observe(0, one_hot_logits([60, 61]))  # the window grows: 2 levels = N - 1
    assert drafter.levels == [[1, 2], [60, 61]]
    tree = drafter.propose(prompt, 2, SamplingParams(), None)
    assert tree.aux_tokens == [1, 2, 60, 61] and tree.aux_offsets == [1, 2, 2, 3]
    drafter.observe(0, one_hot_logits([70, 71, 80, 81]))  # the last level's outputs: 80, 81
    assert drafter.levels == [[60, 61], [80, 81]]
    assert drafter.pool.candidates(1) == [(60, 80)] and drafter.pool.candidates(2) == [(61, 81)]


def test_candidates_start_with_the_root_and_are_cut_to_k() -> None:
    drafter = LookaheadDrafter(None, window=1, ngram=4, guesses=3)
    context = [1, 2, 3, 4, 1, 5, 6, 7, 1, 2, 3, 9, 1]
    drafter.start(context, None, 0)
    tree = drafter.propose(context, 2, SamplingParams(), None)
    # n-grams of the text that start with 1: (2,3,9) most recently, then (5,6,7); (2,3,4) merged away
    assert tree.tokens == [2, 3, 5, 6] and tree.parents == [-1, 0, -1, 2]
    assert drafter.max_rows(2) >= len(tree) + len(tree.aux_tokens)


def test_the_engine_sizes_the_cache_for_window_and_guesses(target, monkeypatch: pytest.MonkeyPatch) -> None:
    # A wide window and many guesses need far more slots per step than K; a short request must fit.
    drafter = drafters.create("lookahead", target, {"window": 8, "ngram": 5, "guesses": 8})
    params, k = SamplingParams(max_tokens=4), 5
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = Engine(target).generate(prompt, params).token_ids
    # G guesses of up to N-1 tokens each (N-1 < K here), and the window: W columns by N-1 levels.
    needed = 8 * 4 + 8 * 4
    assert drafter.max_rows(k) == needed
    asked: list[int] = []  # the slots the engine asks the target's cache for
    rows: list[int] = []  # each proposal's verifier rows after the root: nodes and window rows
    new_cache, propose = target.decoder.new_cache, drafter.propose

    def sized(max_len: int):
        asked.append(max_len)
        return new_cache(max_len)

    def proposed(*args) -> DraftTree:
        tree = propose(*args)
        rows.append(tree.num_rows - 1)
        return tree

    monkeypatch.setattr(target.decoder, "new_cache", sized)
    monkeypatch.setattr(drafter, "propose", proposed)
    assert Engine(target, drafter, k).generate(prompt, params).token_ids == plain
    # The request's own tokens, every row one step may add after the root, and the root.
    assert asked == [len(prompt) + params.max_tokens + needed + 1]
    assert k < max(rows) <= needed  # the window made a step outgrow K, and the cache held it


def test_the_jacobi_window_feeds_the_pool_during_generation(target) -> None:
    drafter = LookaheadDrafter(target, window=3, ngram=3, guesses=3)
    prompt = [5, 6, 7, 8]
    Engine(target, drafter, 3).generate(prompt, SamplingParams(max_tokens=12))
    assert len(drafter.levels) == 2
    assert sum(len(v) for v in drafter.pool.entries.values()) > len(prompt) + 12 - 2  # more than the text's own


@pytest.mark.parametrize(
    "options, flag",
    [
        ({"window": 0}, "--lookahead-window"),
        ({"ngram": 1}, "--lookahead-ngram"),
        ({"guesses": 0}, "--lookahead-guesses"),
    ],
)
def test_bad_settings_name_the_flag(target, options, flag) -> None:
    with pytest.raises(ForerunError, match=flag):
        drafters.create("lookahead", target, options)


@pytest.mark.parametrize(
    "options",
    [{"window": 10**6}, {"window": 338, "ngram": 4, "guesses": 4}, {"guesses": 10**6}, {"window": 4, "ngram": 10**4}],
)
def test_settings_that_verify_more_rows_a_step_than_the_context_holds_are_refused(target, options) -> None:
    """(window + guesses) x (ngram - 1) rows at most a step: from the model's context of 1024 on, refused."""
    with pytest.raises(ForerunError, match=r"rows a step, more than the model's context of 1024 tokens"):
        drafters.create("lookahead", target, options)
    drafters.create("lookahead", target, {"window": 337, "ngram": 4, "guesses": 4})  # 1023 rows: taken
