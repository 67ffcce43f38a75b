"""What machine a bench ran on: a few lines for the top of report.md (one line for a report without a table),
and its read bandwidth."""

from __future__ import annotations

import os
import platform
import time

import torch

from forerun.base import cpu
from forerun.base.errors import ForerunError


def describe(dtype: str, device: str, quantization: str | None, with_transformers: bool) -> dict[str, str]:
    info = {
        "CPU": cpu.describe(),
        "kernels": kernels(),
        "threads": f"{torch.get_num_threads()} torch threads, {os.cpu_count()} logical cores",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if with_transformers:
        import transformers

        info["transformers"] = transformers.__version__
    info["device"] = device if not device.startswith("cuda") else f"{device} ({torch.cuda.get_device_name(device)})"
    info["dtype"] = dtype + (f", target weights {quantization}" if quantization else "")
    info["OS"] = f"{platform.system()} {platform.release()}"
    return info


def kernels() -> str:
    """The path forerun's native kernels take on this CPU ("avx512 path"), or why they cannot run here."""
    from forerun import native

    if not native.available():
        return f"not available ({(native.problem() or '').splitlines()[0]})"
    try:
        return f"{native.path()} path"
    except ForerunError as exc:  # FORERUN_KERNEL_PATH names a path this CPU lacks: a report still gets written
        return f"not usable ({exc})"


def cpu_line() -> str:
    """One line naming what a benchmark ran on, for reports without a machine table."""
    return f"CPU: {cpu.describe()}; forerun kernels: {kernels()}"


def read_buffer(nbytes: int) -> torch.Tensor:
    """Memory for `read_bandwidth` to read: int8 ones, as float32 0x01010101 (small, not subnormal)."""
    return torch.ones(nbytes, dtype=torch.int8)


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, buffer: torch.Tensor | None = None) -> float:
    """Bytes per second this machine reads from memory with torch's threads: the best of `repeats`
    passes of two reductions (an int8 max and a float32 sum) over `nbytes`, far more than any cache.
    The best is taken because a weight product can do no better than the fastest plain read.
    `buffer` (from `read_buffer`): memory to read, made once by a caller that reads many times."""
    if buffer is None:
        buffer = read_buffer(nbytes)
    nbytes = buffer.numel()
    reads = (lambda: buffer.amax(), lambda: buffer.view(torch.float32).sum())
    best = float("inf")
    for read in reads:
        read()
        for _ in range(repeats):
            start = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - start)
    return nbytes / best
