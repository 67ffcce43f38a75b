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
  distribution is the label at position t+1.

Top-1 agreement is measured against the target's top-1 (skipped where that token is outside the
draft vocabulary, as the hard-label accuracy skips such tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from forerun.base.errors import ForerunError
from forerun.train.data import order_within
from forerun.train.soft_labels import MANIFEST, LabelManifest


@dataclass
class SoftExample:
    """One labelled chunk in training dtypes."""

    tokens: torch.Tensor  # int64 [T]
    hidden: torch.Tensor  # float32 [T, hidden]
    top_ids: torch.Tensor  # int64 [T, k], likeliest first
    top_probs: torch.Tensor  # float32 [T, k]

    def to(self, device: torch.device) -> SoftExample:
        return SoftExample(*(x.to(device) for x in (self.tokens, self.hidden, self.top_ids, self.top_probs)))

    def head(self, length: int) -> SoftExample:
        """The first `length` positions."""
        return SoftExample(self.tokens[:length], self.hidden[:length], self.top_ids[:length], self.top_probs[:length])


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


def count_chunks(folder: Path) -> int:
    return _manifest(folder).chunks_done


def read_soft_examples(folder: Path, order: list[int] | None = None) -> Iterator[SoftExample]:
    """Every stored chunk, shard by shard (one shard in memory at a time); `order` permutes the
    chunks within each shard (a seeded shuffle per epoch), as `data.read_examples` does."""
    from safetensors.torch import load_file

    for name in _manifest(folder).shards:
        shard = load_file(str(folder / name))
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
    head: nn.Module, embed: nn.Module, e: SoftExample, column: torch.Tensor, noise: float, token_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(loss, logits [T-1, N], target top-1 columns [T-1]) of one chunk, or None when it is too short.

    loss = smooth-L1 of f̂_{t+1} to f_{t+1} + token_weight x KL of its projection to the label at t+1."""
    t = len(e.tokens)
    if t < 2:
        return None
    with torch.no_grad():
        embeds = embed(e.tokens[1:]).float()  # [T-1, h], row j: embed(x_{j+1})
    noisy = e.hidden[:-1] + (torch.rand_like(e.hidden[:-1]) * 2 - 1) * noise  # row j: f_j
    predicted = head.forward_train(embeds[None], noisy[None])[0]  # [T-1, h]: f̂_{j+1}
    feature_loss = F.smooth_l1_loss(predicted, e.hidden[1:])
    logits = head.logits(predicted)  # [T-1, N]: scores x_{j+2}
    labels = draft_labels(e.top_ids[1:], e.top_probs[1:], column)  # row j: the label at j+1
    token_loss = kl_loss(logits, labels.columns, labels.probs, labels.valid)
    return feature_loss + token_weight * token_loss, logits, labels.top1.masked_fill(~labels.valid, -100)
