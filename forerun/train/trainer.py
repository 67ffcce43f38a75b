"""Training a draft head on self-distilled shards or soft labels: losses, the loop, checkpoints and curves.

Hard labels (self-distilled shards, `data.py`), on the answer positions only (where the target
wrote the text, so the next token is the target's own greedy choice); the prompt is context:
- Medusa: head i at position t is trained to the token at t+1+i (cross-entropy over the draft
  vocabulary; tokens outside it are skipped).
- EAGLE (Li et al.): row t reads (embed(x_{t+1}), f_t + noise) and predicts f_{t+1}: smooth-L1 to
  the target's feature, plus 0.1 x the cross-entropy of its projection against x_{t+2}.

Soft labels (`TrainConfig.soft`: label shards of corpus text, `soft_labels.py`), on every position:
the KL from the target's top-k distribution to the head's over the draft vocabulary, in
`soft_losses.py`. Medusa head i at position t learns the label stored at position t+i (the target's
distribution of token t+1+i given the true text up to t+i: labels exist for the next token only);
EAGLE's row t learns f_{t+1} (smooth-L1) plus 1.0 x the KL of its projection to the label at t+1
(the distribution of x_{t+2}): the distribution is the point, so it weighs as much as the feature.

EAGLE trains for the test it faces (`TrainConfig.unroll` steps, `EagleHead.forward_unrolled`): from
the second step on the head reads its own predicted features, as when it drafts, and each row of
step j learns the same targets as in step 1 (the loss of step j weighs 0.8^(j-1)).

With held-out answers (`held_out.py`), the head drafts on them at the start, at every checkpoint
and at the end of every epoch: the share of greedy chains kept through each depth, in the progress
bar, the checkpoint's history and the curves.

A checkpoint (weights, optimizer, position in the data, curves, random state) is written every few
minutes and at the end of each epoch; `resume` continues from it exactly where it stopped.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from forerun.base import files
from forerun.base.errors import ForerunError
from forerun.train.data import Example, count_sequences, read_examples
from forerun.train.held_out import HeldOutSequence, chain_acceptance
from forerun.train.soft_losses import (
    SoftExample,
    count_chunks,
    eagle_soft_loss,
    medusa_soft_loss,
    read_soft_examples,
    step_weighted,
    top1_agreement,
)

CHECKPOINT = "checkpoint"
TOKEN_WEIGHT = 0.1  # EAGLE: the token loss beside the feature regression
SOFT_TOKEN_WEIGHT = 1.0  # EAGLE on soft labels: the target's distribution is what the head is for
NOISE = 0.1  # EAGLE: uniform noise on the input features (robustness to its own predictions)
MAX_SEQUENCE = 1024  # EAGLE: the longest sequence trained at once (the answer end is kept)


@dataclass
class TrainConfig:
    method: str  # "medusa" or "eagle"
    epochs: int = 2
    lr: float = 1e-3
    seed: int = 0
    checkpoint_every_s: float = 300.0
    batch_rows: int = 512  # Medusa: positions per optimizer step (EAGLE: one sequence per step)
    soft: bool = False  # the data is label folders (soft_labels.py), not self-distilled shards
    unroll: int = 1  # EAGLE: draft steps trained at once, from the second on fed its own features
    max_seconds: float | None = None  # stop after the step that passes this much training time in all
    bf16: bool = False  # the step's products in bfloat16 (autocast; the weights and the optimizer stay float32)


@dataclass
class History:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    accuracy: list[list[float]] = field(default_factory=list)  # per logged step, top-1 per head (EAGLE: per step)
    eval_steps: list[int] = field(default_factory=list)  # when the held-out answers were drafted on
    eval_kept: list[list[float]] = field(default_factory=list)  # then: chains kept through each depth


@dataclass
class Progress:
    epoch: int = 0
    sequence: int = 0  # sequences (soft labels: chunks) of this epoch already trained
    step: int = 0  # optimizer steps in all
    seconds: float = 0.0  # training time in all, resumed runs included


class Trainer:
    def __init__(
        self,
        head: nn.Module,
        config: TrainConfig,
        data: Path | list[Path],
        out: Path,
        embed: nn.Module | None = None,
        held_out: list[HeldOutSequence] | None = None,
    ) -> None:
        """`data`: a folder of self-distilled shards, or (soft) one or more label folders. `embed`:
        the target's token embedding (EAGLE reads it, never trains it). `held_out`: answers the head
        drafts on at every checkpoint (`held_out.py`), for acceptance per depth."""
        self.head, self.config, self.data, self.out, self.embed = head, config, data, out, embed
        self.held_out = held_out
        self.device = next(head.parameters()).device
        self.vocab = head.vocab  # [N] token ids
        # token id -> column of the draft vocabulary, -100 (skipped) outside it
        self.column = torch.full((int(self.vocab.max()) + 1,), -100, dtype=torch.long, device=self.vocab.device)
        self.column[self.vocab] = torch.arange(len(self.vocab), device=self.vocab.device)
        params = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
        self.history, self.progress = History(), Progress()
        self.sequences = count_chunks(data) if config.soft else count_sequences(data)

    # --- the loop ---------------------------------------------------------------------------------

    def run(self, resume: bool = False, progress: bool = True, max_steps: int | None = None) -> History:
        if resume and not self.load_checkpoint():
            print(
                f"forerun: no checkpoint in {self.checkpoint_dir()} to resume; training from the start", file=sys.stderr
            )
        if not self.history.eval_steps:
            self._evaluate()  # the untrained head: where the curves start
        last_save = time.monotonic()
        total = self.config.epochs * self.sequences
        bar = tqdm(
            total=total,
            initial=self.progress.epoch * self.sequences + self.progress.sequence,
            desc=f"training {self.config.method}",
            unit="seq",
            file=sys.stderr,
            disable=not progress,
        )
        try:
            while self.progress.epoch < self.config.epochs:
                order = self._order(self.progress.epoch)
                pending: list[Example | SoftExample] = []
                for index, example in enumerate(self._read(order)):
                    if index < self.progress.sequence:
                        continue  # trained before the interruption
                    pending.append(example)
                    if self.config.method == "eagle" or self._rows(pending) >= self.config.batch_rows:
                        self._train_on(pending, bar)
                        self.progress.sequence = index + 1
                        pending = []
                        if time.monotonic() - last_save >= self.config.checkpoint_every_s:
                            self._measure_and_save()
                            last_save = time.monotonic()
                        if max_steps is not None and self.progress.step >= max_steps:
                            return self.history
                        if self._out_of_time():
                            self._measure_and_save()
                            return self.history
                if pending:
                    self._train_on(pending, bar)
                self.progress.epoch += 1
                self.progress.sequence = 0
                self._measure_and_save()
                last_save = time.monotonic()
        finally:
            bar.close()
        return self.history

    def _out_of_time(self) -> bool:
        return self.config.max_seconds is not None and self.progress.seconds >= self.config.max_seconds

    def _train_on(self, pending: list, bar: tqdm) -> None:
        started = time.perf_counter()
        loss, accuracy = self._step(pending)
        self.progress.seconds += time.perf_counter() - started
        self._log(loss, accuracy)
        bar.update(len(pending))
        postfix = {"loss": f"{loss:.3f}", "top1": "/".join(f"{a:.2f}" for a in accuracy)}
        if self.history.eval_kept:
            postfix["held-out kept"] = "/".join(f"{k:.2f}" for k in self.history.eval_kept[-1])
        bar.set_postfix(postfix)

    def _evaluate(self) -> None:
        """Draft on the held-out answers: the share of chains kept through each depth, logged
        (once a step)."""
        if not self.held_out or (self.history.eval_steps and self.history.eval_steps[-1] == self.progress.step):
            return
        acceptance = chain_acceptance(self.head, self.config.method, self.held_out, self.column, self.embed)
        self.history.eval_steps.append(self.progress.step)
        self.history.eval_kept.append([round(k, 4) for k in acceptance.kept])

    def _measure_and_save(self) -> None:
        """The held-out measure, then a checkpoint that holds it in its history."""
        self._evaluate()
        self.save_checkpoint()

    def _read(self, order: list[int]) -> Iterator[Example | SoftExample]:
        return read_soft_examples(self.data, order) if self.config.soft else read_examples(self.data, order)

    def _rows(self, pending: list) -> int:
        """Positions that train in `pending` (hard labels: the answers; soft labels: everything)."""
        if self.config.soft:
            return sum(len(e.tokens) for e in pending)
        return sum(len(e.tokens) - e.answer for e in pending)

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.sequences))
        random.Random(self.config.seed * 1000 + epoch).shuffle(order)
        return order

    def _log(self, loss: float, accuracy: list[float]) -> None:
        self.progress.step += 1
        self.history.steps.append(self.progress.step)
        self.history.loss.append(loss)
        self.history.accuracy.append(accuracy)

    def _step(self, examples: list) -> tuple[float, list[float]]:
        self.head.train()
        if self.config.soft:
            examples = [e.to(self.device) for e in examples]
            losses = self._medusa_soft_loss if self.config.method == "medusa" else self._eagle_soft_loss
        else:
            examples = [Example(e.tokens.to(self.device), e.hidden.to(self.device), e.answer) for e in examples]
            losses = self._medusa_loss if self.config.method == "medusa" else self._eagle_loss
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.bf16):
            loss, accuracy = losses(examples)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optimizer.step()
        return float(loss.detach()), accuracy

    # --- losses -----------------------------------------------------------------------------------

    def _labels(self, tokens: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary columns of `tokens`, -100 where a token is outside it."""
        inside = tokens < len(self.column)
        return torch.where(inside, self.column[tokens.clamp(max=len(self.column) - 1)], torch.full_like(tokens, -100))

    def _medusa_loss(self, examples: list[Example]) -> tuple[torch.Tensor, list[float]]:
        heads = self.head.num_heads
        features, labels = [], []
        for e in examples:
            t = len(e.tokens)
            # Position p (from the token before the answer on) predicts token p+1+i with head i.
            rows = torch.arange(max(e.answer - 1, 0), t - 2, device=self.device)
            if len(rows) == 0:
                continue
            features.append(e.hidden[rows])
            targets = torch.stack([e.tokens[(rows + 1 + i).clamp(max=t - 1)] for i in range(1, heads + 1)])  # [H, R]
            beyond = torch.stack([rows + 1 + i >= t for i in range(1, heads + 1)])
            labels.append(self._labels(targets).masked_fill(beyond, -100))
        if not features:
            return torch.zeros((), requires_grad=True, device=self.device), [0.0] * heads
        logits = self.head(torch.cat(features))  # [H, R, N]
        target = torch.cat(labels, dim=1)  # [H, R]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)
        return loss, top1_agreement(logits, target)

    def _eagle_loss(self, examples: list[Example]) -> tuple[torch.Tensor, list[float]]:
        total, accuracies = torch.zeros((), device=self.device), []
        for e in examples:
            tokens, hidden, answer = e.tokens, e.hidden, e.answer
            if len(tokens) > MAX_SEQUENCE:
                cut = len(tokens) - MAX_SEQUENCE
                tokens, hidden, answer = tokens[cut:], hidden[cut:], max(answer - cut, 1)
            t = len(tokens)
            if t < self.config.unroll + 2:
                continue
            with torch.no_grad():
                embeds = self.embed(tokens[1:]).float()  # row j: embed(x_{j+1})
            noisy = hidden[:-1] + (torch.rand_like(hidden[:-1]) * 2 - 1) * NOISE  # row j: f_j
            losses, agreement = [], []
            for step, predicted in enumerate(self.head.forward_unrolled(embeds, noisy, self.config.unroll), 1):
                # Rows whose prediction falls in the answer (f̂_{j+1} with j+1 >= answer - 1) and that
                # have a chain of this many steps.
                rows = torch.arange(max(answer - 2, step - 1), t - 1, device=self.device)
                feature_loss = F.smooth_l1_loss(predicted[rows].float(), hidden[rows + 1].float())
                logits = self.head.logits(predicted[rows[:-1]])  # scores x_{j+2}
                target = self._labels(tokens[rows[:-1] + 2])
                token_loss = F.cross_entropy(logits.float(), target, ignore_index=-100) if (target >= 0).any() else 0.0
                losses.append(feature_loss + TOKEN_WEIGHT * token_loss)
                agreement += top1_agreement(logits[None], target[None])
            total = total + step_weighted(losses)
            accuracies.append(agreement)
        return self._mean_over(total, accuracies)

    def _medusa_soft_loss(self, examples: list[SoftExample]) -> tuple[torch.Tensor, list[float]]:
        out = medusa_soft_loss(self.head, examples, self.column)
        if out is None:
            return torch.zeros((), requires_grad=True, device=self.device), [0.0] * self.head.num_heads
        loss, logits, top1 = out  # top1 [H, R]: the target's top-1 per head's position
        return loss, top1_agreement(logits, top1)

    def _eagle_soft_loss(self, examples: list[SoftExample]) -> tuple[torch.Tensor, list[float]]:
        total, accuracies = torch.zeros((), device=self.device), []
        for e in examples:
            out = eagle_soft_loss(
                self.head, self.embed, e.tail(MAX_SEQUENCE), self.column, NOISE, SOFT_TOKEN_WEIGHT, self.config.unroll
            )
            if out is None:
                continue
            total = total + out[0]
            accuracies.append(out[1])
        return self._mean_over(total, accuracies)

    def _mean_over(self, total: torch.Tensor, accuracies: list[list[float]]) -> tuple[torch.Tensor, list[float]]:
        """EAGLE: the loss and top-1 agreement per unrolled step, averaged over the sequences that trained."""
        if not accuracies:
            return torch.zeros((), requires_grad=True, device=self.device), [0.0] * self.config.unroll
        return total / len(accuracies), [sum(a) / len(accuracies) for a in zip(*accuracies)]

    # --- checkpoints --------------------------------------------------------------------------------

    def checkpoint_dir(self) -> Path:
        return self.out / CHECKPOINT

    def save_checkpoint(self) -> None:
        folder = self.checkpoint_dir()
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"head.{k}": v.detach().contiguous() for k, v in self.head.state_dict().items()}
        state = self.optimizer.state_dict()
        scalars: dict = {"param_groups": state["param_groups"], "state": {}}
        for index, values in state["state"].items():
            scalars["state"][str(index)] = {}
            for name, value in values.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"optim.{index}.{name}"] = value.contiguous()
                else:
                    scalars["state"][str(index)][name] = float(value)
        meta = {
            "optimizer": scalars,
            "progress": self.progress.__dict__,
            "history": self.history.__dict__,
            "torch_rng": torch.get_rng_state().tolist(),
            "labels": "soft" if self.config.soft else "hard",
        }
        files.save_tensors(folder / "weights.safetensors", tensors)
        files.write_json(folder / "state.json", meta)

    def load_checkpoint(self) -> bool:
        """Continue from the checkpoint in `out`, if there is one; True when one was loaded. A
        damaged checkpoint, or one of another head or other settings, is a clear error."""
        folder = self.checkpoint_dir()
        if not (folder / "state.json").is_file() or not (folder / "weights.safetensors").is_file():
            return False
        remedy = f"remove {folder} to train afresh, or pick another --out"
        tensors = files.load_tensors(folder / "weights.safetensors", remedy)
        try:
            meta = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ForerunError(f"{folder / 'state.json'} cannot be read ({exc}): {remedy}") from None
        labels = "soft" if self.config.soft else "hard"
        if meta.get("labels", "hard") != labels:
            raise ForerunError(
                f"the checkpoint in {folder} was trained on {meta.get('labels', 'hard')} labels, this run trains on "
                f"{labels} labels: resume it with the same data (--corpus or not), or pick another --out"
            )
        try:
            self._restore(tensors, meta)
        except (RuntimeError, KeyError, TypeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0]
            raise ForerunError(
                f"the checkpoint in {folder} is of another head or other settings (--method, --heads, --draft-vocab, "
                f"--intermediate-size) or damaged ({first}): resume with the settings it was made with, or {remedy}"
            ) from None
        return True

    def _restore(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """The head, optimizer, progress, history and random state a checkpoint holds."""
        self.head.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("head.")})
        scalars = meta["optimizer"]
        state = {}
        for index, values in scalars["state"].items():
            entry = {name: torch.tensor(value) for name, value in values.items()}
            for key, value in tensors.items():
                if key.startswith(f"optim.{index}."):
                    entry[key.split(".", 2)[2]] = value
            state[int(index)] = entry
        self.optimizer.load_state_dict({"state": state, "param_groups": scalars["param_groups"]})
        self.progress = Progress(**meta["progress"])
        self.history = History(**meta["history"])
        torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))


def plot_history(history: History, path: Path, title: str, method: str = "medusa") -> None:
    """Loss, top-1 agreement per head (EAGLE: per draft step) on the training batches, and the
    held-out chains kept through each depth, against optimizer steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if history.eval_kept else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    left, middle = axes[0], axes[1]
    left.plot(history.steps, history.loss, linewidth=0.8)
    left.set_xlabel("optimizer step")
    left.set_ylabel("loss")
    left.set_title("training loss")
    name = "step" if method == "eagle" else "head"
    heads = len(history.accuracy[0]) if history.accuracy else 0
    for i in range(heads):
        middle.plot(history.steps, [a[i] for a in history.accuracy], linewidth=0.8, label=f"{name} {i + 1}")
    _axis(middle, "top-1 agreement (training batch)", "agreement with the target", heads)
    if history.eval_kept:
        right = axes[2]
        for j in range(len(history.eval_kept[0])):
            right.plot(history.eval_steps, [k[j] for k in history.eval_kept], marker="o", label=f"depth {j + 1}")
        _axis(right, "chains kept through depth", "held-out answers (greedy chain)", len(history.eval_kept[0]))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _axis(axis, ylabel: str, title: str, lines: int) -> None:
    axis.set_xlabel("optimizer step")
    axis.set_ylabel(ylabel)
    axis.set_ylim(0, 1)
    axis.set_title(title)
    if lines:
        axis.legend(fontsize="small")
