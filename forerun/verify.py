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


def verify(target: Decoder, cache: KVCache, root: int, tree: DraftTree | None,
           params: SamplingParams) -> Verification:
    """Feed the root (last accepted token, at slot and position cache.length) plus the tree.

    A chain needs no explicit mask (causal); a tree gets one built from its parents. Slots past the
    accepted path are left for the caller to drop with cache.keep / cache.truncate.
    """
    start = cache.length
    device = target.device
    if tree is None or len(tree) == 0:
        tokens = torch.tensor([root], device=device)
        positions = torch.tensor([start], device=device)
        mask = None
    else:
        tokens = torch.tensor([root] + tree.tokens, device=device)
        positions = tree.positions(start).to(device)
        mask = None if tree.is_chain else tree.attention_mask(start).to(device)
    out = target(tokens, positions, cache, mask, output_hidden=True)
    return Verification(probs=probabilities(out.logits[0], params), hidden=out.hidden[0])
