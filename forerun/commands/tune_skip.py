"""`forerun tune-skip`: try a few early-exit / skip-layer settings on a handful of prompts and report
acceptance and speed for each, so you can pick the one to pass to `--speculative-method early-exit`."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.base.prompts import read_prompts_file, unread_fields
from forerun.commands.common import (
    add_model_args,
    add_prompt_args,
    add_sampling_args,
    positive_int,
    sampling_from_args,
)
from forerun.commands.generate import checked_prompts
from forerun.drafters.early_exit import draft_layers
from forerun.engine.metrics import SpecMetrics

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in three sentences why the sky is blue.",
    "List five uses of a hash map, one per line.",
    "Summarise the plot of Romeo and Juliet in a short paragraph.",
]


@dataclass
class Setting:
    label: str  # what the report shows
    flags: str  # what to pass to `forerun generate`
    options: dict  # the early-exit drafter's keywords


@dataclass
class Measurement:
    setting: Setting
    tokens: int
    seconds: float
    metrics: SpecMetrics

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def register(sub) -> None:
    p = sub.add_parser("tune-skip", help="measure early-exit / skip-layer settings to pick the fastest")
    add_model_args(p)
    add_prompt_args(p, "prompts to measure on (default: a built-in handful)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=5, help="K: tokens drafted per step")
    p.add_argument(
        "--layers",
        type=positive_int,
        nargs="+",
        default=None,
        help="early-exit depths L to try (default: a quarter, half and three quarters of the model)",
    )
    p.add_argument(
        "--skip",
        nargs="+",
        default=None,
        metavar="I,J,...",
        help="skip sets to try, each comma-separated (default: a few sets in the middle of the model)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per setting on stdout")
    add_sampling_args(p)
    p.set_defaults(func=run, max_tokens=48)


def candidate_settings(
    num_layers: int, layers: list[int] | None = None, skips: list[list[int]] | None = None
) -> list[Setting]:
    """The settings to try: the user's, or prefixes at 1/4, 1/2, 3/4 depth and skip sets that keep
    the first and last layers (which matter most) and drop middle ones, as SWIFT finds works."""
    n = num_layers
    if n < 2:  # --layers 1 is the whole model, and --skip leaves no layer
        raise ForerunError(
            f"early exit drafts with part of a model's layers, and this model has only {n}: there is no setting "
            "to try; give a model of 2 layers or more"
        )
    if layers is None and skips is None:
        layers = sorted({d for d in (n // 4, n // 2, 3 * n // 4) if 1 <= d < n})
        inner = range(1, n - 1)  # the first and last layers always run
        skips = [
            [i for i in range(n // 4, 3 * n // 4) if i % 2 == 1 and i in inner],
            [i for i in range(n // 3, 2 * n // 3) if i in inner],
            [i for i in inner if i % 2 == 1],
        ]
    out: list[Setting] = []
    for depth in layers or []:
        draft_layers(n, layer=depth)  # a clear error for a depth the model lacks
        out.append(Setting(f"first {depth} of {n} layers", f"--early-exit-layer {depth}", {"layer": depth}))
    seen: set[tuple[int, ...]] = set()
    for skip in skips or []:
        key = tuple(sorted(set(skip)))
        if not key or key in seen:
            continue
        seen.add(key)
        draft_layers(n, skip_layers=list(key))
        out.append(
            Setting(
                f"skip {','.join(map(str, key))} ({n - len(key)} of {n} layers)",
                f"--skip-layers {' '.join(map(str, key))}",
                {"skip_layers": list(key)},
            )
        )
    if not out:
        raise ForerunError(f"no setting to try for a model of {n} layers; pass --layers or --skip")
    return out


def parse_skip(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ForerunError(f"--skip {text!r}: expected layer numbers separated by commas, e.g. 3,5,7") from None
    if not layers:
        raise ForerunError(f"--skip {text!r} names no layer: give layer numbers separated by commas, e.g. 3,5,7")
    return layers


def check_settings(num_layers: int, layers: list[int] | None, skips: list[list[int]] | None) -> None:
    """--layers and --skip against the model's layers, each error naming tune-skip's own flag (the
    drafter's checks name --early-exit-layer and --skip-layers, which tune-skip has not)."""
    n = num_layers
    for depth in layers or []:
        if not 1 <= depth <= n:
            raise ForerunError(f"--layers {depth}: an early-exit depth must be between 1 and the model's {n} layers")
    for skip in skips or []:
        outside = [i for i in skip if not 0 <= i < n]
        if outside:
            shown = ",".join(map(str, skip))
            raise ForerunError(
                f"--skip {shown}: layer {outside[0]} is outside the model's layers 0..{n - 1}; skip some of those"
            )
        if set(skip) >= set(range(n)):
            raise ForerunError(f"--skip {','.join(map(str, skip))} skips every layer of {n}; keep at least one")


def _prompts(args: argparse.Namespace) -> list:
    """The prompts to measure on: --prompt, --prompts-file's, or the built-in handful."""
    texts = list(args.prompt)
    if args.prompts_file:
        if Path(args.prompts_file).is_dir():
            raise ForerunError(
                f"--prompts-file {args.prompts_file} is a folder; name a JSONL file with 'prompt' or 'turns' per line"
            )
        records = read_prompts_file(args.prompts_file)
        unread_fields(records, "forerun tune-skip")
        texts += [r["prompt"] for r in records]
    texts = texts or DEFAULT_PROMPTS
    return [[{"role": "user", "content": t}] if args.chat else t for t in texts]


def measure(llm: LLM, setting: Setting, prompts: list, params: SamplingParams) -> Measurement:
    metrics = SpecMetrics(num_speculative_tokens=llm.engine.k)
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        result = llm.generate([prompt], params)[0]
        tokens += len(result.token_ids)
        seconds += result.elapsed_s
        metrics.merge(result.metrics)
    return Measurement(setting, tokens, seconds, metrics)


def run(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    skips = [parse_skip(s) for s in args.skip] if args.skip else None  # before the model loads
    params = sampling_from_args(args)
    plain = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    target = plain.target
    check_settings(target.decoder.cfg.num_layers, args.layers, skips)
    settings = candidate_settings(target.decoder.cfg.num_layers, args.layers, skips)
    checked_prompts(plain, prompts, params)  # every prompt can run, before any is measured
    # Warm-up (first calls are slow), no longer than the measured runs: a prompt that fits those fits it.
    plain.generate([prompts[0]], SamplingParams(max_tokens=min(4, params.max_tokens)))
    rows = [measure(plain, Setting("plain decoding", "", {}), prompts, params)]
    for setting in settings:
        llm = LLM(
            model=target,
            speculative_method="early-exit",
            speculative_options=setting.options,
            num_speculative_tokens=args.num_speculative_tokens,
        )
        rows.append(measure(llm, setting, prompts, params))
    report(rows, args.json)
    return 0


def report(rows: list[Measurement], as_json: bool) -> None:
    base = rows[0].tokens_per_s
    if as_json:
        for m in rows:
            print(
                json.dumps(
                    {
                        "setting": m.setting.label,
                        "flags": m.setting.flags,
                        **m.setting.options,
                        "tokens": m.tokens,
                        "elapsed_s": round(m.seconds, 4),
                        "tokens_per_s": round(m.tokens_per_s, 3),
                        "speedup": round(m.tokens_per_s / base, 3) if base else None,
                        "spec": m.metrics.to_dict() if m.setting.flags else None,
                    }
                ),
                flush=True,
            )
        return
    print(f"{'setting':34} {'acceptance':>10} {'accepted len':>12} {'tok/s':>8} {'speedup':>8}")
    for m in rows:
        spec = bool(m.setting.flags)
        acc = f"{m.metrics.acceptance_rate:.2f}" if spec else "-"
        length = f"{m.metrics.mean_accepted_length:.2f}" if spec else "1.00"
        speedup = f"{m.tokens_per_s / base:.2f}x" if base else "-"
        print(f"{m.setting.label:34} {acc:>10} {length:>12} {m.tokens_per_s:8.2f} {speedup:>8}")
    best = max(rows[1:], key=lambda m: m.tokens_per_s)
    if best.tokens_per_s > base:
        print(
            f"fastest: --speculative-method early-exit {best.setting.flags} "
            f"({best.tokens_per_s / base:.2f}x plain decoding)"
        )
    else:
        print("no setting beat plain decoding on these prompts; early exit does not pay for this model here")
