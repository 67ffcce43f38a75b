"""Self-distilled training data for draft heads, in safetensors shards.

The target answers each prompt (greedy, several prompts per pass: on a CPU through the continuous-
batching engine, whose rows are nearly free on the fast formats; on a GPU as padded rows of one
batch), then reads prompt + answer in one pass, and its
final hidden state at every position is kept beside the tokens. A head learns the target's own
continuations from the target's own features. Shards hold whole sequences:

    tokens  int32 [T]           every sequence's prompt and answer, one after another
    hidden  bfloat16 [T, hidden] the target's final hidden state at each position
    starts  int64 [S + 1]       where each sequence begins (and the end)
    answers int64 [S]           where each sequence's answer begins (absolute index into tokens)

A manifest (`manifest.json`) lists the finished shards and how many prompts they cover, so an
interrupted run resumes at the next prompt.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from forerun.base import files
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import Engine, check_prompt_fits
from forerun.models import linear
from forerun.models.decoder import Decoder
from forerun.models.load import LoadedModel

MANIFEST = "manifest.json"
SHARD_TOKENS = 1 << 16  # a shard is written once it holds this many positions
BATCH = 8  # prompts answered together by default: a CPU's pass costs nearly the same to about 8 rows
PADDED_BATCH = 64  # on a GPU (padded rows of one batch): its step is bound by kernel launches, not rows
PADDED_PREFILL = 256  # prompt positions a padded batch reads at a time: its mask is [B, 256, slots], not [B, T, T]


@dataclass
class Sequence:
    tokens: list[int]  # prompt + answer
    answer: int  # index of the answer's first token


@dataclass
class Manifest:
    prompts_done: int = 0
    shards: list[str] = field(default_factory=list)
    tokens: int = 0  # positions stored
    answer_tokens: int = 0  # of which the target wrote
    # What the answers were made from, so that a rerun never mixes in another model's answers or
    # other prompts' ("": a manifest of an older forerun, which did not say).
    target: str = ""  # the target's checksum (heads.target_checksum)
    max_tokens: int = 0
    prompts_sha256: str = ""  # of the prompts answered so far (prompts_digest)

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise ForerunError(
                f"{path} is not a manifest of answers, damaged ({exc}): remove {folder} to answer the prompts again"
            ) from None

    def write(self, folder: Path) -> None:
        files.write_json(folder / MANIFEST, self.__dict__, indent=1)

    def check_made_from(self, folder: Path, target: str, prompts: list[list[int]], max_tokens: int) -> None:
        """A clear error where the stored answers are another target's, another length's, or not
        answers to the first of `prompts`: a run goes on only from answers it would have written."""
        if not self.prompts_done or not self.target:
            return
        remedy = f"pass another --data (or --out), or remove {folder} to answer afresh"
        if self.target != target:
            raise ForerunError(f"{folder} holds another model's answers (checksum {self.target}): {remedy}")
        if self.max_tokens != max_tokens:
            raise ForerunError(
                f"{folder} holds answers of up to {self.max_tokens} tokens, not --max-tokens {max_tokens}: {remedy}"
            )
        if len(prompts) < self.prompts_done:
            raise ForerunError(
                f"{folder} holds answers to {self.prompts_done} prompts, more than the {len(prompts)} given: {remedy}"
            )
        if prompts_digest(prompts[: self.prompts_done]) != self.prompts_sha256:
            raise ForerunError(f"{folder} holds answers to other prompts than these: {remedy}")


def prompts_digest(prompts: list[list[int]]) -> str:
    """sha256 of prompts' token ids, in order."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def answer_prompts(
    target: LoadedModel, prompts: list[list[int]], max_tokens: int, batch_size: int = BATCH
) -> Iterator[Sequence]:
    """The target's greedy answers, `batch_size` prompts stepped together, yielded in prompt order:
    on a CPU as the engine's lanes (`engine_answers`), elsewhere as padded rows (`padded_answers`)."""
    if not steps_padded(target.decoder):
        yield from engine_answers(target, prompts, max_tokens, batch_size)
        return
    check_answerable(target, prompts, max_tokens)
    stop_ids = target.tokenizer.stop_ids if target.tokenizer is not None else frozenset()
    for first in range(0, len(prompts), batch_size):
        group = prompts[first : first + batch_size]
        for ids, answer in zip(group, padded_answers(target.decoder, group, max_tokens, stop_ids)):
            yield Sequence(ids + answer, len(ids))


def steps_padded(decoder: Decoder) -> bool:
    """Whether answers are written as padded rows of one batch: on a GPU, where the engine's lanes
    attend sequence by sequence, op by op, a kernel launch each (110-156 tokens a second at 64
    lanes on an H200 against 1,698 as padded rows, benchmark-log run 113). A CPU keeps the lanes:
    each answer exactly the one its prompt gets alone."""
    return decoder.device.type != "cpu"


def check_answerable(target: LoadedModel, prompts: list[list[int]], max_tokens: int) -> None:
    """A clear error before any work for an empty prompt or one whose answer would outrun the
    context, as the engine checks a request (`check_prompt_fits`)."""
    for ids in prompts:
        check_prompt_fits(target.decoder.cfg.max_position, ids, max_tokens)


def engine_answers(
    target: LoadedModel, prompts: list[list[int]], max_tokens: int, batch_size: int
) -> Iterator[Sequence]:
    """`answer_prompts` through the continuous-batching engine: each answer is the one its prompt
    gets alone, however many step together."""
    params = SamplingParams(max_tokens=max_tokens)
    batch = BatchEngine(lambda: Engine(target), max_seqs=batch_size)
    for first in range(0, len(prompts), batch_size):
        group = prompts[first : first + batch_size]
        answers: dict[int, list[int]] = {}
        for i, ids in enumerate(group):
            answers[i] = list(batch.add(i, ids, params).token_ids)
        while any(not batch.lanes[i].run.seq.finished for i in answers):
            for i, result in batch.step().items():
                if result.error is not None:
                    raise result.error
                answers[i] += result.output.token_ids
        for i, ids in enumerate(group):
            batch.remove(i)
            yield Sequence(ids + answers[i], len(ids))


@torch.inference_mode()
def padded_answers(
    decoder: Decoder, group: list[list[int]], max_tokens: int, stop_ids: frozenset[int]
) -> list[list[int]]:
    """Greedy answers of several non-empty prompts as the rows of one batch: each prompt left-padded
    to the longest, every row's attention masked to its own slots (a padding slot sees only
    itself, so no row's softmax is empty), the prompts read PADDED_PREFILL positions at a time. An
    answer ends at a stop token (kept, as the engine keeps it) or at `max_tokens`. The sums are not
    those of a prompt alone, so a near tie can go the other way: fit for training data, not for
    verification."""
    device, b, longest = decoder.device, len(group), max(map(len, group))
    slot = torch.arange(longest + max_tokens, device=device)
    offsets = torch.tensor([longest - len(ids) for ids in group], device=device)  # [B]
    valid = slot[None, :] >= offsets[:, None]  # [B, slots]: False on a row's padding
    tokens = torch.zeros(b, longest, dtype=torch.long)
    for row, ids in enumerate(group):
        tokens[row, longest - len(ids) :] = torch.tensor(ids)
    tokens, positions = tokens.to(device), (slot[None, :longest] - offsets[:, None]).clamp_(min=0)
    cache = decoder.new_cache(longest + max_tokens, batch=b)
    for a in range(0, longest, PADDED_PREFILL):
        z = min(a + PADDED_PREFILL, longest)
        causal = slot[a:z, None] >= slot[None, :z]  # [t, z]: the rows a..z-1 over every slot so far
        own = slot[a:z, None] == slot[None, :z]
        mask = (causal[None] & valid[:, None, :z]) | own[None]  # [B, t, z]
        logits = decoder(tokens[:, a:z], positions[:, a:z], cache, attention_mask=mask, last_only=True).logits
    answers: list[list[int]] = [[] for _ in group]
    live = set(range(b))
    for step in range(max_tokens):
        chosen = logits[:, -1].argmax(-1)
        for row, token in enumerate(chosen.tolist()):
            if row in live:
                answers[row].append(token)
                if token in stop_ids:
                    live.discard(row)
        if not live or step == max_tokens - 1:
            break
        end = longest + step + 1  # slots the next rows see, their own included
        positions = (end - 1 - offsets)[:, None]
        logits = decoder(chosen[:, None], positions, cache, attention_mask=valid[:, None, :end], last_only=True).logits
    return answers


@torch.inference_mode()
def features_of(target: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden state at every position of `tokens`: [T, hidden] bfloat16."""
    decoder = target.decoder
    cache = decoder.new_cache(len(tokens))
    with linear.prefill():
        out = decoder.forward_ids(tokens, cache, last_only=True, output_hidden=True, all_hidden=True)
    return out.hidden[0].to(torch.bfloat16).cpu()


def make_shards(
    target: LoadedModel,
    prompts: list[list[int]],
    folder: Path,
    max_tokens: int,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool = True,
    batch_size: int = BATCH,
) -> Manifest:
    """Answer the prompts not yet covered by `folder`'s manifest and store their features (the
    answers there must be the target's to the first of `prompts`, at `max_tokens`)."""
    from forerun.heads import target_checksum

    files.make_folder(folder, "the answers' folder")
    manifest = Manifest.read(folder)
    checksum = target_checksum(target)
    manifest.check_made_from(folder, checksum, prompts, max_tokens)
    if not manifest.prompts_done:
        manifest.target, manifest.max_tokens = checksum, max_tokens
    todo = prompts[manifest.prompts_done :]
    pending: list[tuple[Sequence, torch.Tensor]] = []
    with tqdm(
        total=len(prompts),
        initial=manifest.prompts_done,
        desc="answering prompts (self-distillation)",
        unit="prompt",
        file=sys.stderr,
        disable=not progress,
    ) as bar:
        for seq in answer_prompts(target, todo, max_tokens, batch_size):
            pending.append((seq, features_of(target, seq.tokens)))
            bar.update(1)
            if sum(len(s.tokens) for s, _ in pending) >= shard_tokens:
                _flush(folder, manifest, pending, prompts)
                pending = []
    if pending:
        _flush(folder, manifest, pending, prompts)
    return manifest


def _flush(
    folder: Path, manifest: Manifest, pending: list[tuple[Sequence, torch.Tensor]], prompts: list[list[int]]
) -> None:
    starts, answers, total = [0], [], 0
    for seq, _ in pending:
        answers.append(total + seq.answer)
        total += len(seq.tokens)
        starts.append(total)
    name = f"shard-{len(manifest.shards):05d}.safetensors"
    tensors = {
        "tokens": torch.tensor([t for seq, _ in pending for t in seq.tokens], dtype=torch.int32),
        "hidden": torch.cat([h for _, h in pending]).contiguous(),
        "starts": torch.tensor(starts, dtype=torch.int64),
        "answers": torch.tensor(answers, dtype=torch.int64),
    }
    files.save_tensors(folder / name, tensors)
    manifest.shards.append(name)
    manifest.prompts_done += len(pending)
    manifest.tokens += total
    manifest.answer_tokens += sum(len(seq.tokens) - seq.answer for seq, _ in pending)
    if manifest.target:  # (an older manifest's answers are not vouched for)
        manifest.prompts_sha256 = prompts_digest(prompts[: manifest.prompts_done])
    manifest.write(folder)


@dataclass
class Example:
    tokens: torch.Tensor  # int64 [T]
    hidden: torch.Tensor  # float32 [T, hidden]
    answer: int  # index of the answer's first token


def read_examples(folder: Path, order: list[int] | None = None) -> Iterator[Example]:
    """Every stored sequence, shard by shard (one shard in memory at a time); `order` permutes the
    sequences within each shard (a seeded shuffle per epoch)."""
    for name in Manifest.read(folder).shards:
        shard = files.load_tensors(folder / name, f"remove {folder} to answer the prompts again")
        starts, answers = shard["starts"].tolist(), shard["answers"].tolist()
        count = len(answers)
        for i in order_within(order, count) if order is not None else range(count):
            a, b = starts[i], starts[i + 1]
            yield Example(shard["tokens"][a:b].long(), shard["hidden"][a:b].float(), answers[i] - a)


def order_within(order: list[int], count: int) -> list[int]:
    """The permutation `order` (of any length) cut down to indices below `count`, order kept."""
    return [i for i in order if i < count] + [i for i in range(count) if i >= len(order)]


def count_sequences(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for name in Manifest.read(folder).shards:
        with safe_open(str(folder / name), framework="pt") as f:
            total += f.get_slice("answers").get_shape()[0]
    return total
