"""KVCache: writes land at explicit slots; truncate and keep are exact rollbacks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forerun.models.kv_cache import KVCache

LAYERS, BATCH, HEADS, HEAD_DIM = 2, 2, 3, 4


def filled_cache(length: int, max_len: int = 32) -> KVCache:
    """A cache whose entry at slot s is distinct from every other (k = s + 1 + noise, v = -k)."""
    cache = KVCache(LAYERS, BATCH, HEADS, max_len, HEAD_DIM, torch.float32)
    gen = torch.Generator().manual_seed(length)
    base = torch.arange(1, length + 1, dtype=torch.float32)[None, None, :, None]  # [1, 1, T, 1]
    for layer in range(LAYERS):
        k = base + torch.rand(BATCH, HEADS, length, HEAD_DIM, generator=gen) * 0.1 + 1000 * layer
        cache.write(layer, k, -k)
    cache.advance(length)
    return cache


@st.composite
def cache_and_indices(draw):
    length = draw(st.integers(min_value=0, max_value=24))
    chosen = draw(st.lists(st.integers(0, max(length - 1, 0)), unique=True, max_size=length))
    return length, sorted(chosen) if length else []


@settings(max_examples=150, deadline=None)
@given(cache_and_indices())
def test_keep_leaves_exactly_the_chosen_entries_in_leading_slots(case):
    length, indices = case
    cache = filled_cache(length)
    old_k, old_v = cache.k.clone(), cache.v.clone()
    cache.keep(indices)
    n = len(indices)
    assert cache.length == n
    idx = torch.tensor(indices, dtype=torch.long)
    assert torch.equal(cache.k[:, :, :, :n], old_k[:, :, :, idx])
    assert torch.equal(cache.v[:, :, :, :n], old_v[:, :, :, idx])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20), st.data())
def test_keep_of_a_prefix_plus_a_path_matches_a_fresh_cache_of_those_entries(length, data):
    # The engine's pattern: keep slots [0, base] plus some later slots; then keep writing.
    base = data.draw(st.integers(0, length - 1))
    tail = sorted(data.draw(st.lists(st.integers(base + 1, length), unique=True, max_size=length - base)))
    tail = [t for t in tail if t < length]
    cache = filled_cache(length)
    old = cache.k.clone()
    cache.keep(list(range(base + 1)) + tail)
    new = torch.full((LAYERS, BATCH, HEADS, 1, HEAD_DIM), 7.0)
    for layer in range(LAYERS):
        keys, _ = cache.write(layer, new[layer], -new[layer])
        assert keys.shape[2] == base + 1 + len(tail) + 1
    cache.advance(1)
    expected = torch.cat([old[:, :, :, : base + 1], old[:, :, :, tail], new], dim=3)
    assert torch.equal(cache.k[:, :, :, : cache.length], expected)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 24), st.data())
def test_truncate_forgets_the_tail_and_the_next_write_overwrites_it(length, data):
    n = data.draw(st.integers(0, length))
    cache = filled_cache(length)
    old = cache.k.clone()
    cache.truncate(n)
    assert cache.length == n
    new = torch.full((BATCH, HEADS, 2, HEAD_DIM), -5.0)
    keys, values = cache.write(0, new, new)
    assert keys.shape[2] == n + 2
    assert torch.equal(keys[:, :, :n], old[0, :, :, :n])
    assert torch.equal(keys[:, :, n:], new)


def test_write_returns_every_valid_entry_and_length_moves_only_on_advance():
    cache = filled_cache(3)
    k = torch.ones(BATCH, HEADS, 2, HEAD_DIM)
    keys, values = cache.write(1, k, 2 * k)
    assert keys.shape == (BATCH, HEADS, 5, HEAD_DIM) and cache.length == 3
    assert torch.equal(values[:, :, 3:], 2 * k)
    cache.advance(2)
    assert cache.length == 5


def test_write_past_max_len_raises_overflow():
    cache = filled_cache(6, max_len=8)
    with pytest.raises(ValueError, match="overflow"):
        cache.write(0, torch.zeros(BATCH, HEADS, 3, HEAD_DIM), torch.zeros(BATCH, HEADS, 3, HEAD_DIM))
    cache.write(0, torch.zeros(BATCH, HEADS, 2, HEAD_DIM), torch.zeros(BATCH, HEADS, 2, HEAD_DIM))  # exactly full


@pytest.mark.parametrize("n", [-1, 6])
def test_truncate_outside_zero_to_length_raises(n):
    cache = filled_cache(5)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(n)
    assert cache.length == 5


@pytest.mark.parametrize(
    "indices",
    [
        [0, 5],  # past the valid length
        [2, 1],  # descending
        [1, 1],  # repeated
        [-1, 2],  # negative
        [0, 1, 7],  # inside max_len but past length
    ],
)
def test_keep_rejects_indices_that_are_not_ascending_valid_slots(indices):
    cache = filled_cache(5)
    before = cache.k.clone()
    with pytest.raises(ValueError, match="ascending"):
        cache.keep(indices)
    assert cache.length == 5 and torch.equal(cache.k, before)


def test_keep_nothing_empties_the_cache_and_reset_does_too():
    cache = filled_cache(4)
    cache.keep([])
    assert cache.length == 0
    cache = filled_cache(4)
    cache.reset()
    assert cache.length == 0
