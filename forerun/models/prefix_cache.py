"""Prompt prefixes already prefilled, kept for the next prompt that starts with them (automatic
prefix caching, as vLLM's): a chat template's system turn, a conversation's earlier turns, a shared
document. A prompt's cache rows are kept in blocks of BLOCK tokens, each block found by its own
tokens and the block before it (a chain from the prompt's start, compared token for token: no hash
stands for tokens), least recently used evicted first once the blocks pass their byte budget.

Only where a prompt's rows come out the same in any chunks (`Decoder.chain_prefill`) does an
engine use it: a row restored is then bit for bit the row its prefill would compute, so output does
not depend on what ran before. A draft model keeps a cache of its own, as many tokens as the
target's holds (drafters/draft_model.py). See docs/architecture.md, Prefix cache.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from forerun.models.kv_cache import KVCache

BLOCK = 8  # tokens a block holds: a chat template's shared head is a few blocks
PREFIX_CACHE_MB = 512  # an LLM's default budget: some 9,000 tokens of the 1.5B target's rows


@dataclass
class _Block:
    id: int
    k: torch.Tensor  # [layers, kv_heads, BLOCK, head_dim]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def token_bytes(decoder) -> int:
    """Bytes one prompt token's rows take in a prefix cache of `decoder`'s (keys and values, every layer)."""
    cfg = decoder.cfg
    entry = torch.empty((), dtype=decoder.cache_dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * entry


class PrefixCache:
    """Blocks of prompt rows under (the block before's id, the block's tokens), at most
    `max_bytes` of them; `queries` and `hits` count prompt tokens looked up and found."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()  # least recent first
        self._ids = itertools.count(1)  # 0: the chain's start
        self.bytes = 0
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def restore(self, prompt: list[int], cache: KVCache) -> int:
        """Copy the longest run of `prompt`'s leading blocks held here into the empty `cache`, up to
        the prompt's last token (whose row the prefill still computes, for its logits); returns the
        rows restored."""
        found = self._chain(prompt, (len(prompt) - 1) // BLOCK)
        rows = len(found) * BLOCK
        if found:
            cache.k[:, 0, :, :rows] = torch.cat([block.k for _, block in found], dim=2)
            cache.v[:, 0, :, :rows] = torch.cat([block.v for _, block in found], dim=2)
            cache.advance(rows)
            self._touch(found)
        self.queries += len(prompt)
        self.hits += rows
        return rows

    def store(self, prompt: list[int], cache: KVCache) -> None:
        """Keep `prompt`'s whole blocks from `cache` (holding at least its rows), as many from its
        start as the budget holds; then evict the least recently used past the budget."""
        room = self.max_bytes // max(self._block_bytes(cache), 1)
        blocks = min(len(prompt) // BLOCK, room)
        found = self._chain(prompt, blocks)
        parent = found[-1][1].id if found else 0
        for b in range(len(found), blocks):
            start = b * BLOCK
            key = (parent, tuple(prompt[start : start + BLOCK]))
            block = _Block(
                next(self._ids),
                cache.k[:, 0, :, start : start + BLOCK].clone(),
                cache.v[:, 0, :, start : start + BLOCK].clone(),
            )
            self._blocks[key] = block
            self.bytes += block.nbytes
            found.append((key, block))
            parent = block.id
        self._touch(found)
        while self.bytes > self.max_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self.bytes -= block.nbytes

    def _chain(self, prompt: list[int], most: int) -> list[tuple[tuple[int, tuple[int, ...]], _Block]]:
        """`prompt`'s leading blocks held here, at most `most`, from its start."""
        found, parent = [], 0
        for b in range(most):
            key = (parent, tuple(prompt[b * BLOCK : (b + 1) * BLOCK]))
            block = self._blocks.get(key)
            if block is None:
                break
            found.append((key, block))
            parent = block.id
        return found

    def _touch(self, chain: list) -> None:
        """Mark `chain` used, its first block most recently: a block is evicted before those it
        follows (a block past a missing one could never be found)."""
        for key, _ in reversed(chain):
            self._blocks.move_to_end(key)

    @staticmethod
    def _block_bytes(cache: KVCache) -> int:
        layers, _, heads, _, dim = cache.k.shape
        return 2 * layers * heads * BLOCK * dim * cache.k.element_size()
