"""Draft-model forwards that several sequences share (continuous batching).

A drafter that runs a model proposes through `propose_steps`, a generator: each forward it needs
is yielded as a `DraftPass` (its tokens, their first position, its own cache) and the logits of
the pass's last row come back. Run alone, `run_passes` does each forward as it comes; run beside
other sequences' proposals, it gathers every sequence's pending pass into one forward over their
rows (each on its own cache, as the verifier batches the target), so B sequences drafting K tokens
cost about K draft forwards of B rows, not B·K forwards of one. The rows are nearly free on the
quantized kernels, as the target's are; what a drafter does between its forwards (sampling, its
choice to stop) stays its own.

Each pass is told the seconds it cost (a shared forward's time split evenly over its passes), so
a drafter times its forwards and the engine its proposals the same way alone or batched.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from forerun.models import linear
from forerun.models.attention import RowLayout, Segment
from forerun.models.decoder import Decoder
from forerun.models.kv_cache import KVCache

DraftSteps = Generator["DraftPass", torch.Tensor, Any]


@dataclass
class DraftPass:
    """One draft forward of a sequence: `tokens` at positions start, start + 1, ... on `cache`
    (whose length is `start`), scored by `head` (None: the decoder's own) at the last row only.

    With `branch`, a second path rides along: its tokens at positions fork, fork + 1, ... (fork <
    start + len(tokens)), seeing the cache's slots before `fork` and each other, not the tokens
    after the fork. Its last row is scored too (the logits come back as [2, N]), and its rows are
    scratch: the cache keeps `tokens` alone, so the branch is fed whole again on the next forward."""

    decoder: Decoder
    cache: KVCache
    tokens: list[int]
    start: int
    head: nn.Module | None = None
    branch: list[int] = field(default_factory=list)
    fork: int = 0
    # Set by the forward that ran it:
    seconds: float = 0.0  # this pass's share of the forward's time
    passes: int = 1  # passes in that forward (1: it ran alone)
    rows: int = 0  # rows in that forward
    lead: bool = True  # the forward's first pass (the one to time the whole forward by)

    def __post_init__(self) -> None:
        if self.start != self.cache.length:
            raise ValueError(f"a draft pass starts at its cache's length ({self.cache.length}), not at {self.start}")


def run_alone(steps: DraftSteps) -> Any:
    """Drive one proposal to its end, each forward as it comes; returns what it returned."""
    try:
        step = next(steps)
        while True:
            step = steps.send(forward([step])[0])
    except StopIteration as stop:
        return stop.value


def run_passes(steps: list[DraftSteps]) -> list[Any]:
    """Drive proposals to their end, each pending forward of all of them at once; returns what
    each generator returned, or the exception it raised (one sequence's failure is its own)."""
    results: list[Any] = [None] * len(steps)
    pending: dict[int, DraftPass] = {}

    def advance(i: int, value: torch.Tensor | None = None, error: Exception | None = None) -> None:
        try:
            step = steps[i].throw(error) if error is not None else steps[i].send(value)
        except StopIteration as stop:
            results[i] = stop.value
        except Exception as exc:  # noqa: BLE001 - kept for its own sequence
            results[i] = exc
        else:
            pending[i] = step

    for i in range(len(steps)):
        advance(i)
    while pending:
        batch = list(pending.items())
        pending.clear()
        for group in _groups(batch):
            passes = [p for _, p in group]
            try:
                logits = forward(passes)
            except Exception:  # noqa: BLE001 - find whose pass fails
                for i, p in group:
                    try:
                        out = forward([p])[0]
                    except Exception as exc:  # noqa: BLE001
                        advance(i, error=exc)
                    else:
                        advance(i, out)
                continue
            for (i, _), out in zip(group, logits):
                advance(i, out)
    return results


def _groups(batch: list[tuple[int, DraftPass]]) -> list[list[tuple[int, DraftPass]]]:
    """Passes that can share one forward: the same decoder and head."""
    groups: dict[tuple[int, int], list[tuple[int, DraftPass]]] = {}
    for i, p in batch:
        groups.setdefault((id(p.decoder), id(p.head)), []).append((i, p))
    return list(groups.values())


def forward(passes: list[DraftPass]) -> list[torch.Tensor]:
    """One forward over every pass's rows (all on one decoder and head); each pass's last-row
    logits [1, N] ([2, N] with a branch: the chain's, then the branch's), and its timing fields set."""
    first = passes[0]
    decoder = first.decoder
    many_rows = any(len(p.tokens) > 1 for p in passes)
    start = time.perf_counter()
    with linear.prefill() if many_rows else nullcontext():
        if len(passes) == 1 and not first.branch:
            logits = [decoder.forward_chain(first.tokens, first.cache, first.head)]  # [1, N]
        else:
            logits = _forward_segments(passes)
    share = (time.perf_counter() - start) / len(passes)
    rows = sum(len(p.tokens) + len(p.branch) for p in passes)
    for i, p in enumerate(passes):
        p.seconds, p.passes, p.rows, p.lead = share, len(passes), rows, i == 0
    return logits


def _forward_segments(passes: list[DraftPass]) -> list[torch.Tensor]:
    """Every pass's rows as one segment of a forward, each on its own cache; a pass with a branch
    has both its last rows scored and its branch's rows dropped from its cache afterwards."""
    tokens: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    for p in passes:
        chain = len(p.tokens)
        if p.branch:
            paths = [list(range(chain)), list(range(chain, chain + len(p.branch)))]
            layout = RowLayout.from_paths(p.start, paths, chain + len(p.branch), [p.start, p.fork])
        else:
            layout = RowLayout.chain(p.start, chain)
        segments.append(Segment(len(tokens), len(tokens) + len(layout.positions), p.cache, layout, not p.branch))
        tokens += p.tokens + p.branch
        positions += layout.positions
    first = passes[0]
    device = first.decoder.device
    ids, where = torch.tensor(tokens, device=device), torch.tensor(positions, device=device)
    # a row for each pass, every row for a pass with a branch
    logits = first.decoder(ids, where, None, segments=segments, head=first.head).logits[0]
    out: list[torch.Tensor] = []
    row = 0
    for p, seg in zip(passes, segments):
        if p.branch:
            fed = seg.stop - seg.start
            out.append(logits[[row + len(p.tokens) - 1, row + fed - 1]])
            p.cache.truncate(p.start + len(p.tokens))
            row += fed
        else:
            out.append(logits[row : row + 1])
            row += 1
    return out
