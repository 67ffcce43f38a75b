"""c(r), the target's pass time over r rows: measured once per machine, model and numeric format,
cached under FORERUN_HOME/costs, and corrected by the steps the engine times.

See docs/architecture.md, Cost policy.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forerun import native
from forerun.base import cpu
from forerun.base.files import write_json
from forerun.base.paths import cache_dir
from forerun.models.attention import RowLayout
from forerun.models.gguf_format import GGUFLinear
from forerun.models.load import LoadedModel, model_identity
from forerun.models.w8a8 import W8A8Linear

MEASURED_ROWS = 16  # c(r) is measured for r = 1 .. 16,
WIDE_ROWS = (24, 32, 48, 64, 96, 128)  # and at these wider passes (a full batch's rows), linear between
MEASURE_CONTEXT = 256  # cache length the passes are timed at
LEARN_AFTER = 3  # steps over a row count before its own running mean replaces the scaled offline figure


@dataclass
class PassCosts:
    """The target's pass time for 1 .. len(seconds) rows, and for the row counts in `wide` past
    them; linear between those, and past the last with the last two's slope.

    Made non-decreasing: a timing above a wider pass's is noise. With `learn`,
    the steps the engine times (the pass plus the acceptance rule and cache roll-back, on a machine
    as busy as it is now) correct it as generation goes: a row count seen a few times is its own
    running mean, the others the offline figure times the running ratio of seen to offline. Plain
    steps (one row) and verifications keep separate ratios: a verification's work around the pass
    (a tree's mask, the rule over its nodes, a window's rows) is not in the offline figure, and a
    drafter whose row count changes every step is priced by it before any count is seen often."""

    seconds: list[float]
    wide: dict[int, float] = field(default_factory=dict)  # rows past len(seconds) -> seconds
    learn: bool = False
    scale: float = 1.0  # running mean of seen / offline, one-row steps
    multi_scale: float | None = None  # the same over steps of several rows
    online: dict[int, float] = field(default_factory=dict)  # rows -> running mean of seen step times
    seen: dict[int, int] = field(default_factory=dict)  # rows -> steps seen

    def __post_init__(self) -> None:
        # Noise only adds time: a timing above a wider pass's is a slow moment, and comes down to it
        # (raising the wider ones instead would spread one slow moment over every row count after it).
        wide = dict(sorted((r, t) for r, t in self.wide.items() if r > len(self.seconds)))
        times = [*self.seconds, *wide.values()]
        for i in range(len(times) - 2, -1, -1):
            times[i] = min(times[i], times[i + 1])
        self.seconds[:] = times[: len(self.seconds)]
        self.wide = dict(zip(wide, times[len(self.seconds) :]))

    def offline(self, rows: int) -> float:
        s = self.seconds
        if rows <= len(s):
            return s[rows - 1]
        points = [(len(s), s[-1]), *self.wide.items()]
        for (r0, t0), (r1, t1) in zip(points, points[1:]):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        if len(points) > 1:
            (r0, t0), (r1, t1) = points[-2:]
            slope = (t1 - t0) / (r1 - r0)
        else:
            slope = max(s[-1] - s[-2], 0.0) if len(s) > 1 else s[-1]
        return points[-1][1] + slope * (rows - points[-1][0])

    def __call__(self, rows: int) -> float:
        if not self.online:
            return self.offline(rows)
        return max(self._estimate(r) for r in range(1, rows + 1))

    def _estimate(self, rows: int) -> float:
        if self.seen.get(rows, 0) >= LEARN_AFTER:
            return self.online[rows]
        scale = self.multi_scale if rows > 1 and self.multi_scale is not None else self.scale
        return self.offline(rows) * scale

    def observe(self, rows: int, seconds: float) -> None:
        """A step over `rows` rows took `seconds` (ignored unless `learn`)."""
        if not self.learn:
            return
        ratio = seconds / self.offline(rows)
        if rows > 1:
            self.multi_scale = ratio if self.multi_scale is None else 0.9 * self.multi_scale + 0.1 * ratio
        else:
            first = not self.seen.get(1)
            self.scale = ratio if first else 0.9 * self.scale + 0.1 * ratio
        count = self.seen.get(rows, 0)
        self.online[rows] = seconds if count == 0 else 0.8 * self.online[rows] + 0.2 * seconds
        self.seen[rows] = count + 1


def measure_pass_costs(
    decoder,
    rows: int = MEASURED_ROWS,
    context: int = MEASURE_CONTEXT,
    repeats: int = 3,
    wide: tuple[int, ...] = WIDE_ROWS,
) -> PassCosts:
    """Time one chain pass over 1..rows rows, and over each of `wide` rows past them (those within
    half the model's context), after `context` cached slots (the fastest of `repeats`).

    The cache holds zeros: time does not depend on the values, and nothing is prefilled.
    """
    limit = decoder.cfg.max_position
    wide = tuple(r for r in wide if rows < r <= limit // 2)
    widest = max((rows, *wide))
    context = min(context, limit - widest)
    cache = decoder.new_cache(context + widest)
    tokens = torch.zeros(widest, dtype=torch.long, device=decoder.device)
    positions = torch.arange(context, context + widest, device=decoder.device)
    timed = {}
    with torch.inference_mode():
        for r in (*range(1, rows + 1), *wide):
            best = float("inf")
            for _ in range(repeats + 1):  # the first run warms kernels and buffers
                cache.length = context
                start = time.perf_counter()
                decoder(tokens[:r], positions[:r], cache, layout=RowLayout.chain(context, r), last_only=False)
                best = min(best, time.perf_counter() - start)
            timed[r] = best
    return PassCosts([timed[r] for r in range(1, rows + 1)], {r: timed[r] for r in wide})


def costs_dir() -> Path:
    return cache_dir("costs")


def cached_pass_costs(model: LoadedModel, rows: int = MEASURED_ROWS) -> PassCosts:
    """c(r) for `model` on this machine, learning from the steps timed: from FORERUN_HOME/costs when
    measured before, else measured now (and cached when the weights have an identity to cache against)."""
    key = _cost_key(model, rows)
    path = costs_dir() / f"{key}.json" if key else None
    saved = _read_costs(path) if path is not None and path.exists() else None
    if saved is not None:
        return saved
    if path is not None:
        print(
            f"forerun: timing {model.name}'s pass over 1-{rows} rows and wider, once for this machine "
            f"(cached in {path.parent})",
            file=sys.stderr,
            flush=True,
        )
    costs = measure_pass_costs(model.decoder, rows)
    costs.learn = True
    if path is not None:
        write_json(path, {"model": model.name, "seconds": costs.seconds, "wide": costs.wide})
    return costs


def _read_costs(path: Path) -> PassCosts | None:
    """The costs cached at `path`, learning; None when unreadable (measured again and overwritten)."""
    try:
        saved = json.loads(path.read_text())
        return PassCosts(
            [float(s) for s in saved["seconds"]], {int(r): float(s) for r, s in saved["wide"].items()}, learn=True
        )
    except (ValueError, KeyError, TypeError):
        return None


def _cost_key(model: LoadedModel, rows: int) -> str | None:
    """Weights, numeric format, machine and threads: what the measured times depend on."""
    identity = model_identity(model)
    if identity is None:
        return None
    decoder = model.decoder
    # A product's kernel is part of its kind (the kernels cost differently per row count), and so is
    # whether the layers run natively.
    kinds = sorted(
        {
            type(m).__name__ + (f"[{m.kernel}]" if isinstance(m, (W8A8Linear, GGUFLinear)) else "")
            for m in decoder.modules()
        }
        | {f"native layers: {decoder._native_layers() is not None}", f"cache {decoder.cache_dtype}"}
    )
    if any(isinstance(m, GGUFLinear) for m in decoder.modules()):
        kinds.append(f"kernels {native.version()}")  # a faster build times differently
    dtypes = sorted({str(t.dtype) for t in [*decoder.parameters(), *decoder.buffers()]})
    # The CPU's name alone does not tell its generations apart (one "AMD EPYC" has AVX2 only, another
    # AVX-512 at half width, another at full width): its numbers and vector units are in the key too.
    parts = [
        identity,
        ",".join(kinds),
        ",".join(dtypes),
        str(decoder.device),
        cpu.describe(),
        torch.backends.cpu.get_cpu_capability(),
        str(torch.get_num_threads()),
        torch.__version__,
        str(rows),
        str(WIDE_ROWS),
        str(MEASURE_CONTEXT),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]
