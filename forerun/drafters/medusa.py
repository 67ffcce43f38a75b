"""Medusa heads draft a tree from the target's last kept hidden state, verified in one pass.

The target's final hidden state at the last kept row produced the root (the step's first token
through the target's own LM head); head i guesses the token i places after the root. The tree is
data: a list of paths, Medusa's "choices", each path a tuple of ranks, e.g. (0, 1) = head 1's best
token, then head 2's second best under it. Every prefix of a path must be a path too.

Greedy: a node's token is its head's token of that rank (one-hot drafts). Sampling: a node's token
is drawn from its head's distribution q (its softmax, the request's temperature, top-k and top-p),
siblings independently, so the tree rule stays exact; the tree's shape never depends on what was drawn.
Medusa's own typical acceptance is lossy; forerun verifies with the exact rule.

Cost: one pass of H residual blocks and one projection per step, whatever K. Where it loses: heads
guess blind beyond the first position (no draft token conditions the next), so acceptance falls
with depth faster than a draft model's.
"""

from __future__ import annotations

import torch

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters import register
from forerun.drafters.base import Drafter
from forerun.drafters.vocabulary import full_vocabulary
from forerun.heads import shared_head
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel
from forerun.verification.sampling import Draws, PositionDraws, draw_tokens, probabilities
from forerun.verification.tree import DraftTree

# Sized for a CPU, where each verified row costs: 8 nodes, 4 deep.
DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = ((0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0))


def check_choices(choices, num_heads: int, ranks: int | None = None) -> list[tuple[int, ...]]:
    """Paths as tuples, parents before children; a clear error for a malformed tree (`ranks`: the
    heads' vocabulary, which no rank may reach: such a node would never draft)."""
    if any(isinstance(r, bool) for c in choices for r in c):
        raise ForerunError("Medusa choices are paths of ranks (whole numbers from 0), not True or False")
    paths = [tuple(int(r) for r in c) for c in choices]
    if not paths:
        raise ForerunError("Medusa choices are empty: give at least one path, e.g. [[0]]")
    seen = set(paths)
    for path in paths:
        if not path or min(path) < 0:
            raise ForerunError(f"Medusa choice {list(path)} is not a path of ranks (whole numbers from 0)")
        if ranks is not None and max(path) >= ranks:
            raise ForerunError(
                f"Medusa choice {list(path)} names rank {max(path)}, but the heads score {ranks} tokens: "
                f"use ranks below {ranks}"
            )
        if len(path) > num_heads:
            raise ForerunError(f"Medusa choice {list(path)} is {len(path)} deep, but the head has {num_heads} heads")
        if len(path) > 1 and path[:-1] not in seen:
            raise ForerunError(f"Medusa choice {list(path)} lacks its parent {list(path[:-1])}; list every prefix")
    return sorted(dict.fromkeys(paths), key=lambda p: (len(p), p))


def choices_tree(choices: list[tuple[int, ...]], depth: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """The paths at most `depth` deep and each one's parent index (-1: the root), parents first."""
    paths = [p for p in choices if len(p) <= depth]
    index = {p: i for i, p in enumerate(paths)}
    return paths, [index[p[:-1]] if len(p) > 1 else -1 for p in paths]


@register("medusa", cli_options={"speculative_head": "head", "medusa_choices": "choices"})
class MedusaDrafter(Drafter):
    reads_features = True

    def __init__(self, target: LoadedModel, head: str | None = None, choices=None) -> None:
        if head is None:
            raise ForerunError(
                "--speculative-method medusa needs --speculative-head DIR (train one with "
                "`forerun train --method medusa`)"
            )
        self.config, self.heads = shared_head(head, target, "medusa")
        self.vocab = self.heads.vocab  # [N] token ids
        self.vocab_size = target.decoder.cfg.vocab_size
        if choices is None:  # the default tree, cut to the heads there are
            choices = [c for c in DEFAULT_CHOICES if len(c) <= self.heads.num_heads]
        self.choices = check_choices(choices, self.heads.num_heads, len(self.vocab))
        self.feature: torch.Tensor | None = None  # [hidden] of the last kept row

    def max_rows(self, k: int) -> int:
        return len(choices_tree(self.choices, k)[0])

    def start(self, prompt_ids: list[int], target_cache: KVCache, max_len: int) -> None:
        self.feature = None

    def features(self, hidden: torch.Tensor) -> None:
        """The target's hidden states [n, hidden] of the rows its cache just kept, in order."""
        self.feature = hidden[-1].float()

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: Draws) -> DraftTree | None:
        if self.feature is None:
            return None
        paths, parents = choices_tree(self.choices, min(k, self.heads.num_heads))
        with torch.inference_mode():
            logits = self.heads(self.feature[None])[:, 0]  # [H, N]
        if params.greedy:
            width = max(p[-1] for p in paths) + 1
            ranked = self.vocab[logits.topk(min(width, logits.shape[-1]), dim=-1).indices]  # [H, width]
            tokens = [int(ranked[len(p) - 1, p[-1]]) if p[-1] < ranked.shape[1] else -1 for p in paths]
            keep = _without_missing(tokens, parents)
            return DraftTree([tokens[i] for i in keep], _reindex(parents, keep)) if keep else None
        q = full_vocabulary(probabilities(logits, params), self.vocab, self.vocab_size)  # [H, V]
        depths = [len(p) - 1 for p in paths]
        tokens = draw_tokens(q[depths], generator, depths)  # one draw per node
        if isinstance(generator, PositionDraws):  # siblings drew one number: one node for each token
            keep = _without_missing(_first_of_siblings(tokens, parents), parents)
            return DraftTree([tokens[i] for i in keep], _reindex(parents, keep), q[depths][keep])
        return DraftTree(tokens, parents, q[depths])

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        pass


def _without_missing(tokens: list[int], parents: list[int]) -> list[int]:
    """Nodes whose rank exists in a tiny draft vocabulary, with their parents kept."""
    keep: list[int] = []
    kept = set()
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        if token >= 0 and (parent < 0 or parent in kept):
            keep.append(i)
            kept.add(i)
    return keep


def _first_of_siblings(tokens: list[int], parents: list[int]) -> list[int]:
    """`tokens` with each node that repeats an earlier sibling's token marked missing (-1)."""
    seen: set[tuple[int, int]] = set()
    marked = []
    for token, parent in zip(tokens, parents):
        marked.append(-1 if (parent, token) in seen else token)
        seen.add((parent, token))
    return marked


def _reindex(parents: list[int], keep: list[int]) -> list[int]:
    new = {old: i for i, old in enumerate(keep)}
    return [new[parents[i]] if parents[i] >= 0 else -1 for i in keep]
