"""`forerun profile`: where a decode step's time goes, for passes over 1, 2, 4, ... rows.

Each pass is what verification runs: R rows after a cache of --context slots, row-exact attention,
the LM head on every row. The pass is timed (the median of --steps), then profiled once more with
torch.profiler, and every op's own time is sorted by kind: the weight products, attention's
products over the cache, element-wise work (norms, rope, activations, scaling, residuals, masks),
copies, and what no op accounts for (Python and dispatch between ops).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from forerun.errors import ForerunError
from forerun.models.attention import RowLayout
from forerun.models.load import QUANTIZATIONS

# Ops by kind, by the name the profiler gives them. Anything else counts as "other ops".
PRODUCT_OPS = {"quantized::linear_dynamic", "onednn::qlinear_pointwise", "quantized::linear_dynamic_fp16",
               "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu", "aten::mm", "aten::addmm",
               "aten::linear", "aten::matmul"}
ATTENTION_OPS = {"aten::bmm", "aten::softmax", "aten::_softmax", "aten::scaled_dot_product_attention",
                 "aten::_scaled_dot_product_flash_attention_for_cpu"}
COPY_OPS = {"aten::copy_", "aten::clone", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::cat",
            "aten::index", "aten::index_put_", "aten::embedding", "aten::index_select", "aten::fill_",
            "aten::zero_", "aten::empty", "aten::empty_strided"}
ELEMENTWISE_OPS = {"aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::div", "aten::div_", "aten::sub",
                   "aten::rsqrt", "aten::pow", "aten::mean", "aten::abs", "aten::amax", "aten::clamp_min_",
                   "aten::clamp_min", "aten::silu", "aten::addcmul", "aten::roll", "aten::neg", "aten::exp",
                   "aten::masked_fill_", "aten::where", "aten::max", "aten::sum"}
KINDS = ("products", "attention", "element-wise", "copies", "other ops", "between ops")


@dataclass
class Breakdown:
    rows: int
    wall_ms: float                 # median pass time
    kinds: dict[str, float]        # kind -> ms in the profiled pass
    top: list[tuple[str, float, int]]   # (op, ms, calls), the ops with the most own time


def register(sub) -> None:
    p = sub.add_parser("profile", help="where a decode step's time goes, by kind of work, for 1..R rows",
                       description="Time and profile one target pass over each row count, as verification "
                                   "runs it, and sort its time into products, attention, element-wise work, "
                                   "copies and the time between ops.")
    p.add_argument("--model", required=True, help="embedded name, .gguf file, model folder or hub id")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS))
    p.add_argument("--rows", default="1,2,4,8,16", help="comma-separated row counts")
    p.add_argument("--context", type=int, default=256, help="cache slots filled before the pass")
    p.add_argument("--steps", type=int, default=10, help="timed passes per row count (the median is shown)")
    p.add_argument("--top", type=int, default=6, help="ops with the most own time to list per row count")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from forerun.models.load import load_model

    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        raise ForerunError(f"--rows takes whole numbers separated by commas, got {args.rows!r}") from None
    if not rows or min(rows) < 1 or args.steps < 1 or args.context < 0:
        raise ForerunError("--rows must be at least 1 each, --steps at least 1 and --context at least 0")
    model = load_model(args.model, args.dtype, quantization=args.quantization, with_tokenizer=False)
    if args.context + max(rows) > model.decoder.cfg.max_position:
        raise ForerunError(f"--context {args.context} plus {max(rows)} rows is beyond the model's context "
                           f"of {model.decoder.cfg.max_position}")
    results = [profile_pass(model.decoder, r, args.context, args.steps, args.top) for r in rows]
    print(render(results, f"{model.name}, {args.quantization or args.dtype}, {torch.get_num_threads()} threads, "
                          f"context {args.context}"))
    return 0


def profile_pass(decoder, rows: int, context: int, steps: int, top: int) -> Breakdown:
    """Time `steps` passes over `rows` rows after `context` cached slots, then profile one."""
    cache = decoder.new_cache(context + rows)
    tokens = torch.zeros(rows, dtype=torch.long, device=decoder.device)
    positions = torch.arange(context, context + rows, device=decoder.device)

    def one_pass() -> None:
        cache.length = context
        decoder(tokens, positions, cache, layout=RowLayout.chain(context, rows))

    one_pass()                                  # warm kernels and scratch buffers
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        one_pass()
        profiled_ms = (time.perf_counter() - start) * 1000
    kinds = dict.fromkeys(KINDS, 0.0)
    ops = []
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1000
        kinds[kind_of(event.key)] += ms
        ops.append((event.key, ms, event.count))
    # Profiling slows the pass; the time no op accounts for is scaled back to the unprofiled median.
    wall_ms = statistics.median(times) * 1000
    op_ms = sum(kinds.values())
    kinds["between ops"] = max(profiled_ms - op_ms, 0.0) * wall_ms / profiled_ms
    for kind in KINDS[:-1]:
        kinds[kind] *= wall_ms / profiled_ms
    ops.sort(key=lambda op: -op[1])
    return Breakdown(rows, wall_ms, kinds, ops[:top])


def kind_of(op: str) -> str:
    if op in PRODUCT_OPS:
        return "products"
    if op in ATTENTION_OPS:
        return "attention"
    if op in ELEMENTWISE_OPS:
        return "element-wise"
    if op in COPY_OPS:
        return "copies"
    return "other ops"


def render(results: list[Breakdown], title: str) -> str:
    lines = [f"{title}: ms per pass (kinds scaled to the unprofiled median)", "",
             "| rows | pass | " + " | ".join(KINDS) + " | × first |",
             "|---:|---:|" + "---:|" * (len(KINDS) + 1)]
    one = results[0].wall_ms if results else 1.0
    for b in results:
        lines.append(f"| {b.rows} | {b.wall_ms:.1f} | " + " | ".join(f"{b.kinds[k]:.1f}" for k in KINDS)
                     + f" | {b.wall_ms / one:.2f} |")
    lines.append("")
    for b in results:
        shown = ", ".join(f"{name} {ms:.1f} ms ({calls}×)" for name, ms, calls in b.top)
        lines.append(f"- {b.rows} rows, most own time (profiled): {shown}")
    return "\n".join(lines)
