"""Soft-label losses for draft heads: the KL divergence of the head's distribution from the
target's top-k, over the draft vocabulary.

Labels come from label shards (`soft_labels.py`). The target's top-k probabilities are renormalised
over those of its top-k ids that fall inside the draft vocabulary (a head cannot score the others),
and the loss is KL(target || head), whose gradient is that of the cross-entropy of the head's
log-softmax against this soft target. Only the k listed columns of the head's log-softmax are read,
so no dense [rows, vocabulary] target is built. Rows whose top-k has no id inside the draft
vocabulary are skipped. Corpus text has no prompt: every position trains.

- Medusa: head i (1-based) at position t guesses token t+1+i. A label exists for the next token only
  (position p's label is the distribution of token p+1 given the true text up to p), so head i at t
  learns the label stored at position t+i: the target's distribution of token t+1+i given the true
  text up to t+i (teacher forcing on the tokens between, as the hard-label loss does).
- EAGLE: row t reads (embed(x_{t+1}), f_t) and predicts f_{t+1}; its projection scores x_{t+2}, whose
  distribution is the label at position t+1. Unrolled (`unroll` > 1), step j feeds the head its own
  step j-1 features as drafting does, and row t still learns f_{t+1} and the label at t+1.

Top-1 agreement is measured against the target's top-1 (skipped where that token is outside the
draft vocabulary, as the hard-label accuracy skips such tokens).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from forerun.base import files
from forerun.base.errors import ForerunError
from forerun.train.data import order_within
from forerun.train.soft_labels import MANIFEST, LabelManifest

DECAY = 0.8  # EAGLE unrolled: each later step's loss weighs this much less (it counts only if the earlier were kept)


@dataclass
class SoftExample:
    """One labelled chunk in training dtypes."""

    tokens: torch.Tensor  # int64 [T]
    hidden: torch.Tensor  # float32 [T, hidden]
    top_ids: torch.Tensor  # int64 [T, k], likeliest first
    top_probs: torch.Tensor  # float32 [T, k]

    def to(self, device: torch.device) -> SoftExample:
        return SoftExample(*(x.to(device) for x in (self.tokens, self.hidden, self.top_ids, self.top_probs)))

    def tail(self, length: int) -> SoftExample:
        """The last `length` positions (an answer's end is what a head is trained for)."""
        return SoftExample(
            self.tokens[-length:], self.hidden[-length:], self.top_ids[-length:], self.top_probs[-length:]
        )


@dataclass
class DraftLabels:
    """Soft labels of R positions, in draft-vocabulary columns."""

    columns: torch.Tensor  # int64 [R, k]: draft column of each top-k id (0 where outside, with probability 0)
    probs: torch.Tensor  # float32 [R, k]: renormalised over the ids inside the draft vocabulary
    valid: torch.Tensor  # bool [R]: some of the top-k falls inside
    top1: torch.Tensor  # int64 [R]: draft column of the target's top-1, -100 where outside


def _manifest(folder: Path) -> LabelManifest:
    manifest = LabelManifest.read(folder)
    if manifest is None:
        raise ForerunError(f"no {MANIFEST} in {folder}: label a corpus into it first (forerun train --corpus)")
    return manifest


def _folders(data: Path | list[Path]) -> list[Path]:
    return [data] if isinstance(data, Path) else list(data)


def count_chunks(data: Path | list[Path]) -> int:
    return sum(_manifest(folder).chunks_done for folder in _folders(data))


def read_soft_examples(data: Path | list[Path], order: list[int] | None = None) -> Iterator[SoftExample]:
    """Every stored chunk of one label folder or several. Each folder is read shard by shard (one
    shard of each in memory at a time), `order` permuting the chunks within each shard (a seeded
    shuffle per epoch, as `data.read_examples` does); the folders' chunks are interleaved in
    proportion, chunk by chunk, so a corpus and a set of answers mix evenly through every epoch
    rather than in blocks of a shard."""
    folders = _folders(data)
    streams = [_folder_examples(folder, order) for folder in folders]
    totals = [max(_manifest(folder).chunks_done, 1) for folder in folders]
    # The i-th chunk of folder k sits at (i + 0.5) / totals[k] of the epoch; ties go to the first folder.
    waiting = [(0.5 / total, k) for k, total in enumerate(totals)]
    heapq.heapify(waiting)
    taken = [0] * len(folders)
    while waiting:
        _, k = heapq.heappop(waiting)
        example = next(streams[k], None)
        if example is None:
            continue
        yield example
        taken[k] += 1
        heapq.heappush(waiting, ((taken[k] + 0.5) / totals[k], k))


def _folder_examples(folder: Path, order: list[int] | None) -> Iterator[SoftExample]:
    """One label folder's chunks, shard by shard in the manifest's order."""
    for name in _manifest(folder).shards:
        shard = files.load_tensors(folder / name, f"remove {folder} to label again")
        starts = shard["starts"].tolist()
        count = len(starts) - 1
        for i in order_within(order, count) if order is not None else range(count):
            a, b = starts[i], starts[i + 1]
            yield SoftExample(
                shard["tokens"][a:b].long(),
                shard["hidden"][a:b].float(),
                shard["top_ids"][a:b].long(),
                shard["top_probs"][a:b].float(),
            )


def draft_columns(column: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary columns of token `ids` (any shape), -100 where a token is outside it.
    `column` [max id + 1]: token id -> column, -100 outside."""
    inside = ids < len(column)
    return torch.where(inside, column[ids.clamp(max=len(column) - 1)], torch.full_like(ids, -100))


def draft_labels(top_ids: torch.Tensor, top_probs: torch.Tensor, column: torch.Tensor) -> DraftLabels:
    """top_ids, top_probs [R, k] -> the labels restricted to the draft vocabulary."""
    columns = draft_columns(column, top_ids)  # [R, k]
    inside = columns >= 0
    probs = top_probs.float() * inside  # [R, k], 0 outside
    mass = probs.sum(-1, keepdim=True)  # [R, 1]
    valid = mass[:, 0] > 0
    probs = probs / mass.clamp_min(1e-12)
    return DraftLabels(columns.clamp(min=0), probs, valid, columns[:, 0])


def kl_loss(logits: torch.Tensor, columns: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid rows of KL(probs || softmax(logits)): logits [..., N], columns and probs
    [..., k], valid [...]. Zero (with a gradient) when no row is valid."""
    log_q = F.log_softmax(logits.float(), dim=-1).gather(-1, columns)  # [..., k]
    per_row = (torch.xlogy(probs, probs) - probs * log_q).sum(-1)  # [...]
    if not valid.any():
        return logits.sum() * 0.0
    return per_row[valid].mean()


def medusa_soft_loss(
    head: nn.Module, examples: list[SoftExample], column: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(loss, logits [H, R, N], target top-1 columns [H, R]) over every position of `examples`, or
    None when no chunk has two positions."""
    heads = head.num_heads
    features, columns, probs, valid, top1 = [], [], [], [], []
    for e in examples:
        t = len(e.tokens)
        rows = torch.arange(0, t - 1, device=e.tokens.device)  # [R]: head 1's label (at t+1) exists
        if len(rows) == 0:
            continue
        labels = draft_labels(e.top_ids, e.top_probs, column)  # per position
        positions = torch.stack([rows + i for i in range(1, heads + 1)])  # [H, R]: head i reads label t+i
        beyond = positions >= t
        positions = positions.clamp(max=t - 1)
        features.append(e.hidden[rows])
        columns.append(labels.columns[positions])  # [H, R, k]
        probs.append(labels.probs[positions])  # [H, R, k]
        valid.append(labels.valid[positions] & ~beyond)  # [H, R]
        top1.append(labels.top1[positions].masked_fill(beyond, -100))  # [H, R]
    if not features:
        return None
    logits = head(torch.cat(features))  # [H, R, N]
    valid_rows = torch.cat(valid, dim=1)
    loss = kl_loss(logits, torch.cat(columns, dim=1), torch.cat(probs, dim=1), valid_rows)
    return loss, logits, torch.cat(top1, dim=1).masked_fill(~valid_rows, -100)


def eagle_soft_loss(
    head: nn.Module,
    embed: nn.Module,
    e: SoftExample,
    column: torch.Tensor,
    noise: float,
    token_weight: float,
    unroll: int = 1,
) -> tuple[torch.Tensor, list[float]] | None:
    """(loss, top-1 agreement per draft step) of one chunk, or None when it is too short.

    Step j (`EagleHead.forward_unrolled`; step 1 reads the true features, later steps the head's
    own) predicts f̂_{s+1} at row s: smooth-L1 to f_{s+1} + token_weight x KL of its projection to
    the label at s+1; step j's loss weighs DECAY^(j-1), rows s >= j - 1 (those with a chain)."""
    t = len(e.tokens)
    if t < unroll + 1:
        return None
    with torch.no_grad():
        embeds = embed(e.tokens[1:]).float()  # [T-1, h], row s: embed(x_{s+1})
    noisy = e.hidden[:-1] + (torch.rand_like(e.hidden[:-1]) * 2 - 1) * noise  # row s: f_s
    labels = draft_labels(e.top_ids[1:], e.top_probs[1:], column)  # row s: the label at s+1
    top1 = labels.top1.masked_fill(~labels.valid, -100)
    losses, agreement = [], []
    for j, predicted in enumerate(head.forward_unrolled(embeds, noisy, unroll), start=1):
        rows = slice(j - 1, None)
        feature_loss = F.smooth_l1_loss(predicted[rows].float(), e.hidden[1:][rows].float())
        logits = head.logits(predicted[rows])  # scores x_{s+2}
        token_loss = kl_loss(logits, labels.columns[rows], labels.probs[rows], labels.valid[rows])
        losses.append(feature_loss + token_weight * token_loss)
        agreement += top1_agreement(logits[None], top1[rows][None])
    return step_weighted(losses), agreement


def step_weighted(losses: list[torch.Tensor]) -> torch.Tensor:
    """The unrolled steps' losses in one: step j weighs DECAY^(j-1), normalised to sum to 1."""
    weights = [DECAY**j for j in range(len(losses))]
    return sum(w * loss for w, loss in zip(weights, losses)) / sum(weights)


def top1_agreement(logits: torch.Tensor, target: torch.Tensor) -> list[float]:
    """Top-1 agreement per head: logits [H, R, N], target [H, R] (-100 skipped)."""
    out = []
    with torch.no_grad():
        for head_logits, head_target in zip(logits, target):
            valid = head_target >= 0
            hits = (head_logits.argmax(-1) == head_target) & valid
            out.append(float(hits.sum()) / max(int(valid.sum()), 1))
    return out
