"""`forerun train`: a Medusa or EAGLE draft head for a target, from its own answers or from corpus text.

1. The target answers the training prompts (greedy, on its fast format, several at once) and
   reads each prompt + answer again; its hidden states are stored as safetensors shards in
   OUT/data (resumable).
2. The head trains on them (progress bar with loss and top-1 accuracy per head; a checkpoint in
   OUT/checkpoint every few minutes; `--resume` continues from it).
3. OUT holds the head (config.json naming the target's checksum, head.safetensors) and curves.png.

`--data DIR` puts the shards elsewhere, so a Medusa and an EAGLE head of one target share them.

With `--prompts spec-bench`, the first `--hold-out` prompts of every category are never trained on:
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
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from forerun.base.errors import ForerunError
from forerun.models.load import QUANTIZATIONS

if TYPE_CHECKING:
    from collections.abc import Iterator

    from forerun.heads import HeadConfig
    from forerun.models.load import LoadedModel
    from forerun.train.corpus import CorpusReport, Document
    from forerun.train.trainer import Trainer

METHODS = ("medusa", "eagle")
DEFAULT_LR = {"medusa": 1e-3, "eagle": 3e-4}


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
    p.add_argument("--prompts", default="spec-bench", help="spec-bench or a JSONL file with 'prompt' or 'turns'")
    p.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="where the self-distilled shards go (default OUT/data; with --corpus the labels go to DIR/labels, "
        "default OUT/labels); two heads of one target can share them",
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
    p.add_argument("--max-tokens", type=int, default=192, help="answer length per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="prompts longer than this are left out")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 1e-3 medusa, 3e-4 eagle)")
    p.add_argument("--draft-vocab", type=int, default=32768, help="tokens the head scores (the target's most chosen)")
    p.add_argument("--heads", type=int, default=4, help="medusa: future positions guessed")
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
    p.add_argument("--device", default="cpu", help="cpu or cuda: where the head trains")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    _register_corpus(p)
    p.set_defaults(func=run)


def _register_corpus(p: argparse.ArgumentParser) -> None:
    corpus = p.add_argument_group("corpus", "learn the target's distribution over text instead of its answers")
    corpus.add_argument(
        "--corpus",
        nargs="+",
        default=None,
        metavar="PATH",
        help="files or folders of text or code; the target labels them and the head learns its distribution",
    )
    corpus.add_argument("--chunk-tokens", type=int, default=512, help="tokens per labelled chunk")
    corpus.add_argument("--top-k", type=int, default=20, help="next-token probabilities stored per position")
    corpus.add_argument("--budget-tokens", type=int, default=None, help="label at most N positions in all")
    corpus.add_argument("--budget-minutes", type=float, default=None, help="label for at most M minutes in this run")


def run(args: argparse.Namespace) -> int:
    from forerun.heads import save_head
    from forerun.models.load import load_model
    from forerun.train.corpus import CorpusReport, iter_documents
    from forerun.train.trainer import CHECKPOINT, plot_history

    _check(args)
    out = Path(args.out).expanduser()
    if (out / CHECKPOINT).exists() and not args.resume:
        raise ForerunError(
            f"{out} holds a checkpoint of an earlier run: add --resume to continue it, or pick another --out"
        )
    report = CorpusReport()
    # Checks that every corpus path exists now, before the model loads; the files are read later.
    documents = iter_documents(args.corpus, report) if args.corpus else None
    torch.manual_seed(args.seed)
    target = load_model(args.model, args.dtype, quantization=args.quantization)
    if target.tokenizer is None:
        raise ForerunError(f"{args.model} has no tokenizer; training encodes its text with it")
    if documents is not None:
        data, record = _corpus_labels(args, target, out, documents, report)
    else:
        data, record = _self_distilled(args, target, out)
    config, head = _new_head(args, target)
    trainer = _trainer(args, head, target, data, out)
    history = trainer.run(resume=args.resume, progress=args.progress)
    last = history.accuracy[-20:]
    accuracy = [round(sum(a[i] for a in last) / len(last), 4) for i in range(len(last[0]))] if last else []
    config.training = {**record, **_training_record(args, trainer, accuracy)}
    save_head(out, config, head.cpu())
    if history.steps:
        plot_history(history, out / "curves.png", f"{args.method} head for {target.name}")
    print(
        f"forerun: {args.method} head in {out} (top-1 per head over the last steps: {accuracy}); use it with "
        f"--speculative-method {args.method} --speculative-head {out}",
        file=sys.stderr,
    )
    return 0


def _self_distilled(args: argparse.Namespace, target: LoadedModel, out: Path) -> tuple[Path, dict]:
    """The target answers the training prompts into shards: (their folder, what to record of them)."""
    from forerun.train.data import make_shards

    prompts, used = training_prompts(args, target)
    if not prompts:
        raise ForerunError("no training prompts left (all held out, or longer than --max-prompt-tokens)")
    data = Path(args.data).expanduser() if args.data else out / "data"
    started = time.perf_counter()
    manifest = make_shards(target, prompts, data, args.max_tokens, progress=args.progress)
    print(
        f"forerun: {manifest.prompts_done} answers, {manifest.tokens} positions ({manifest.answer_tokens} written "
        f"by the target) in {data}",
        file=sys.stderr,
    )
    return data, {
        "prompts": args.prompts,
        "prompt_ids": used,
        "hold_out_per_category": args.hold_out if args.prompts == "spec-bench" else None,
        "sequences": manifest.prompts_done,
        "positions": manifest.tokens,
        "answer_tokens": manifest.answer_tokens,
        "max_tokens": args.max_tokens,
        "data_minutes": round((time.perf_counter() - started) / 60, 1),
    }


def _corpus_labels(
    args: argparse.Namespace, target: LoadedModel, out: Path, documents: Iterator[Document], report: CorpusReport
) -> tuple[Path, dict]:
    """The target labels the corpus's chunks into OUT/labels (or DIR/labels with --data DIR):
    (that folder, what to record of it)."""
    from forerun.train.corpus import token_chunks
    from forerun.train.soft_labels import LabelManifest, make_label_shards
    from forerun.train.trainer import CHECKPOINT

    labels = (Path(args.data).expanduser() if args.data else out) / "labels"
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
    started = time.perf_counter()
    read = False  # whether the corpus was read in this run (the report counts its files then)
    if args.resume and (out / CHECKPOINT).exists() and manifest is not None:
        print(f"forerun: resuming training on the labels in {labels} as they are", file=sys.stderr)
    else:
        budget = args.budget_tokens - (manifest.tokens if manifest else 0) if args.budget_tokens else None
        if budget is None or budget > 0:
            seconds = args.budget_minutes * 60 if args.budget_minutes is not None else None
            manifest = make_label_shards(
                target, chunks, labels, args.top_k, budget_tokens=budget, budget_seconds=seconds, progress=args.progress
            )
            print(f"forerun: corpus: {report.line()}", file=sys.stderr)
            read = True
    if manifest is None or manifest.chunks_done == 0:
        raise ForerunError(
            f"the corpus gave no chunk to label (a chunk needs at least {max(args.chunk_tokens // 4, 1)} tokens): "
            "pass more text, or a smaller --chunk-tokens"
        )
    print(f"forerun: {manifest.chunks_done} chunks, {manifest.tokens} labelled positions in {labels}", file=sys.stderr)
    return labels, {
        "corpus": [str(p) for p in args.corpus],
        "corpus_files_read": report.files if read else None,
        "chunk_tokens": args.chunk_tokens,
        "top_k": manifest.top_k,
        "chunks": manifest.chunks_done,
        "positions": manifest.tokens,
        "data_minutes": round((time.perf_counter() - started) / 60, 1),
    }


def _new_head(args: argparse.Namespace, target: LoadedModel) -> tuple[HeadConfig, torch.nn.Module]:
    """A fresh head over the target's most chosen tokens, its projection started from the LM head's rows."""
    from forerun.drafters.draft_vocab import draft_vocabulary
    from forerun.heads import HeadConfig, build_head, float_weight, target_checksum

    cfg = target.decoder.cfg
    vocab = draft_vocabulary(target, args.draft_vocab)
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


def _trainer(args: argparse.Namespace, head: torch.nn.Module, target: LoadedModel, data: Path, out: Path) -> Trainer:
    from forerun.train.trainer import TrainConfig, Trainer

    embed = target.decoder.embed_tokens.to(args.device) if args.method == "eagle" else None
    train_config = TrainConfig(
        args.method,
        args.epochs,
        args.lr or DEFAULT_LR[args.method],
        args.seed,
        args.checkpoint_minutes * 60,
        soft=args.corpus is not None,
    )
    return Trainer(head, train_config, data, out, embed)


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
    }


def _check(args: argparse.Namespace) -> None:
    for name in ("max_tokens", "epochs", "draft_vocab", "heads", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            raise ForerunError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.num_samples is not None and args.num_samples < 1:
        raise ForerunError(f"--num-samples must be at least 1, got {args.num_samples}")
    if args.hold_out < 0:
        raise ForerunError(f"--hold-out must be 0 or more, got {args.hold_out}")
    if args.lr is not None and args.lr <= 0:
        raise ForerunError(f"--lr must be positive, got {args.lr}")
    for name, least in (("chunk_tokens", 2), ("top_k", 1), ("budget_tokens", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise ForerunError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    if args.budget_minutes is not None and args.budget_minutes <= 0:
        raise ForerunError(f"--budget-minutes must be positive, got {args.budget_minutes}")


def round_robin(prompts: list) -> list:
    """The prompts taken one category at a time in turn, so that the first N cover every category
    (a file lists its categories one after another)."""
    by_category: dict[str, list] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    queues = list(by_category.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def training_prompts(args: argparse.Namespace, target) -> tuple[list[list[int]], list[str]]:
    """(token ids of the prompts to train on, their ids): spec-bench minus the held-out prompts, or
    a JSONL file's; chat-formatted when the target has a template; too long ones left out."""
    from forerun.base.prompts import load_prompts

    prompts = load_prompts(args.prompts)
    if args.prompts == "spec-bench":
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] > args.hold_out:
                kept.append(p)
        prompts = kept
    prompts = round_robin(prompts)
    tok = target.tokenizer
    chat = bool(getattr(tok.hf, "chat_template", None))
    limit = min(args.max_prompt_tokens, target.decoder.cfg.max_position - args.max_tokens - 1)
    encoded, used = [], []
    for p in prompts:
        ids = tok.apply_chat([{"role": "user", "content": p.text}]) if chat else tok.encode(p.text)
        if 0 < len(ids) <= limit:
            encoded.append(ids)
            used.append(p.prompt_id)
        if args.num_samples is not None and len(encoded) >= args.num_samples:
            break
    return encoded, used
