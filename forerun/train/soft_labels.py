"""Soft labels for draft heads: the target reads corpus chunks and its final hidden state and top-k
next-token distribution at every position are stored in safetensors shards, resumably.

A head then learns the target's own distribution (a KL to these labels) rather than the corpus's
next token: what a drafter is judged on is agreeing with the target. One prefill per chunk, no
generation (the target's answers come labelled from `train/labelled_answers.py`, or as chunks).
Shards (`labels-00000.safetensors`, ...) hold whole chunks:

    tokens    int32 [T]             every chunk's tokens, one after another
    hidden    bfloat16 [T, hidden]  the target's final hidden state (after the last norm) at each position
    top_ids   int32 [T, k]          the k likeliest next tokens at each position, likeliest first
    top_probs float16 [T, k]        their probabilities (softmax at temperature 1 over the full vocabulary)
    starts    int64 [S + 1]         where each chunk begins (and the end)

Position i's label is the distribution of token i + 1 given tokens[: i + 1]. A manifest
(`labels.json`) lists the finished shards and how many chunks of the (deterministic) chunk stream
they cover; a shard is written before the manifest names it, so a rerun resumes at the next chunk.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from forerun.base import files
from forerun.base.errors import ForerunError
from forerun.models import linear
from forerun.models.decoder import Decoder
from forerun.models.load import LoadedModel

MANIFEST = "labels.json"
TOP_K = 20
SHARD_TOKENS = 1 << 16  # a shard is written once it holds this many positions
LOGIT_BYTES = 256 << 20  # float32 logits scored at a time: a chunk's full [T, vocab] can be gigabytes


@dataclass
class Labels:
    hidden: torch.Tensor  # bfloat16 [T, hidden]
    top_ids: torch.Tensor  # int32 [T, k], likeliest first
    top_probs: torch.Tensor  # float16 [T, k]


@dataclass
class LabeledChunk:
    """One chunk as stored (the shard's dtypes; convert per batch when training)."""

    tokens: torch.Tensor  # int32 [T]
    hidden: torch.Tensor  # bfloat16 [T, hidden]
    top_ids: torch.Tensor  # int32 [T, k]
    top_probs: torch.Tensor  # float16 [T, k]


@dataclass
class LabelManifest:
    target: str
    top_k: int
    hidden_size: int
    vocab_size: int
    chunks_done: int = 0
    shards: list[str] = field(default_factory=list)
    tokens: int = 0  # positions stored

    @classmethod
    def read(cls, folder: Path) -> LabelManifest | None:
        path = folder / MANIFEST
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as e:
            raise ForerunError(f"{path} is not a label manifest ({e}): use a new folder for the labels") from e

    def write(self, folder: Path) -> None:
        files.write_json(folder / MANIFEST, asdict(self), indent=1)


@torch.inference_mode()
def label_chunk(target: LoadedModel, tokens: list[int], top_k: int) -> Labels:
    """The target's final hidden state and top-`top_k` next-token distribution at every position
    of `tokens`, from one prefill."""
    decoder = target.decoder
    cfg = decoder.cfg
    if not tokens:
        raise ForerunError("cannot label an empty chunk")
    if len(tokens) > cfg.max_position:
        raise ForerunError(
            f"a chunk of {len(tokens)} tokens is longer than {target.name}'s context ({cfg.max_position}): "
            "use shorter chunks"
        )
    check_top_k(cfg.vocab_size, top_k)
    with linear.prefill():
        # The logits of the last row only; every row's are scored below, a block at a time.
        out = decoder.forward_ids(
            tokens, decoder.new_cache(len(tokens)), last_only=True, output_hidden=True, all_hidden=True
        )
        return every_row_labels(decoder, out.hidden[0], top_k)  # [T, hidden], after the final norm


def check_top_k(vocab_size: int, top_k: int) -> None:
    if not 1 <= top_k <= vocab_size:
        raise ForerunError(f"top-k must be between 1 and the vocabulary size ({vocab_size}), not {top_k}")


def every_row_labels(decoder: Decoder, hidden: torch.Tensor, top_k: int) -> Labels:
    """Labels of rows whose final states `hidden` [T, hidden] are known: the head scores them a
    block at a time."""
    rows = max(1, LOGIT_BYTES // (4 * decoder.cfg.vocab_size))
    top = [top_labels(decoder.lm_head(hidden[a : a + rows]).float(), top_k) for a in range(0, hidden.shape[0], rows)]
    return Labels(hidden.to(torch.bfloat16).cpu(), torch.cat([i for i, _ in top]), torch.cat([p for _, p in top]))


def top_labels(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] float32 -> their top-k ids (int32) and probabilities (float16), on the CPU."""
    top, idx = logits.topk(top_k, dim=-1)  # [rows, k], descending
    return idx.to(torch.int32).cpu(), (top - logits.logsumexp(-1, keepdim=True)).exp().to(torch.float16).cpu()


def make_label_shards(
    target: LoadedModel,
    chunks: Iterable[list[int] | tuple[list[int], Labels]],
    folder: Path,
    top_k: int = TOP_K,
    shard_tokens: int = SHARD_TOKENS,
    budget_tokens: int | None = None,
    budget_seconds: float | None = None,
    progress: bool = True,
    skip_done: bool = True,
) -> LabelManifest:
    """Label the chunks not yet covered by `folder`'s manifest and store them in shards (a chunk
    given as (tokens, labels) was labelled already: an answer labelled as it was written).

    `chunks` must be the same stream on every run (`corpus.token_chunks` is deterministic): a rerun
    skips the first `chunks_done` of it (with `skip_done` False the caller has: the stream starts
    after them, as when making a chunk is costly, e.g. the target's answer to a prompt). Labelling
    stops when the chunks run out, or once `budget_tokens` positions were labelled or
    `budget_seconds` passed in this call; what is pending is written first either way."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = _manifest_for(target, folder, top_k)
    pending: list[tuple[list[int], Labels]] = []
    labelled, began = 0, time.monotonic()
    with tqdm(
        total=budget_tokens,
        desc=f"labelling chunks with {target.name}"
        + (f" (resuming after {manifest.chunks_done})" if manifest.chunks_done else ""),
        unit="tok",
        unit_scale=True,
        file=sys.stderr,
        disable=not progress,
    ) as bar:
        stream = iter(chunks)
        if skip_done and manifest.chunks_done:  # the stream's first chunks must be the ones labelled
            done = itertools.islice(stream, manifest.chunks_done)
            check_stored(folder, manifest, (c[0] if isinstance(c, tuple) else c for c in done), "other text")
        for chunk in stream:
            tokens, labels = chunk if isinstance(chunk, tuple) else (chunk, label_chunk(target, chunk, top_k))
            if labels.top_ids.shape != (len(tokens), top_k) or labels.hidden.shape[0] != len(tokens):
                raise ValueError(f"labels {tuple(labels.top_ids.shape)} for {len(tokens)} tokens at top-k {top_k}")
            pending.append((tokens, labels))
            labelled += len(tokens)
            bar.update(len(tokens))
            if sum(len(t) for t, _ in pending) >= shard_tokens:
                _flush(folder, manifest, pending)
                pending = []
            if (budget_tokens is not None and labelled >= budget_tokens) or (
                budget_seconds is not None and time.monotonic() - began >= budget_seconds
            ):
                break
    if pending:
        _flush(folder, manifest, pending)
    return manifest


def stored_tokens(folder: Path, manifest: LabelManifest) -> Iterator[list[int]]:
    """The token ids of every stored chunk, in order (the shards' labels left unread)."""
    from safetensors import SafetensorError, safe_open

    for name in manifest.shards:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                tokens, starts = f.get_tensor("tokens").tolist(), f.get_tensor("starts").tolist()
        except (SafetensorError, OSError) as exc:
            raise ForerunError(
                f"{folder / name} is damaged or cut short ({exc}): remove {folder} to label again"
            ) from None
        for a, b in itertools.pairwise(starts):
            yield tokens[a:b]


def check_stored(
    folder: Path, manifest: LabelManifest, expected: Iterable[list[int]], what: str, prefix: bool = False
) -> None:
    """A clear error unless the stored chunks are `expected` (with `prefix`: begin with them), one
    for one: a rerun goes on only from labels of what it would label itself."""
    stored, seen = stored_tokens(folder, manifest), 0
    for want in expected:
        have, seen = next(stored, None), seen + 1
        if have is None or (have[: len(want)] if prefix else have) != want:
            break
    else:
        if seen == manifest.chunks_done:
            return
        seen += 1  # the text ran out before the labels did
    raise ForerunError(
        f"{folder} holds labels of {what} than this run's (its chunk {seen} differs): use another --data "
        f"(or --out), or remove {folder} to label afresh"
    )


def _manifest_for(target: LoadedModel, folder: Path, top_k: int) -> LabelManifest:
    """The folder's manifest, or a new one; labels of another target or top-k are refused (a head
    trained on a mix would learn neither)."""
    cfg = target.decoder.cfg
    manifest = LabelManifest.read(folder)
    if manifest is None:
        return LabelManifest(target.name, top_k, cfg.hidden_size, cfg.vocab_size)
    if manifest.top_k != top_k or manifest.target != target.name:
        raise ForerunError(
            f"{folder} holds labels of {manifest.target} with top-k {manifest.top_k}, not of {target.name} "
            f"with top-k {top_k}: use a new folder (or the same target and top-k to resume)"
        )
    return manifest


def _flush(folder: Path, manifest: LabelManifest, pending: list[tuple[list[int], Labels]]) -> None:
    starts = [0]
    for tokens, _ in pending:
        starts.append(starts[-1] + len(tokens))
    name = f"labels-{len(manifest.shards):05d}.safetensors"
    tensors = {
        "tokens": torch.tensor([t for tokens, _ in pending for t in tokens], dtype=torch.int32),
        "hidden": torch.cat([lab.hidden for _, lab in pending]).contiguous(),
        "top_ids": torch.cat([lab.top_ids for _, lab in pending]).contiguous(),
        "top_probs": torch.cat([lab.top_probs for _, lab in pending]).contiguous(),
        "starts": torch.tensor(starts, dtype=torch.int64),
    }
    files.save_tensors(folder / name, tensors)  # before the manifest names it: a crash between redoes it
    manifest.shards.append(name)
    manifest.chunks_done += len(pending)
    manifest.tokens += starts[-1]
    manifest.write(folder)


def read_labels(folder: Path) -> Iterator[LabeledChunk]:
    """Every stored chunk in order, shard by shard (one shard in memory at a time)."""
    manifest = LabelManifest.read(folder)
    if manifest is None:
        raise ForerunError(f"no {MANIFEST} in {folder}: label a corpus into it first")
    for name in manifest.shards:
        shard = files.load_tensors(folder / name, f"remove {folder} to label again")
        starts = shard["starts"].tolist()
        for a, b in itertools.pairwise(starts):
            yield LabeledChunk(
                shard["tokens"][a:b], shard["hidden"][a:b], shard["top_ids"][a:b], shard["top_probs"][a:b]
            )


def soft_targets(top_ids: torch.Tensor, top_probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The dense float32 distribution [..., vocab] of top-k labels `top_ids`, `top_probs` [..., k].

    The top-k probabilities are renormalized to sum to 1 and every other token gets 0: the tail's
    mass is dropped rather than spread, because a head is judged on the top of the distribution
    (whether its guesses are the tokens the target would pick), and a uniform tail would only
    teach it noise over tokens the target almost never emits."""
    probs = top_probs.float()
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
    dense = torch.zeros(*probs.shape[:-1], vocab_size, dtype=torch.float32, device=probs.device)
    return dense.scatter_(-1, top_ids.long(), probs)
