"""`forerun train`: a Medusa or EAGLE draft head for a target, from its own answers or from corpus text.

1. The target answers the training prompts (greedy, on its fast format, several at once) and
   reads each prompt + answer again; its hidden states are stored as safetensors shards in
   OUT/data (resumable).
2. The head trains on them (progress bar with loss and top-1 accuracy per head; a checkpoint in
   OUT/checkpoint every few minutes; `--resume` continues from it).
3. OUT holds the head (config.json naming the target's checksum, head.safetensors) and curves.png.

`--data DIR` puts the shards elsewhere, so a Medusa and an EAGLE head of one target share them. A
rerun goes on from stored answers or labels only when they are this target's answers to the same
prompts at the same --max-tokens, or labels of the same text; otherwise it says so and stops.

`--code-prompts PATH [PATH ...]` makes coding prompts from the documented public functions and
methods of the Python files there ("Write a Python function `wrap(text, width)`: <its docstring's
first paragraph>"), beside the prompts of --prompts when that is given; see forerun/train/code_prompts.py.

With `--prompts spec-bench` (the default), the first `--hold-out` prompts of every category are never trained on:
`forerun bench --limit-per-category N` reports on the first N, so with N <= hold-out the two never
overlap. The ids used are written into the head's config.

`--corpus PATH [PATH ...]` (files or folders of text or code) replaces the answers of step 1: the
corpus is read (what was read and skipped is printed as one line), cut into `--chunk-tokens` chunks
with the target's tokenizer (its end-of-text token, the tokenizer's eos, between documents), and the
target labels each chunk in one prefill: its hidden states and top-`--top-k` next-token
distribution at every position, stored in OUT/labels (`--data DIR`: DIR/labels, so heads of one
target share them), resumably. `--budget-tokens` caps the positions labelled in all,
`--budget-minutes` the labelling time of this run. In step 2 the head then learns the target's
distribution at every position (a KL to the labels; see forerun/train/soft_losses.py). With
`--resume` and a checkpoint in OUT, the labels are kept as they are (the checkpoint's place in the
data refers to them). A corpus path that does not exist is an error before the model loads.

`--answers N` adds the target's chat-formatted greedy answers to the first N training prompts,
labelled the same way (prompt and answer, in DIR/answer-labels; a rerun answers only the prompts
not labelled yet), mixed with the corpus through every epoch; without `--corpus` they are the
only data.

EAGLE heads train unrolled (`--unroll`, 3 steps: from the second on the head reads its own
features, as when it drafts), with the projection frozen at the target's LM head rows unless
`--train-projection`. The first `--eval-prompts` training prompts of every category (taken after
the held-out ones) are answered by the target and never trained on: the head drafts greedy chains
on them before training, at each checkpoint and at each epoch's end, and the share kept through
each depth shows in the progress bar, curves.png and the head's config. `--train-minutes` stops
training at a time budget.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from forerun.base import files
from forerun.base.config import SEED_RANGE
from forerun.base.errors import ForerunError
from forerun.base.prompts import SPEC_BENCH
from forerun.commands.common import positive_int
from forerun.models.load import QUANTIZATIONS

if TYPE_CHECKING:
    from collections.abc import Iterator

    from forerun.heads import HeadConfig
    from forerun.models.load import LoadedModel
    from forerun.train.corpus import CorpusReport, Document
    from forerun.train.trainer import Trainer

METHODS = ("medusa", "eagle")
TRAIN_DTYPES = ("auto", "float32", "bfloat16")
DEFAULT_LR = {"medusa": 1e-3, "eagle": 3e-4}
DEFAULT_UNROLL = 3  # eagle: draft steps trained at once
MAX_HEADS = 16  # --heads' most: Medusa's own heads guess 4 or 5 positions


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a Medusa or EAGLE draft head on the target's own answers or its distribution over a corpus",
        description="Self-distil: the target answers the prompts, its hidden states are stored, "
        "and a draft head learns its continuations (with --corpus: the target labels the text with its "
        "next-token distribution, and the head learns that). The result is a folder for "
        "--speculative-head.",
    )
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--model", required=True, help="the target: embedded name, .gguf file, model folder or hub id")
    p.add_argument("--out", required=True, help="folder for the head, its data, checkpoints and curves")
    _register_prompts(p)
    p.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="where the self-distilled shards go (default OUT/data; with --corpus the labels go to DIR/labels, "
        "default OUT/labels); two heads of one target can share them",
    )
    p.add_argument("--max-tokens", type=int, default=192, help="answer length per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="prompts longer than this are left out")
    p.add_argument(
        "--answer-batch",
        type=int,
        default=None,
        help="prompts the target answers together, as rows of one pass (default 8 on a CPU, whose pass costs "
        "nearly the same to about 8 rows; 64 on a GPU, whose step is bound by its kernel launches far beyond that)",
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 1e-3 medusa, 3e-4 eagle)")
    p.add_argument(
        "--draft-vocab", type=positive_int, default=32768, help="tokens the head scores (the target's most chosen)"
    )
    p.add_argument("--heads", type=int, default=4, help=f"medusa: future positions guessed (at most {MAX_HEADS})")
    p.add_argument(
        "--intermediate-size", type=int, default=None, help="eagle: its layer's MLP width (default: the target's)"
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATIONS),
        help="the target's format while it answers and computes features (as generate takes it)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda: where the target answers and labels the data and the head trains (the head "
        "is saved for the CPU either way)",
    )
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    _register_corpus(p)
    _register_test(p)
    p.set_defaults(func=run)


def _register_prompts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompts",
        default=None,
        help="spec-bench (the default without --code-prompts) or a JSONL file with 'prompt' or 'turns'",
    )
    p.add_argument(
        "--code-prompts",
        nargs="+",
        default=None,
        metavar="PATH",
        help="also (without --prompts: only) coding prompts made from the documented public functions and "
        "methods of the Python files under these folders",
    )
    p.add_argument(
        "--hold-out",
        type=int,
        default=10,
        help="spec-bench: the first N prompts of each category are never trained on (bench reports on them)",
    )
    p.add_argument(
        "--num-samples",
        type=int,
        default=None,
        help="train on N prompts, taken from each category in turn (default: all)",
    )


def _register_corpus(p: argparse.ArgumentParser) -> None:
    corpus = p.add_argument_group(
        "soft labels", "learn the target's distribution over text and over its own answers, instead of its tokens"
    )
    corpus.add_argument(
        "--corpus",
        nargs="+",
        default=None,
        metavar="PATH",
        help="files or folders of text or code; the target labels them and the head learns its distribution",
    )
    corpus.add_argument("--chunk-tokens", type=int, default=512, help="tokens per labelled chunk")
    corpus.add_argument("--top-k", type=int, default=20, help="next-token probabilities stored per position")
    corpus.add_argument(
        "--budget-tokens",
        type=int,
        default=None,
        help="label at most N positions in all (in whole chunks: the one that reaches N is kept)",
    )
    corpus.add_argument(
        "--budget-minutes", type=float, default=None, help="label corpus and answers at most M minutes a run"
    )
    corpus.add_argument(
        "--answers",
        type=int,
        default=None,
        metavar="N",
        help="also (without --corpus: only) the target's chat-formatted answers to N training prompts, labelled "
        "like the corpus and mixed with it",
    )


def _register_test(p: argparse.ArgumentParser) -> None:
    train = p.add_argument_group("training for the test")
    train.add_argument(
        "--unroll",
        type=int,
        default=None,
        help="eagle: draft steps trained at once, the head fed its own features after the first (default 3)",
    )
    train.add_argument(
        "--train-projection",
        action="store_true",
        help="eagle: train the projection to the draft vocabulary too (default: it stays the target's LM head rows)",
    )
    train.add_argument(
        "--eval-prompts",
        type=int,
        default=2,
        help="prompts per category the target answers for held-out acceptance per depth during training "
        "(never trained on; 0: none)",
    )
    train.add_argument("--eval-tokens", type=int, default=64, help="answer length of each held-out prompt")
    train.add_argument(
        "--train-minutes",
        type=float,
        default=None,
        help="stop training after M minutes in all (resumed runs included), whatever --epochs says",
    )
    train.add_argument(
        "--train-dtype",
        choices=TRAIN_DTYPES,
        default="auto",
        help="the training step's products: bfloat16 (autocast; weights and optimizer stay float32) or float32; "
        "auto: bfloat16 on a CPU that multiplies it natively (AVX-512 bf16, AMX; a step ran 1.9x faster on a "
        "Zen 4, benchmark-log run 116), else float32",
    )


def run(args: argparse.Namespace) -> int:
    from forerun.heads import save_head
    from forerun.models.load import load_model
    from forerun.train.corpus import CorpusReport, iter_documents
    from forerun.train.trainer import CHECKPOINT, plot_history

    _check(args)
    out = files.make_folder(Path(args.out).expanduser(), "--out")
    if args.data:
        files.make_folder(Path(args.data).expanduser(), "--data")
    if (out / CHECKPOINT).exists() and not args.resume:
        raise ForerunError(
            f"{out} holds a checkpoint of an earlier run: add --resume to continue it, or pick another --out"
        )
    report = CorpusReport()
    # Checks that every corpus path exists now, before the model loads; the files are read later.
    documents = iter_documents(args.corpus, report) if args.corpus else None
    records = _load_prompts(args)  # (a prompts file that cannot be read: an error before the model loads)
    torch.manual_seed(args.seed)
    target = load_model(args.model, args.dtype, device=args.device, quantization=args.quantization)
    if args.answer_batch is None:
        args.answer_batch = default_answer_batch(target.decoder.device)
    if target.tokenizer is None:
        raise ForerunError(f"{args.model} has no tokenizer; training encodes its text with it")
    prompts = split_prompts(args, target, records)
    if documents is None or args.answers:
        _check_prompts_left(args, prompts)
    held_out = _held_out(args, target, out, prompts)
    if documents is not None or args.answers:
        data, record = _soft_labels(args, target, out, documents, report, prompts)
    else:
        data, record = _self_distilled(args, target, out, prompts)
    record["eval_prompt_ids"] = prompts.eval_ids
    config, head = _new_head(args, target)
    trainer = _trainer(args, head, target, data, out, held_out)
    try:
        history = trainer.run(resume=args.resume, progress=args.progress)
    except KeyboardInterrupt:
        saved = trainer.checkpoint_dir()
        where = f"from the last checkpoint in {saved}" if saved.is_dir() else "(no checkpoint was saved yet)"
        print(f"forerun: training interrupted; the same command with --resume continues {where}", file=sys.stderr)
        raise
    last = history.accuracy[-20:]
    accuracy = [round(sum(a[i] for a in last) / len(last), 4) for i in range(len(last[0]))] if last else []
    config.training = {**record, **_training_record(args, trainer, accuracy)}
    save_head(out, config, head.cpu())
    if history.steps:
        plot_history(history, out / "curves.png", f"{args.method} head for {target.name}", args.method)
    held = f"; held-out chain kept per depth {history.eval_kept[-1]}" if history.eval_kept else ""
    print(
        f"forerun: {args.method} head in {out} (top-1 per head over the last steps: {accuracy}{held}); use it "
        f"with --speculative-method {args.method} --speculative-head {out}",
        file=sys.stderr,
    )
    return 0


def _held_out(args: argparse.Namespace, target: LoadedModel, out: Path, prompts: Prompts) -> list | None:
    """The target's answers to the held-out prompts, which the trainer drafts on (cached in OUT)."""
    if not prompts.eval:
        return None
    from forerun.train.held_out import make_held_out

    started = time.perf_counter()
    sequences = make_held_out(target, prompts.eval, args.eval_tokens, out)
    print(
        f"forerun: {len(sequences)} held-out answers for acceptance per depth ({time.perf_counter() - started:.0f} s)",
        file=sys.stderr,
    )
    return sequences


def _self_distilled(args: argparse.Namespace, target: LoadedModel, out: Path, prompts: Prompts) -> tuple[Path, dict]:
    """The target answers the training prompts into shards: (their folder, what to record of them)."""
    from forerun.train.data import make_shards

    data = Path(args.data).expanduser() if args.data else out / "data"
    started = time.perf_counter()
    manifest = make_shards(
        target, prompts.train, data, args.max_tokens, progress=args.progress, batch_size=args.answer_batch
    )
    print(
        f"forerun: {manifest.prompts_done} answers, {manifest.tokens} positions ({manifest.answer_tokens} written "
        f"by the target) in {data}",
        file=sys.stderr,
    )
    return data, {
        **_prompt_record(args, prompts.train_ids),
        "sequences": manifest.prompts_done,
        "positions": manifest.tokens,
        "answer_tokens": manifest.answer_tokens,
        "max_tokens": args.max_tokens,
        "data_minutes": round((time.perf_counter() - started) / 60, 1),
    }


def _prompt_record(args: argparse.Namespace, used: list[str]) -> dict:
    source = _prompt_source(args)
    return {
        "prompts": source,
        "code_prompts": [str(p) for p in args.code_prompts] if args.code_prompts else None,
        "prompt_ids": used,
        "hold_out_per_category": args.hold_out if source == SPEC_BENCH else None,
    }


def _soft_labels(
    args: argparse.Namespace,
    target: LoadedModel,
    out: Path,
    documents: Iterator[Document] | None,
    report: CorpusReport,
    prompts: Prompts,
) -> tuple[list[Path], dict]:
    """Label the corpus (DIR/labels) and the target's answers (DIR/answer-labels), DIR being --data
    or OUT: (the folders to train on, what to record of them)."""
    root = Path(args.data).expanduser() if args.data else out
    folders, record = [], {}
    started = time.perf_counter()
    budget = args.budget_minutes * 60 if args.budget_minutes is not None else None
    if documents is not None:
        folders.append(root / "labels")
        record.update(_corpus_labels(args, target, out, folders[-1], documents, report, budget))
    if args.answers:
        folders.append(root / "answer-labels")
        left = None if budget is None else max(budget - (time.perf_counter() - started), 0.0)
        record.update(_answer_labels(args, target, out, folders[-1], prompts, left))
    record["data_minutes"] = round((time.perf_counter() - started) / 60, 1)
    return folders, record


def _keep_labels(args: argparse.Namespace, out: Path, folder: Path) -> bool:
    """Whether a resumed run trains on `folder` as it is: the checkpoint's place in the data refers to it."""
    from forerun.train.soft_labels import LabelManifest
    from forerun.train.trainer import CHECKPOINT

    if args.resume and (out / CHECKPOINT).exists() and LabelManifest.read(folder) is not None:
        print(f"forerun: resuming training on the labels in {folder} as they are", file=sys.stderr)
        return True
    return False


def _corpus_labels(
    args: argparse.Namespace,
    target: LoadedModel,
    out: Path,
    labels: Path,
    documents: Iterator[Document],
    report: CorpusReport,
    budget_seconds: float | None = None,
) -> dict:
    """The target labels the corpus's chunks into `labels` (for at most `budget_seconds`): what to record of them."""
    from forerun.train.corpus import token_chunks
    from forerun.train.soft_labels import LabelManifest, make_label_shards

    if args.chunk_tokens > target.decoder.cfg.max_position:
        raise ForerunError(
            f"--chunk-tokens {args.chunk_tokens} is longer than {target.name}'s context "
            f"({target.decoder.cfg.max_position}): pass a smaller --chunk-tokens"
        )
    eos = target.tokenizer.hf.eos_token_id
    chunks = token_chunks(
        documents, target.tokenizer.encode, args.chunk_tokens, [int(eos)] if eos is not None else None
    )
    manifest = LabelManifest.read(labels)
    read = False  # whether the corpus was read in this run (the report counts its files then)
    if not _keep_labels(args, out, labels):
        budget = args.budget_tokens - (manifest.tokens if manifest else 0) if args.budget_tokens else None
        if budget is None or budget > 0:
            manifest = make_label_shards(
                target,
                chunks,
                labels,
                args.top_k,
                budget_tokens=budget,
                budget_seconds=budget_seconds,
                progress=args.progress,
            )
            print(f"forerun: corpus: {report.line()}", file=sys.stderr)
            read = True
    if manifest is None or manifest.chunks_done == 0:
        raise ForerunError(
            f"the corpus gave no chunk to label (a chunk needs at least {max(args.chunk_tokens // 4, 1)} tokens): "
            "pass more text, or a smaller --chunk-tokens"
        )
    print(f"forerun: {manifest.chunks_done} chunks, {manifest.tokens} labelled positions in {labels}", file=sys.stderr)
    return {
        "corpus": [str(p) for p in args.corpus],
        "corpus_files_read": report.files if read else None,
        "chunk_tokens": args.chunk_tokens,
        "top_k": manifest.top_k,
        "chunks": manifest.chunks_done,
        "positions": manifest.tokens,
    }


def _answer_labels(
    args: argparse.Namespace,
    target: LoadedModel,
    out: Path,
    labels: Path,
    prompts: Prompts,
    budget_seconds: float | None = None,
) -> dict:
    """The target answers the first --answers training prompts (greedy, chat-formatted) and labels
    prompt + answer like a corpus chunk, into `labels`: what to record of them. With `budget_seconds`
    it stops after the answer that passes it (a rerun goes on from there)."""
    from forerun.train.data import answer_prompts
    from forerun.train.labelled_answers import labelled_answers
    from forerun.train.soft_labels import LabelManifest, check_stored, make_label_shards

    todo = prompts.train[: args.answers]
    manifest = LabelManifest.read(labels)
    if not _keep_labels(args, out, labels):
        done = manifest.chunks_done if manifest else 0
        if done > len(todo):
            raise ForerunError(
                f"{labels} holds {done} labelled answers, more than the {len(todo)} prompts to answer: pass "
                f"--answers {done} or more (and the same prompts), or remove {labels} to answer afresh"
            )
        if done:
            check_stored(labels, manifest, todo[:done], "answers to other prompts", prefix=True)
        if target.decoder.chain_prefill:  # exact rows: each answer labelled by the passes that write it
            answers = labelled_answers(target, todo[done:], args.max_tokens, args.answer_batch, args.top_k)
        else:  # written (padded rows on a GPU), then labelled in one prefill each
            answers = (seq.tokens for seq in answer_prompts(target, todo[done:], args.max_tokens, args.answer_batch))
        manifest = make_label_shards(
            target, answers, labels, args.top_k, budget_seconds=budget_seconds, progress=args.progress, skip_done=False
        )
    print(f"forerun: {manifest.chunks_done} answers, {manifest.tokens} labelled positions in {labels}", file=sys.stderr)
    return {
        **_prompt_record(args, prompts.train_ids[: manifest.chunks_done]),
        "answers": manifest.chunks_done,
        "answer_positions": manifest.tokens,
        "answer_batch": args.answer_batch,
        "max_tokens": args.max_tokens,
        "top_k": manifest.top_k,
    }


def _new_head(args: argparse.Namespace, target: LoadedModel) -> tuple[HeadConfig, torch.nn.Module]:
    """A fresh head over the target's most chosen tokens, its projection started from the LM head's rows."""
    from forerun.drafters.draft_vocab import draft_vocabulary
    from forerun.heads import HeadConfig, build_head, float_weight, target_checksum

    cfg = target.decoder.cfg
    vocab = draft_vocabulary(target, args.draft_vocab, args.progress)
    vocab = vocab if vocab is not None else torch.arange(cfg.vocab_size)
    config = HeadConfig(
        args.method,
        target_checksum(target),
        target.name,
        cfg.hidden_size,
        cfg.vocab_size,
        len(vocab),
        num_heads=args.heads if args.method == "medusa" else 0,
        intermediate_size=(args.intermediate_size or cfg.intermediate_size) if args.method == "eagle" else 0,
    )
    head = build_head(config, target)
    head.vocab.copy_(vocab)
    head.init_projection(float_weight(target.decoder.lm_head)[vocab])
    return config, head.to(args.device)


def _trainer(
    args: argparse.Namespace, head: torch.nn.Module, target: LoadedModel, data, out: Path, held_out: list | None
) -> Trainer:
    from forerun.train.trainer import TrainConfig, Trainer

    eagle = args.method == "eagle"
    embed = target.decoder.embed_tokens.to(args.device) if eagle else None
    if eagle and not args.train_projection:
        head.proj.weight.requires_grad_(False)  # the target's LM head rows: the head learns its features
    train_config = TrainConfig(
        args.method,
        args.epochs,
        args.lr or DEFAULT_LR[args.method],
        args.seed,
        args.checkpoint_minutes * 60,
        soft=not isinstance(data, Path),
        unroll=(args.unroll or DEFAULT_UNROLL) if eagle else 1,
        max_seconds=args.train_minutes * 60 if args.train_minutes is not None else None,
        bf16=train_bf16(args.train_dtype, torch.device(args.device)),
    )
    return Trainer(head, train_config, data, out, embed, held_out=held_out)


def train_bf16(choice: str, device: torch.device) -> bool:
    """Whether the training step's products run in bfloat16 (--train-dtype)."""
    from forerun.models.linear import cpu_has_native_bf16

    if choice != "auto":
        return choice == "bfloat16"
    return device.type == "cpu" and cpu_has_native_bf16()


def _training_record(args: argparse.Namespace, trainer: Trainer, accuracy: list[float]) -> dict:
    """How the head was trained, kept in its config beside what it was trained on."""
    return {
        "epochs": args.epochs,
        "lr": trainer.config.lr,
        "steps": trainer.progress.step,
        "train_minutes": round(trainer.progress.seconds / 60, 1),
        "final_top1_per_head": accuracy,
        "quantization": args.quantization,
        "device": args.device,
        "unroll": trainer.config.unroll,
        "projection": "trained" if args.train_projection or args.method == "medusa" else "frozen",
        "held_out_kept_per_depth": trainer.history.eval_kept[-1] if trainer.history.eval_kept else None,
        "train_dtype": "bfloat16" if trainer.config.bf16 else "float32",
    }


def default_answer_batch(device: torch.device) -> int:
    """Prompts answered together unless --answer-batch says: 8 on a CPU; 64 elsewhere, where the
    prompts step as padded rows of one batch (an H200 wrote 1,698 tokens a second at 64, 335 at 8:
    benchmark-log run 113)."""
    from forerun.train.data import BATCH, PADDED_BATCH

    return BATCH if device.type == "cpu" else PADDED_BATCH


def _check(args: argparse.Namespace) -> None:
    for name in ("max_tokens", "epochs", "draft_vocab", "heads", "max_prompt_tokens", "answer_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ForerunError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.heads > MAX_HEADS:
        raise ForerunError(
            f"--heads is how many future positions a medusa head guesses, at most {MAX_HEADS} (each is a "
            f"block of its own to train and run, and a draft is kept less often the further it looks), got {args.heads}"
        )
    if args.num_samples is not None and args.num_samples < 1:
        raise ForerunError(f"--num-samples must be at least 1, got {args.num_samples}")
    if args.hold_out < 0:
        raise ForerunError(f"--hold-out must be 0 or more, got {args.hold_out}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise ForerunError(f"--lr must be a positive number, got {args.lr}")
    if args.method == "medusa" and (args.unroll is not None or args.train_projection):
        raise ForerunError("--unroll and --train-projection are for eagle heads (a medusa head drafts from f_t alone)")
    least_values = (
        ("chunk_tokens", 2),
        ("top_k", 1),
        ("budget_tokens", 1),
        ("answers", 1),
        ("unroll", 1),
        ("eval_prompts", 0),
        ("eval_tokens", 1),
        ("intermediate_size", 1),
    )
    for name, least in least_values:  # None: not given
        value = getattr(args, name)
        if value is not None and value < least:
            raise ForerunError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    for path in args.code_prompts or ():
        if not Path(path).expanduser().exists():
            raise ForerunError(f"--code-prompts path {path} does not exist: pass folders or files of Python sources")
    for name in ("budget_minutes", "train_minutes"):  # None: no limit
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ForerunError(
                f"--{name.replace('_', '-')} must be a positive number of minutes (leave it out: no limit), got {value}"
            )
    if not (math.isfinite(args.checkpoint_minutes) and args.checkpoint_minutes >= 0):
        raise ForerunError(f"--checkpoint-minutes must be 0 or more minutes, got {args.checkpoint_minutes}")
    if not SEED_RANGE[0] <= args.seed < SEED_RANGE[1]:
        raise ForerunError(f"--seed must be a whole number in [-2**63, 2**64), got {args.seed}")


def _check_prompts_left(args: argparse.Namespace, prompts: Prompts) -> None:
    """A clear error, before any answer is written, where no prompt is left to train on."""
    if prompts.train:
        return
    raise ForerunError(
        f"no training prompts left: of {prompts.given} prompts, {len(prompts.eval)} are held out for measuring "
        f"(--eval-prompts {args.eval_prompts} per category) and {prompts.too_long} are longer than "
        f"--max-prompt-tokens or the context leaves no room for the answer; pass more prompts, a smaller "
        "--eval-prompts (0: none) or a larger --max-prompt-tokens"
    )


def round_robin(prompts: list) -> list:
    """The prompts taken one category at a time in turn, so that the first N cover every category
    (a file lists its categories one after another)."""
    from forerun.base.prompts import in_turn

    by_category: dict[str, list] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    return in_turn(list(by_category.values()))


@dataclass
class Prompts:
    """Chat-formatted token ids of the prompts a run uses, and their ids."""

    train: list[list[int]] = field(default_factory=list)
    train_ids: list[str] = field(default_factory=list)
    eval: list[list[int]] = field(default_factory=list)  # held-out acceptance during training, never trained on
    eval_ids: list[str] = field(default_factory=list)
    given: int = 0  # prompts read (after the held-out ones of spec-bench)
    too_long: int = 0  # left out: empty, or longer than --max-prompt-tokens or the context allows


def _prompt_source(args: argparse.Namespace) -> str | None:
    """--prompts, or spec-bench when neither it nor --code-prompts is given."""
    return args.prompts or (None if args.code_prompts else SPEC_BENCH)


def _load_prompts(args: argparse.Namespace) -> list:
    """The prompts of --prompts (spec-bench without its held-out ones) and of --code-prompts."""
    from forerun.base.prompts import load_prompts, unread_fields

    prompts = []
    source = _prompt_source(args)
    if source is not None:
        prompts = load_prompts(source)
        unread_fields([vars(p) for p in prompts], "forerun train")
    if source == SPEC_BENCH:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] > args.hold_out:
                kept.append(p)
        prompts = kept
    if args.code_prompts:
        from forerun.train.code_prompts import code_prompts
        from forerun.train.corpus import CorpusReport

        report = CorpusReport()
        made = code_prompts(args.code_prompts, report)
        print(f"forerun: {len(made)} coding prompts from the code ({report.line()})", file=sys.stderr)
        prompts += made
    return prompts


def split_prompts(args: argparse.Namespace, target, prompts: list) -> Prompts:
    """The prompts to train on and to measure on: spec-bench minus the held-out prompts (the first
    --hold-out of each category, which bench reports on), or a JSONL file's; taken one category at
    a time in turn, the first --eval-prompts rounds kept for measuring; chat-formatted when the
    target has a template; too long ones left out. `prompts`: `_load_prompts`'s."""
    evaluated = len({p.category for p in prompts}) * args.eval_prompts
    prompts = round_robin(prompts)
    tok = target.tokenizer
    chat = bool(getattr(tok.hf, "chat_template", None))
    limit = min(args.max_prompt_tokens, target.decoder.cfg.max_position - max(args.max_tokens, args.eval_tokens) - 1)
    split = Prompts(given=len(prompts))
    for i, p in enumerate(prompts):
        ids = tok.apply_chat([{"role": "user", "content": p.text}]) if chat else tok.encode(p.text)
        if not 0 < len(ids) <= limit:
            split.too_long += 1
            continue
        if i < evaluated:
            split.eval.append(ids)
            split.eval_ids.append(p.prompt_id)
            continue
        split.train.append(ids)
        split.train_ids.append(p.prompt_id)
        if args.num_samples is not None and len(split.train) >= args.num_samples:
            break
    return split
