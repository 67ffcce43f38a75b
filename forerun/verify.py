"""One target forward over the root and every draft node; the target's distribution at each row."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from forerun.config import SamplingParams
from forerun.kv_cache import KVCache
from forerun.models.decoder import Decoder
from forerun.sampling import probabilities
from forerun.tree import DraftTree


@dataclass
class Verification:
    probs: torch.Tensor   # [N+1, vocab] processed target distribution after the root (row 0) and each node
    hidden: torch.Tensor  # [N+1, hidden] final hidden state of each row (for feature-level drafters)
    aux_logits: torch.Tensor | None = None  # [A, vocab] raw target logits of the tree's aux rows, if any


def verify(target: Decoder, cache: KVCache, root: int, tree: DraftTree | None,
           params: SamplingParams) -> Verification:
    """Feed the root (last accepted token, at slot and position cache.length), the tree's nodes,
    then its aux rows.

    A chain needs no explicit mask (causal); a tree or aux rows get one built from the tree. Slots
    past the accepted path (aux rows included) are left for the caller to drop with cache.keep /
    cache.truncate.
    """
    start = cache.length
    device = target.device
    tree = tree if tree is not None else DraftTree([], [])
    tokens = torch.tensor([root] + tree.tokens + tree.aux_tokens, device=device)   # [R]
    positions = tree.positions(start).to(device)                                     # [R]
    mask = tree.attention_mask(start).to(device) if tree.needs_mask else None       # [R, start+R]
    out = target(tokens, positions, cache, mask, output_hidden=True)
    n = len(tree) + 1
    logits = out.logits[0]                                                           # [R, vocab]
    return Verification(probs=probabilities(logits[:n], params), hidden=out.hidden[0, :n],
                        aux_logits=logits[n:] if tree.aux_tokens else None)
