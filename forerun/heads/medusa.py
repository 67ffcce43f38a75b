"""Medusa heads: from the target's final hidden state at position t, head i guesses token t+1+i.

The target's own LM head already gives token t+1 (the next root); head i (1-based) is a residual
block x + SiLU(W_i x + b_i) on the same feature, and all heads share one projection onto the draft
vocabulary (initialised from the target's LM head rows for those tokens). The residual blocks start
at zero, so an untrained head i guesses what the LM head would say one position on: a sane start.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, num_heads: int, vocab: torch.Tensor) -> None:
        """vocab [N]: the token id of each projection row (the draft vocabulary)."""
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"Medusa needs at least one head, got {num_heads}")
        self.blocks = nn.ModuleList(ResBlock(hidden) for _ in range(num_heads))
        self.proj = nn.Linear(hidden, len(vocab), bias=False)
        self.register_buffer("vocab", vocab.clone())

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def init_projection(self, weight: torch.Tensor) -> None:
        """weight [N, hidden]: the target's LM head rows of the draft vocabulary."""
        with torch.no_grad():
            self.proj.weight.copy_(weight)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, hidden] -> logits [num_heads, T, N] over the draft vocabulary."""
        return self.proj(torch.stack([block(features) for block in self.blocks]))
