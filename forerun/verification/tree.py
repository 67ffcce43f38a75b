"""DraftTree: what every drafter proposes. A chain is a tree with one branch.

Node i holds a draft token whose parent is node parents[i] (or -1: the root, i.e. the last
accepted token, which is not in the cache yet). Parents come before children. Verification feeds
the root and then every node, so verifier row 0 is the root and row i+1 is node i.

A drafter may also ask for auxiliary rows (lookahead decoding's Jacobi window): fed after the nodes
in the same forward, at positions and with visibility of the drafter's choosing, never seen by a
node and never looked at by the acceptance rule. Their logits go back to the drafter.

Worked example: nodes a (parent -1), b (parent 0), c (parent -1), one aux row z that sees the root.
Rows are [root, a, b, c, z] at positions [s, s+1, s+2, s+1, s+offset(z)]; b sees root, a, b; c sees
root, c; z sees root, z. After acceptance the caller keeps the slots of the accepted path only, so
aux rows are dropped like rejected nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int]  # [N] draft token of each node
    parents: list[int]  # [N] parent node index, -1 for children of the root
    probs: torch.Tensor | None = None  # [N, vocab] draft distribution each token was drawn from; None: one-hot
    aux_tokens: list[int] = field(default_factory=list)  # [A] extra rows fed after the nodes
    aux_offsets: list[int] = field(default_factory=list)  # [A] rope position of each aux row minus the root's
    aux_mask: torch.Tensor | None = None  # bool [A, 1+A]: which of (root, aux rows) each aux row sees
    depths: list[int] = field(init=False)  # [N] 1 for children of the root

    def __post_init__(self) -> None:
        depths: list[int] = []
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must come before their children")
            depths.append(1 if p < 0 else depths[p] + 1)
        self.depths = depths
        a = len(self.aux_tokens)
        if len(self.aux_offsets) != a:
            raise ValueError(f"{a} aux tokens but {len(self.aux_offsets)} aux offsets")
        if a and (self.aux_mask is None or tuple(self.aux_mask.shape) != (a, a + 1)):
            raise ValueError(f"aux_mask must be bool [{a}, {a + 1}] over (root, aux rows)")

    @classmethod
    def chain(cls, tokens: list[int], probs: torch.Tensor | None = None) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs)

    @classmethod
    def trie(cls, sequences: list[list[int]]) -> DraftTree:
        """One-hot drafts that share prefixes, merged: siblings carry distinct tokens, and the first
        sequence's branch comes first (the acceptance rule tries siblings in order)."""
        tokens: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for seq in sequences:
            node = -1
            for token in seq:
                if (node, token) not in child:
                    child[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = child[(node, token)]
        return cls(tokens, parents)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_rows(self) -> int:
        """Verifier rows: the root, every node, every aux row."""
        return 1 + len(self.tokens) + len(self.aux_tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def needs_mask(self) -> bool:
        """A chain alone is causal; branches or aux rows need an explicit mask."""
        return bool(self.aux_tokens) or not self.is_chain

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 for the root), in proposal order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def positions(self, start: int) -> torch.Tensor:
        """Rope positions of the verifier rows [num_rows]: the root sits at `start`, a node at
        start + depth, an aux row at start + its offset."""
        return torch.tensor(
            [start] + [start + d for d in self.depths] + [start + o for o in self.aux_offsets], dtype=torch.long
        )

    def attention_mask(self, past: int) -> torch.Tensor:
        """bool [R, past+R] with R = num_rows: every row sees the cache; a node sees its ancestors
        (root included) and itself; an aux row sees what aux_mask allows and no node."""
        n = len(self.tokens) + 1
        own = torch.eye(n, dtype=torch.bool)  # [N+1, N+1]
        own[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                own[i + 1] |= own[p + 1]
        a = len(self.aux_tokens)
        if a:
            rows = torch.zeros(n + a, n + a, dtype=torch.bool)  # [R, R]
            rows[:n, :n] = own
            rows[n:, 0] = self.aux_mask[:, 0]
            rows[n:, n:] = self.aux_mask[:, 1:]
            own = rows
        return torch.cat([torch.ones(n + a, past, dtype=torch.bool), own], dim=1)

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
