"""`forerun profile`: where a decode step's time goes, for passes over 1, 2, 4, ... rows.

Each pass is what verification runs: R rows after a cache of --context slots, row-exact attention,
the LM head on every row. The pass is timed (the median of --steps), then profiled once more with
torch.profiler, and every op's own time is sorted by kind: the weight products, attention's
products over the cache, element-wise work (norms, rope, activations, scaling, residuals, masks),
copies, and what no op accounts for (Python and dispatch between ops).

With --bound it also times the pass's product modules alone, back to back on the inputs they had in
the pass, and sets both against the read-bandwidth bound: the bytes of the weights a pass reads over
the fastest plain read this machine does. That read is taken between the timed passes of each row
count: on a shared machine memory's speed moves from one minute to the next, and a pass is set
against what memory gave at the same moments, both against the fastest of those reads and, pass by
pass, against the read right after it (the median of those ratios: what drift moves least). The
products alone are the floor a pass over these kernels can reach; the rest of the pass is what
everything else costs.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from forerun.base.errors import ForerunError
from forerun.bench import machine
from forerun.commands.common import add_kv_cache_arg
from forerun.models.attention import RowLayout
from forerun.models.gguf_format import GGUFLinear
from forerun.models.linear import Int8Linear, Linear
from forerun.models.load import QUANTIZATIONS
from forerun.models.w8a8 import W8A8Linear

# Ops by kind, by the name the profiler gives them. Anything else counts as "other ops".
PRODUCT_OPS = {
    "forerun::product",
    "quantized::linear_dynamic",
    "onednn::qlinear_pointwise",
    "quantized::linear_dynamic_fp16",
    "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::mm",
    "aten::addmm",
    "aten::linear",
    "aten::matmul",
}
ATTENTION_OPS = {
    "aten::bmm",
    "aten::softmax",
    "aten::_softmax",
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
}
COPY_OPS = {
    "aten::copy_",
    "aten::clone",
    "aten::to",
    "aten::_to_copy",
    "aten::contiguous",
    "aten::cat",
    "aten::index",
    "aten::index_put_",
    "aten::embedding",
    "aten::index_select",
    "aten::fill_",
    "aten::zero_",
    "aten::empty",
    "aten::empty_strided",
}
ELEMENTWISE_OPS = {
    "aten::mul",
    "aten::mul_",
    "aten::add",
    "aten::add_",
    "aten::div",
    "aten::div_",
    "aten::sub",
    "aten::rsqrt",
    "aten::pow",
    "aten::mean",
    "aten::abs",
    "aten::amax",
    "aten::clamp_min_",
    "aten::clamp_min",
    "aten::silu",
    "aten::addcmul",
    "aten::roll",
    "aten::neg",
    "aten::exp",
    "aten::masked_fill_",
    "aten::where",
    "aten::max",
    "aten::sum",
}
NATIVE_LAYERS = "forerun::native layers"  # every layer of a forward in one native call (the gguf format)
KINDS = ("native layers", "products", "attention", "element-wise", "copies", "other ops", "between ops")
PRODUCT_MODULES = (Linear, Int8Linear, W8A8Linear, GGUFLinear)


@dataclass
class Breakdown:
    rows: int
    wall_ms: float  # median pass time
    kinds: dict[str, float]  # kind -> ms in the profiled pass
    top: list[tuple[str, float, int]]  # (op, ms, calls), the ops with the most own time
    products_alone_ms: float | None = None  # --bound: the product modules alone, back to back (median)
    weight_bytes: int = 0  # bytes of the weights of the products the pass called
    bandwidth: float = 0.0  # --bound: the fastest plain read between the timed passes, bytes/s
    pairs: list[tuple[float, float]] | None = None  # --bound: each timed pass (s) and the read after it (bytes/s)


# --bound's plain read after each timed pass: far beyond any cache, small beside a pass's weights.
READ_BYTES = 256 << 20


def register(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="where a decode step's time goes, by kind of work, for 1..R rows",
        description="Time and profile one target pass over each row count, as verification "
        "runs it, and sort its time into products, attention, element-wise work, "
        "copies and the time between ops.",
    )
    p.add_argument("--model", required=True, help="embedded name, .gguf file, model folder or hub id")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS))
    add_kv_cache_arg(p)
    p.add_argument("--rows", default="1,2,4,8,16", help="comma-separated row counts")
    p.add_argument("--context", type=int, default=256, help="cache slots filled before the pass")
    p.add_argument("--steps", type=int, default=10, help="timed passes per row count (the median is shown)")
    p.add_argument("--top", type=int, default=6, help="ops with the most own time to list per row count")
    p.add_argument(
        "--bound",
        action="store_true",
        help="also time the pass's products alone and set the pass against this machine's "
        "read-bandwidth bound (a plain read of 256 MiB after each timed pass: a few seconds)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from forerun.models.load import load_model

    rows = _check(args)
    model = load_model(
        args.model,
        args.dtype,
        quantization=args.quantization,
        with_tokenizer=False,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.context + max(rows) > model.decoder.cfg.max_position:
        raise ForerunError(
            f"--context {args.context} plus {max(rows)} rows is beyond the model's context "
            f"of {model.decoder.cfg.max_position}"
        )
    results = [profile_pass(model.decoder, r, args.context, args.steps, args.top, args.bound) for r in rows]
    title = (
        f"{model.name}, {args.quantization or args.dtype}, {torch.get_num_threads()} threads, context {args.context}"
    )
    print(machine.cpu_line())
    print()
    print(render(results, title))
    if args.bound:
        print()
        print(render_bound(results))
    return 0


def _check(args: argparse.Namespace) -> list[int]:
    """--rows' row counts in the order given, each once, after every number flag is known to be in range
    (each error names its flag)."""
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        raise ForerunError(f"--rows takes whole numbers separated by commas, got {args.rows!r}") from None
    if not rows:
        raise ForerunError(f"--rows {args.rows!r} names no row count: give some such as 1,2,4")
    if min(rows) < 1:
        raise ForerunError(f"--rows must be at least 1 each, got {args.rows!r}")
    for flag, value, least in (("--steps", args.steps, 1), ("--top", args.top, 1), ("--context", args.context, 0)):
        if value < least:
            raise ForerunError(f"{flag} must be at least {least}, got {value}")
    return list(dict.fromkeys(rows))  # a row count named twice is profiled once


def profile_pass(decoder, rows: int, context: int, steps: int, top: int, bound: bool = False) -> Breakdown:
    """Time `steps` passes over `rows` rows after `context` cached slots, then profile one;
    `bound`: also time the pass's product modules alone (`products_alone`)."""
    cache = decoder.new_cache(context + rows)
    tokens = torch.zeros(rows, dtype=torch.long, device=decoder.device)
    positions = torch.arange(context, context + rows, device=decoder.device)

    def one_pass() -> None:
        cache.length = context
        decoder(tokens, positions, cache, layout=RowLayout.chain(context, rows))

    one_pass()  # warm kernels and scratch buffers
    times, reads = [], []
    memory = machine.read_buffer(READ_BYTES) if bound else None  # made once: no fresh pages between passes
    for _ in range(steps):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
        if memory is not None:
            reads.append(machine.read_bandwidth(READ_BYTES, repeats=1, buffer=memory))
    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
        named_products(decoder),
        named_native_layers(decoder),
    ):
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
    pairs = list(zip(times, reads)) if reads else None
    result = Breakdown(rows, wall_ms, kinds, ops[:top], bandwidth=max(reads, default=0.0), pairs=pairs)
    if bound:
        result.products_alone_ms, result.weight_bytes = products_alone(decoder, one_pass, steps, rows)
    return result


@contextlib.contextmanager
def named_products(decoder) -> Iterator[None]:
    """Every product module's call as a profiler range named forerun::product, so products whose
    work is no torch op (the native kernels') are counted as products, not as time between ops."""
    ranges: list = []

    def enter(module, args) -> None:
        ranges.append(torch.profiler.record_function("forerun::product"))
        ranges[-1].__enter__()

    def leave(module, args, output) -> None:
        ranges.pop().__exit__(None, None, None)

    modules = [m for m in decoder.modules() if isinstance(m, PRODUCT_MODULES)]
    hooks = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def named_native_layers(decoder) -> Iterator[None]:
    """Every native layer call of `decoder` as a profiler range of its own (no torch op's time)."""
    prepared = decoder._native_layers()
    if prepared is None:
        yield
        return
    lib = prepared.lib
    run, score = lib.fr_layers, lib.fr_norm_head

    def named(*args):
        with torch.profiler.record_function(NATIVE_LAYERS):
            return run(*args)

    def scored(*args):  # the final norm and the head's product: a product's time
        with torch.profiler.record_function("forerun::product"):
            return score(*args)

    prepared.lib = _Named(lib, named, scored)
    try:
        yield
    finally:
        prepared.lib = lib


class _Named:
    """The library with fr_layers and fr_norm_head wrapped, every other function as it is."""

    def __init__(self, lib, fr_layers, fr_norm_head) -> None:
        self._lib, self.fr_layers, self.fr_norm_head = lib, fr_layers, fr_norm_head

    def __getattr__(self, name: str):
        return getattr(self._lib, name)


def products_alone(decoder, one_pass, steps: int, rows: int) -> tuple[float, int]:
    """(ms, bytes): the product modules `one_pass` calls, called again back to back on the inputs
    they had in it (the median of `steps` runs), and the bytes of their weights, each module once.
    Products inside native layers (and a head scored in the native call after them) are no module
    call of the pass: each is called on random rows."""
    calls: list[tuple[torch.nn.Module, torch.Tensor]] = []
    hooks = [
        m.register_forward_pre_hook(lambda m, args: calls.append((m, args[0].clone())))
        for m in decoder.modules()
        if isinstance(m, PRODUCT_MODULES)
    ]
    try:
        one_pass()
    finally:
        for hook in hooks:
            hook.remove()
    prepared = decoder._native_layers()
    if prepared is not None:
        if prepared.head(decoder.lm_head) is not None:  # scored in the native call after the layers
            calls.append((decoder.lm_head, torch.randn(rows, decoder.lm_head.in_features)))
        for block in decoder.layers:
            for module in (
                block.self_attn.qkv_proj,
                block.self_attn.o_proj,
                block.mlp.gate_up_proj,
                block.mlp.down_proj,
            ):
                calls.append((module, torch.randn(rows, module.in_features)))

    def run() -> None:
        for module, x in calls:
            module.forward(x)

    times = []
    with torch.inference_mode():
        run()
        for _ in range(steps):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    called = {id(m): m for m, _ in calls}
    return statistics.median(times) * 1000, sum(weight_bytes(m) for m in called.values())


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a product's weights as stored: its own parameters and buffers (w8a8: its int8 weight too)."""
    if isinstance(module, GGUFLinear):
        return module.weight_bytes()
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    if isinstance(module, W8A8Linear):
        tensors.append(module.qweight())
    return sum(t.nbytes for t in tensors)


def kind_of(op: str) -> str:
    if op == NATIVE_LAYERS:
        return "native layers"
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
    lines = [
        f"{title}: ms per pass (kinds scaled to the unprofiled median)",
        "",
        "| rows | pass | " + " | ".join(KINDS) + " | × first |",
        "|---:|---:|" + "---:|" * (len(KINDS) + 1),
    ]
    one = results[0].wall_ms if results else 1.0
    for b in results:
        lines.append(
            f"| {b.rows} | {b.wall_ms:.1f} | "
            + " | ".join(f"{b.kinds[k]:.1f}" for k in KINDS)
            + f" | {b.wall_ms / one:.2f} |"
        )
    lines.append("")
    for b in results:
        shown = ", ".join(f"{name} {ms:.1f} ms ({calls}×)" for name, ms, calls in b.top)
        lines.append(f"- {b.rows} rows, most own time (profiled): {shown}")
    return "\n".join(lines)


def paired_ratio(b: Breakdown) -> float:
    """The median over the timed passes of pass time × the read rate measured right after it ÷ the
    weights' bytes: each pass against its own bound."""
    if not b.pairs or b.weight_bytes <= 0:
        raise ValueError(f"the {b.rows}-row pass was profiled without bound=True")
    return statistics.median(seconds * rate / b.weight_bytes for seconds, rate in b.pairs)


def render_bound(results: list[Breakdown]) -> str:
    """The passes and their products alone against the bytes they read at each row count's plain read."""
    lines = [
        "| rows | weights read | plain read | bound | pass | × bound | products alone | × bound | × read beside it |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in results:
        if b.bandwidth <= 0 or b.weight_bytes <= 0 or b.products_alone_ms is None:
            raise ValueError(f"the {b.rows}-row pass was profiled without bound=True")
        bound_ms = b.weight_bytes / b.bandwidth * 1000
        lines.append(
            f"| {b.rows} | {b.weight_bytes / 1e9:.3f} GB | {b.bandwidth / 1e9:.1f} GB/s | {bound_ms:.1f} | "
            f"{b.wall_ms:.1f} | {b.wall_ms / bound_ms:.2f} | {b.products_alone_ms:.1f} | "
            f"{b.products_alone_ms / bound_ms:.2f} | {paired_ratio(b):.2f} |"
        )
    return (
        "Against the read-bandwidth bound (plain read: the fastest of the reads taken between the row "
        "count's timed passes; products alone: the pass's product modules called back to back, ms; × read "
        "beside it: the median over the timed passes of each pass against the read taken right after it, "
        "which a machine whose memory speed drifts from minute to minute moves least):\n\n" + "\n".join(lines)
    )
