"""`forerun quality`: how far a numeric format moves a model's next-token distributions.

Teacher-forced: the reference (the weights in --dtype, unquantized) writes a greedy continuation of
each prompt; both models then read prompt + continuation in one pass, and at every continuation
position the command compares their next-token distributions: top-1 agreement and KL(reference ||
format) per token, by task kind.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from tqdm import tqdm

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.base.prompts import Prompt, load_prompts, unread_fields
from forerun.commands.common import add_kv_cache_arg
from forerun.engine.engine import check_prompt_fits
from forerun.models import linear
from forerun.models.formats import AUTO, NATIVE
from forerun.models.load import QUANTIZATIONS
from forerun.models.source import resolve


def register(sub) -> None:
    p = sub.add_parser("quality", help="compare a numeric format's next-token distributions with the unquantized model")
    p.add_argument("--model", required=True, help="embedded name, .gguf file, model folder or hub id")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the reference's dtype")
    p.add_argument(
        "--quantization",
        nargs="+",
        default=["w8a8"],
        choices=[q for q in QUANTIZATIONS if q != AUTO],
        help="formats to compare with the reference",
    )
    add_kv_cache_arg(p)  # the compared formats'; the reference keeps its own
    p.add_argument("--dataset", default="spec-bench", help="spec-bench or a JSONL file with 'prompt' or 'turns'")
    p.add_argument("--limit-per-category", type=int, default=2, help="first N prompts of each category")
    p.add_argument("--max-tokens", type=int, default=32, help="continuation tokens compared per prompt")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ForerunError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    args.quantization = list(dict.fromkeys(args.quantization))  # a format named twice is compared once
    _check_formats(args.model, args.quantization)
    prompts = load_prompts(args.dataset, limit_per_category=args.limit_per_category)
    unread_fields([vars(p) for p in prompts], "forerun quality")
    reference = LLM(args.model, dtype=args.dtype)
    tok = reference.tokenizer
    if tok is None:
        raise ForerunError(f"model {args.model} has no tokenizer; the quality check needs one to encode its prompts")
    encoded = _encode(prompts, tok, args.max_tokens, reference.target.decoder.cfg.max_position)
    texts = []  # (task, prompt ids, continuation ids)
    for p, ids in tqdm(list(zip(prompts, encoded)), desc="reference continuations", unit="prompt", file=sys.stderr):
        out = reference.generate([ids], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))[0]
        texts.append((p.task, ids, out.token_ids))
    ref_logits = [continuation_logits(reference, ids, cont) for _, ids, cont in texts]
    del reference
    table: dict[str, dict[str, dict]] = {}
    for fmt in args.quantization:
        model = LLM(args.model, dtype=args.dtype, quantization=fmt, kv_cache_dtype=args.kv_cache_dtype)
        for (task, ids, cont), ref in zip(texts, ref_logits):
            got = continuation_logits(model, ids, cont)
            for key in (task, "overall"):
                cell = table.setdefault(fmt, {}).setdefault(key, {"positions": 0, "top1_agree": 0, "kl_sum": 0.0})
                cell["positions"] += ref.shape[0]
                cell["top1_agree"] += int((ref.argmax(-1) == got.argmax(-1)).sum())
                cell["kl_sum"] += float(kl_per_position(ref, got).sum())
        del model
    print(json.dumps(table, indent=1) if args.json else render(table))
    return 0


def _encode(prompts: list[Prompt], tok, max_tokens: int, limit: int) -> list[list[int]]:
    """Every prompt's ids, each checked to fit the model's context of `limit` with `max_tokens` after
    it before the reference writes any continuation; an error names the dataset's prompt."""
    chat = bool(getattr(tok.hf, "chat_template", None))
    encoded = []
    for p in prompts:
        ids = tok.apply_chat([{"role": "user", "content": p.text}]) if chat else tok.encode(p.text)
        try:
            check_prompt_fits(limit, ids, max_tokens)
        except ForerunError as exc:
            raise ForerunError(f"--dataset prompt {p.prompt_id} (category {p.category}): {exc}") from None
        encoded.append(ids)
    return encoded


def _check_formats(model: str, formats: list[str]) -> None:
    """Every format can compute `model`, checked before the reference writes its continuations."""
    source = resolve(model)
    native = [fmt for fmt in formats if fmt in NATIVE]
    if native and source.kind != "gguf":
        others = " or ".join(q for q in QUANTIZATIONS if q not in (*NATIVE, AUTO))
        raise ForerunError(
            f"--quantization {' '.join(native)} computes a GGUF file's blocks, and {model} is a model folder; "
            f"compare {others} on it, or give a .gguf file as --model"
        )


@torch.inference_mode()
def continuation_logits(llm: LLM, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """The model's logits [len(continuation), vocab] for each continuation token, reading prompt +
    continuation in one pass (row i predicts continuation[i])."""
    decoder = llm.target.decoder
    ids = prompt + continuation
    cache = decoder.new_cache(len(ids))
    with linear.prefill():
        logits = decoder.forward_ids(ids, cache).logits[0]  # [T, vocab]
    return logits[len(prompt) - 1 : len(ids) - 1].float()


def kl_per_position(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(p_reference || p_other) in nats at every row: [N]."""
    ref = reference.log_softmax(-1)
    return (ref.exp() * (ref - other.log_softmax(-1))).sum(-1)


def render(table: dict[str, dict[str, dict]]) -> str:
    lines = ["| format | task kind | positions | top-1 agreement | KL per token (nats) |", "|---|---|---:|---:|---:|"]
    for fmt, rows in table.items():
        for task, cell in sorted(rows.items(), key=lambda item: (item[0] == "overall", item[0])):
            n = cell["positions"]
            lines.append(
                f"| {fmt} | {task} | {n} | {cell['top1_agree']}/{n} ({100 * cell['top1_agree'] / n:.1f}%) "
                f"| {cell['kl_sum'] / n:.4f} |"
            )
    return "\n".join(lines)
