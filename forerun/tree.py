"""DraftTree: what every drafter proposes. A chain is a tree with one branch.

Node i holds a draft token whose parent is node parents[i] (or -1: the root, i.e. the last
accepted token, which is not in the cache yet). Parents come before children. Verification feeds
the root and then every node, so verifier row 0 is the root and row i+1 is node i.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int]                  # [N] draft token of each node
    parents: list[int]                 # [N] parent node index, -1 for children of the root
    probs: torch.Tensor | None = None  # [N, vocab] draft distribution each token was drawn from; None: one-hot
    depths: list[int] = field(init=False)  # [N] 1 for children of the root

    def __post_init__(self) -> None:
        depths: list[int] = []
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must come before their children")
            depths.append(1 if p < 0 else depths[p] + 1)
        self.depths = depths

    @classmethod
    def chain(cls, tokens: list[int], probs: torch.Tensor | None = None) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 for the root), in proposal order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def positions(self, start: int) -> torch.Tensor:
        """Rope positions of the verifier rows [N+1]: the root sits at `start`, a node at start + depth."""
        return torch.tensor([start] + [start + d for d in self.depths], dtype=torch.long)

    def attention_mask(self, past: int) -> torch.Tensor:
        """bool [N+1, past+N+1]: every row sees the cache and its own ancestors (root included) and itself."""
        n = len(self.tokens) + 1
        own = torch.eye(n, dtype=torch.bool)                                 # [N+1, N+1]
        own[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                own[i + 1] |= own[p + 1]
        return torch.cat([torch.ones(n, past, dtype=torch.bool), own], dim=1)

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
