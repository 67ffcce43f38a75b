"""Row-exact attention for decoding and verification: a row's output does not depend on its batch.

Plain decoding feeds one row; verification feeds the root and every draft node at once. For greedy
speculation to equal plain decoding bit for bit, each row must come out exactly as it would alone.
Batched kernels keep the rows of a product independent (checked by the tests), but a reduction's
result depends on its length: attention over a cache masked past a row's position sums in a
different order than attention over exactly that row's keys. So every row here reduces over a
length that depends on its own position alone, `key_length(p)`: slots [0, p] are what it sees,
slots from p + 1 up to that length are masked (weight exactly 0), whatever they hold.

Rows whose keys sit in their logical order (the root and a chain, or a tree's first branch) are
computed straight on the cache. A row of another tree branch sees its ancestors, which sit at other
slots: for its group the ancestors' entries are moved into the logical slots, the group is computed,
and the displaced entries are put back (`RowGroup.moves`).

Worked example: cache of 100 slots, chain root r (slot 100) and drafts a, b (slots 101, 102), key
block 64: all three rows reduce over 128 slots; r masks slots 101..127, a 102..127, b 103..127.
Plain decoding of r alone also reduces over 128 slots with 101..127 masked: the same sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from forerun.models.kv_cache import KVCache

KEY_BLOCK = 64  # reductions run over a multiple of this many slots


def key_length(position: int, block: int | None = None) -> int:
    """Slots a row at `position` reduces over: position + 1 rounded up to the key block."""
    block = block or KEY_BLOCK
    return -(-(position + 1) // block) * block


@dataclass
class RowGroup:
    rows: list[int]  # [Tg] indices of the new rows computed together
    length: int  # every row of the group reduces over slots [0, length)
    moves: list[tuple[int, int]] = field(default_factory=list)  # (logical slot, slot holding its entry)
    visible: torch.Tensor | None = None  # bool [Tg, length] for rows that need not be exact; None: slot <= position
    # The moves as (logical, holding) index tensors, made at first use.
    _slots: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def move_slots(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The moves' logical slots and the slots holding their entries, made once for every layer."""
        if self._slots is None or self._slots[0].device != device:
            self._slots = (
                torch.tensor([m[0] for m in self.moves], device=device),
                torch.tensor([m[1] for m in self.moves], device=device),
            )
        return self._slots


@dataclass
class RowLayout:
    """How the new rows of one forward see the cache, for `attend`."""

    positions: list[int]  # [T] logical position of each row (its last visible slot)
    groups: list[RowGroup]
    bias: dict[int, torch.Tensor] = field(default_factory=dict)  # per group: additive mask [Tg, length]

    @property
    def max_length(self) -> int:
        return max(g.length for g in self.groups)

    @classmethod
    def chain(cls, start: int, rows: int) -> RowLayout:
        """`rows` rows at slots and positions start, start+1, ...: plain decoding and chain verification."""
        return cls.from_paths(start, [list(range(rows))], rows)

    @classmethod
    def from_paths(cls, start: int, paths: list[list[int]], rows: int, firsts: list[int] | None = None) -> RowLayout:
        """Rows fed at slots start..start+rows-1; `paths` lists, for every leaf, the rows from the
        first one (the root) down to it. A row's logical slot is its path's first slot plus its
        depth on the path: `start`, or the path's entry of `firsts`, an earlier slot for a path
        that forks from the cache (it sees slots [0, first), then its own rows)."""
        positions = [-1] * rows
        groups: list[RowGroup] = []
        for i, path in enumerate(paths):
            first = start if firsts is None else firsts[i]
            moves = [(first + depth, start + row) for depth, row in enumerate(path) if first + depth != start + row]
            new = [row for row in path if positions[row] < 0]
            by_length: dict[int, list[int]] = {}
            for depth, row in enumerate(path):
                if positions[row] < 0:
                    positions[row] = first + depth
                    by_length.setdefault(key_length(first + depth), []).append(row)
            if not new:
                continue
            for length, members in by_length.items():
                # Moves inside the group's reach only: entries past the last logical slot are masked.
                reach = max(positions[r] for r in members)
                groups.append(RowGroup(members, length, [m for m in moves if m[0] <= reach]))
        if any(p < 0 for p in positions):
            raise ValueError("every row must lie on one of the paths")
        return cls(positions, groups)

    def add_masked_rows(self, rows: list[int], positions: list[int], visible: torch.Tensor) -> None:
        """Rows whose outputs need not be exact (lookahead's window), seeing the slots `visible`
        (bool [len(rows), S]) marks; they are computed apart from every exact row."""
        self.positions += positions
        self.groups.append(RowGroup(rows, visible.shape[1], visible=visible))

    def mask_bias(self, group_index: int, device: torch.device) -> torch.Tensor:
        """float [Tg, length]: 0 where a row sees a slot (slot <= its position), -inf elsewhere."""
        bias = self.bias.get(group_index)
        if bias is None or bias.device != device:
            group = self.groups[group_index]
            if group.visible is not None:
                hidden = ~group.visible.to(device)
            else:
                pos = torch.tensor([self.positions[r] for r in group.rows], device=device)
                hidden = torch.arange(group.length, device=device)[None, :] > pos[:, None]
            bias = torch.zeros(len(group.rows), group.length, device=device).masked_fill_(hidden, float("-inf"))
            self.bias[group_index] = bias
        return bias


@dataclass
class Segment:
    """One sequence's rows in a forward over several sequences (continuous batching): rows
    [start, stop) of the forward, attending over that sequence's own cache as `layout` says.
    `last_only`: only its last row is scored (a prompt's chunk carried in a step)."""

    start: int
    stop: int
    cache: KVCache
    layout: RowLayout
    last_only: bool = False


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """q [T, H, D] float32 (rope applied, scaled by 1/sqrt(D)); keys, values [KVH, S, D]: one
    layer's cache with this forward's entries written. Returns [T, H * D] float32.

    Query heads h share key/value head h // (H / KVH), as grouped-query attention does. Each row's
    two products are the very call plain decoding makes ([KVH, G, D] x [KVH, D, L], batched over
    KVH): matrix kernels pick their path by row count, so stacking rows would change the sums.
    Masking and softmax work row by row and are batched.
    """
    t, h, d = q.shape
    kvh = keys.shape[0]
    g = h // kvh
    q_rows = q.view(t, kvh, g, d).unbind(0)  # T x [KVH, G, D]
    out = torch.empty(t, kvh, g, d, dtype=torch.float32, device=q.device)
    out_rows = out.unbind(0)
    float_cache = keys.dtype == torch.float32
    for index, group in enumerate(layout.groups):
        rows, length = group.rows, group.length
        saved = _move_in(keys, values, *group.move_slots(keys.device)) if group.moves else None
        try:
            k, v = keys[:, :length], values[:, :length]  # [KVH, L, D]
            if not float_cache:
                k, v = k.float(), v.float()
            k_t = k.transpose(1, 2)  # [KVH, D, L]
            scores = torch.empty(len(rows), kvh, g, length, device=q.device)  # [Tg, KVH, G, L]
            for row, dst in zip(rows, scores.unbind(0)):
                torch.bmm(q_rows[row], k_t, out=dst)
            scores.add_(layout.mask_bias(index, q.device)[:, None, None])
            probs = torch.softmax(scores, dim=-1).unbind(0)
            for row, p in zip(rows, probs):
                torch.bmm(p, v, out=out_rows[row])
        finally:
            if saved is not None:
                _move_back(keys, values, saved)
    return out.view(t, h * d)


def _move_in(keys: torch.Tensor, values: torch.Tensor, dst: torch.Tensor, src: torch.Tensor):
    """keys, values [KVH, S, D]: the entries at slots `src` copied to slots `dst`; returns what
    `dst` held, for `_move_back`."""
    saved = (dst, keys.index_select(1, dst), values.index_select(1, dst))
    # index_select copies: every source is read before any destination is written (a source may
    # be another move's destination).
    keys.index_copy_(1, dst, keys.index_select(1, src))
    values.index_copy_(1, dst, values.index_select(1, src))
    return saved


def _move_back(keys: torch.Tensor, values: torch.Tensor, saved) -> None:
    dst, k_old, v_old = saved
    keys.index_copy_(1, dst, k_old)
    values.index_copy_(1, dst, v_old)
