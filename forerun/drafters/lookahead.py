"""Lookahead decoding (Fu et al., 2024): Jacobi iteration collects n-grams, which are then verified.

Every step's single target forward carries two branches:
- the lookahead branch, a 2-D window of N-1 levels by W columns fed as aux rows. Level 0 guesses
  the W positions after the root; level l, column c sits at position root+1+c+l and sees the root,
  level 0 up to column c and its own column in levels 1..l, so each column is a short sequence
  continuing level 0. The target's argmax after the last level gives one more token per column:
  each column plus that token is an n-gram for the pool, and the window moves one level up (the
  oldest level drops, the new tokens become the newest), i.e. one Jacobi iteration. Until N-1
  levels exist the window only grows.
- the verification branch: up to G pool n-grams that start with the root token, continuation cut
  to K tokens, merged into a trie and verified as a draft tree. The pool also holds the n-grams of
  the prompt and the accepted text (prompt lookup for free); per first token it keeps the G most
  recently seen, most recent tried first.

Aux rows never see draft nodes and nodes never see aux rows, so the draft is verified as if alone.
The draft is a deterministic function of the past, so it goes to the acceptance rule as one-hot
drafts: greedy output is identical to the target's, and sampling is exact too (the child drafting
the target's own draw at each depth is kept, `accept.accept_one_hot`: siblings together with the sum
of their probabilities, as by SpecInfer's rule; a seeded request writes plain decoding's text).

Where it loses: every forward carries W*(N-1) window rows plus up to G*(N-1) draft rows. On a GPU
at batch 1 those rows are nearly free; on a CPU, or a GPU already busy with a batch, they cost
compute that a plain step does not pay, and acceptance needs a warmed-up pool, so short or very
random generations gain little.
"""

from __future__ import annotations

import random
from functools import lru_cache

import torch

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters import register
from forerun.drafters.base import Drafter
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel
from forerun.verification.sampling import Draws
from forerun.verification.tree import DraftTree


@lru_cache(maxsize=32)
def window_mask(levels: int, width: int) -> torch.Tensor:
    """bool [levels*width, 1 + levels*width] over (root, window rows); rows are level-major.

    Row (l, c) sees the root, level 0 at columns 0..c, and column c of levels 1..l.
    """
    a = levels * width
    mask = torch.zeros(a, 1 + a, dtype=torch.bool)
    mask[:, 0] = True
    for level in range(levels):
        for col in range(width):
            row = level * width + col
            mask[row, 1 : 2 + col] = True
            for up in range(1, level + 1):
                mask[row, 1 + up * width + col] = True
    return mask


def window_offsets(levels: int, width: int) -> list[int]:
    """Position of each window row after the root's: row (l, c) sits at +1+c+l."""
    return [1 + col + level for level in range(levels) for col in range(width)]


class NgramPool:
    """First token -> up to `size` continuations, least recently seen first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: dict[int, list[tuple[int, ...]]] = {}

    def add(self, first: int, continuation: tuple[int, ...]) -> None:
        seen = self.entries.setdefault(first, [])
        if continuation in seen:
            seen.remove(continuation)
        seen.append(continuation)
        if len(seen) > self.size:
            del seen[0]

    def candidates(self, first: int) -> list[tuple[int, ...]]:
        """Most recently seen first."""
        return self.entries.get(first, [])[::-1]


@register(
    "lookahead",
    cli_options={"lookahead_window": "window", "lookahead_ngram": "ngram", "lookahead_guesses": "guesses"},
)
class LookaheadDrafter(Drafter):
    def __init__(self, target: LoadedModel | None, window: int = 4, ngram: int = 4, guesses: int = 4) -> None:
        if window < 1:
            raise ForerunError(f"--lookahead-window must be at least 1, got {window}")
        if ngram < 2:
            raise ForerunError(f"--lookahead-ngram must be at least 2 (a token and its continuation), got {ngram}")
        if guesses < 1:
            raise ForerunError(f"--lookahead-guesses must be at least 1, got {guesses}")
        context = target.decoder.cfg.max_position if target is not None else None
        if context is not None and (window + guesses) * (ngram - 1) >= context:
            raise ForerunError(
                f"--lookahead-window {window} and --lookahead-guesses {guesses} with --lookahead-ngram {ngram} "
                f"verify up to ({window} + {guesses}) x {ngram - 1} rows a step, more than the model's context of "
                f"{context} tokens holds; use a smaller window, fewer guesses or shorter n-grams"
            )
        self.window, self.n, self.guesses = window, ngram, guesses
        self.pool = NgramPool(guesses)
        self.levels: list[list[int]] = []  # the Jacobi window, oldest level first, each [W]
        self.indexed = 0  # context positions whose n-grams are in the pool

    def max_rows(self, k: int) -> int:
        return self.guesses * min(self.n - 1, k) + self.window * (self.n - 1)

    def start(self, prompt_ids: list[int], target_cache: KVCache, max_len: int) -> None:
        self.pool = NgramPool(self.guesses)
        self.indexed = 0
        # Level 0 starts as tokens copied from the prompt (as the reference implementation does);
        # a fixed seed keeps runs reproducible.
        self.levels = [random.Random(0).choices(prompt_ids, k=self.window)]

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: Draws) -> DraftTree:
        self._index(context)
        drafts = [list(c[:k]) for c in self.pool.candidates(context[-1])]
        trie = DraftTree.trie(drafts)
        levels = len(self.levels)
        return DraftTree(
            trie.tokens,
            trie.parents,
            aux_tokens=[t for level in self.levels for t in level],
            aux_offsets=window_offsets(levels, self.window),
            aux_mask=window_mask(levels, self.window),
        )

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        if aux_logits is None:
            return
        newest = aux_logits[-self.window :].argmax(-1).tolist()  # one more token per column
        if len(self.levels) == self.n - 1:
            for col in range(self.window):
                column = [level[col] for level in self.levels] + [newest[col]]
                self.pool.add(column[0], tuple(column[1:]))
            self.levels = self.levels[1:]
        self.levels.append(newest)

    def _index(self, context: list[int]) -> None:
        """Add the n-grams of text that arrived since the last call (prompt, then accepted output)."""
        n = self.n
        for j in range(self.indexed, len(context) - n + 1):
            self.pool.add(context[j], tuple(context[j + 1 : j + n]))
        self.indexed = max(self.indexed, len(context) - n + 1)
