"""forerun's own kernel library: products over GGUF's weight blocks, loaded through ctypes.

`library()` builds the library on first use (`build.py`) and loads it; `problem()` says in one line
why it cannot be used here (no compiler, a failed build), None when it can. The instruction-set path
is chosen from the CPU's features (`path()`), or forced with `FORERUN_KERNEL_PATH` (scalar, avx2,
avx512), and one process uses one path for every product, so a row's result never depends on which
path another call took.

The functions here take torch tensors and hand their memory to the library; callers keep the
tensors alive and contiguous (checked).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
from typing import NamedTuple

import torch

from forerun.base.errors import ForerunError

ABI_VERSION = 11
PATHS = ("scalar", "avx2", "avx512")  # bit i of fr_paths() is PATHS[i]
PATH_ENV = "FORERUN_KERNEL_PATH"

# GGML type ids the products read, by name (gguf.GGMLQuantizationType).
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
TYPE_NAMES = {v: k for k, v in TYPES.items()}

_c_i64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "fr_abi_version": ([], _c_int),
    "fr_paths": ([], _c_int),
    "fr_block_inputs": ([_c_int], _c_int),
    "fr_gguf_block_bytes": ([_c_int], _c_int),
    "fr_packed_bytes": ([_c_int, _c_i64, _c_i64], _c_i64),
    "fr_act_row_bytes": ([_c_i64], _c_i64),
    "fr_repack": ([_c_int, _ptr, _c_i64, _c_i64, _ptr, _c_int], None),
    "fr_dequantize_rows": ([_c_int, _ptr, _c_i64, _ptr, _c_i64, _c_i64, _ptr], _c_i64),
    "fr_to_half": ([_ptr, _c_i64, _ptr], None),
    "fr_quantize": ([_c_int, _ptr, _c_i64, _c_i64, _c_i64, _c_int, _ptr], None),
    "fr_argmax": ([_c_int, _ptr, _c_i64, _c_i64, _c_i64, _ptr], None),
    "fr_softmax_top2": ([_c_int, _ptr, _c_i64, _ptr, _ptr], None),
    "fr_rmsnorm": ([_c_int, _ptr, _c_i64, _c_i64, _c_i64, _ptr, ctypes.c_float, _ptr], None),
    "fr_matmul": ([_c_int, _c_int, _ptr, _c_i64, _c_i64, _ptr, _c_i64, _ptr, _c_i64, _ptr, _c_int], None),
    "fr_layers": ([_c_int, _ptr, _ptr, _c_i64, _ptr, _ptr, _c_i64, _ptr, _c_int], None),
    "fr_norm_head": ([_c_int, _ptr, _ptr, ctypes.c_float, _ptr, _ptr, _c_i64, _ptr, _ptr, _c_int], None),
}

_lock = threading.Lock()


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    from forerun.native import build

    with _lock:
        try:
            path = build.build()
        except build.BuildError as exc:
            return None, f"the native kernels did not build: {exc}"
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            return None, f"the native kernels did not load ({exc})"
    for name, (args, result) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    if lib.fr_abi_version() != ABI_VERSION:
        return None, f"the native kernels at {path} are version {lib.fr_abi_version()}, not {ABI_VERSION}"
    return lib, None


def problem() -> str | None:
    """Why the kernels cannot run here (one line), or None when they can."""
    return _load()[1]


def available() -> bool:
    return problem() is None


@functools.cache
def version() -> str | None:
    """The loaded library's identity (a hash of its sources, the compiler and the flags), so that what
    was measured with one build is not taken for another's; None when the kernels cannot run here."""
    if not available():
        return None
    from forerun.native import build

    return build.library_path().parent.name


def library() -> ctypes.CDLL:
    lib, why = _load()
    if lib is None:
        raise ForerunError(f"{why}; use --quantization w8a8 (or auto, which falls back to it)")
    return lib


def paths() -> list[str]:
    """The instruction-set paths this CPU runs, the portable one first."""
    mask = library().fr_paths()
    return [name for i, name in enumerate(PATHS) if mask >> i & 1]


@functools.cache
def path() -> str:
    """The path every product of this process takes: `FORERUN_KERNEL_PATH`, else the widest the CPU has."""
    runs = paths()
    asked = os.environ.get(PATH_ENV, "").strip().lower()
    if asked:
        if asked not in runs:
            raise ForerunError(f"{PATH_ENV}={asked!r}: this CPU runs {', '.join(runs)}; unset it to let forerun choose")
        return asked
    return runs[-1]


def supports(type_id: int) -> bool:
    return type_id in TYPE_NAMES


def block_inputs(type_id: int) -> int:
    """Inputs per block of a type (256 for K-quants, 32 for the others); 0 for a type not read here."""
    return library().fr_block_inputs(type_id)


def gguf_block_bytes(type_id: int) -> int:
    return library().fr_gguf_block_bytes(type_id)


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> int:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype} {tuple(t.shape)}")
    return t.data_ptr()


def repack(type_id: int, raw: torch.Tensor, n: int, k: int, threads: int | None = None) -> torch.Tensor:
    """A GGUF tensor's blocks (uint8, n rows of k inputs, as in the file) in the kernels' tile layout."""
    lib = library()
    size = lib.fr_packed_bytes(type_id, n, k)
    if size < 0:
        raise ValueError(f"type {TYPE_NAMES.get(type_id, type_id)} with {k} inputs a row cannot be read here")
    expected = n * k // block_inputs(type_id) * gguf_block_bytes(type_id)
    if raw.numel() != expected:
        raise ValueError(f"{raw.numel()} bytes for {n} x {k} {TYPE_NAMES[type_id]}, expected {expected}")
    out = weight_buffer(size)
    lib.fr_repack(type_id, _check(raw, torch.uint8, "raw"), n, k, out.data_ptr(), threads or torch.get_num_threads())
    return out


HUGE_PAGE = 2 << 20


def weight_buffer(size: int) -> torch.Tensor:
    """uint8 [size] for weights a pass streams through: where the kernel backs it with 2 MiB pages
    (Linux, transparent huge pages on madvise), one TLB entry covers 512 times the bytes, and the
    hardware prefetcher, which stops at page edges, runs on."""
    if size < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(size, dtype=torch.uint8)
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + size]


def dequantize_rows(type_id: int, raw: torch.Tensor, k: int, rows: torch.Tensor, what: str = "row") -> torch.Tensor:
    """Rows `rows` (int64) of a GGUF tensor of k inputs a row, as float32 [len(rows), k]; an
    IndexError naming `what` for a row the tensor lacks."""
    rows = rows.to(torch.int64).contiguous()
    stored = raw.numel() // (k // block_inputs(type_id) * gguf_block_bytes(type_id))
    out = torch.empty(rows.numel(), k, dtype=torch.float32)
    bad = library().fr_dequantize_rows(
        type_id, _check(raw, torch.uint8, "raw"), k, rows.data_ptr(), rows.numel(), stored, out.data_ptr()
    )
    if bad >= 0:
        raise IndexError(f"{what} {int(rows[bad])} out of range [0, {stored})")
    return out


def to_half(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded to float16 as the native layers store a float16 cache's entries."""
    flat = x.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), dtype=torch.int16)
    library().fr_to_half(_check_rows(flat), flat.numel(), out.data_ptr())
    return out.view(torch.float16).view(x.shape)


def rmsnorm(x: torch.Tensor, gain: torch.Tensor, eps: float, kernel_path: str | None = None) -> torch.Tensor:
    """x [..., n] float32 (n a multiple of 16) normalised as the native layers' RMSNorms: each row's
    sum of squares over 16 lanes in a fixed order, so a row's bits are its own on every path."""
    n = x.shape[-1]
    if n % 16 or gain.shape != (n,) or gain.dtype != torch.float32 or not gain.is_contiguous():
        raise ValueError(f"rmsnorm takes rows of a multiple of 16 and a float32 gain of as many, not {n}")
    rows = x.reshape(-1, n)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape[0], n)
    at = PATHS.index(kernel_path or path())
    library().fr_rmsnorm(at, _check_rows(rows), rows.shape[0], n, rows.stride(0), gain.data_ptr(), eps, out.data_ptr())
    return out.view(x.shape)


def act_row_bytes(k: int) -> int:
    return library().fr_act_row_bytes(k)


def quantize(
    x: torch.Tensor, block: int, out: torch.Tensor | None = None, kernel_path: str | None = None
) -> torch.Tensor:
    """Rows of x [m, k] float32 as the products' int8 activation blocks (of `block` inputs): uint8 [m, row bytes]."""
    m, k = x.shape
    stride = x.stride(0)
    if x.stride(1) != 1 or k % block:
        raise ValueError(f"x's rows must be contiguous and a multiple of {block} wide, got {tuple(x.shape)}")
    if out is None:
        out = torch.empty(m, act_row_bytes(k), dtype=torch.uint8)
    elif out.shape[0] < m or out.numel() < m * act_row_bytes(k):
        raise ValueError(f"out holds {tuple(out.shape)}, {m} rows of {act_row_bytes(k)} bytes are needed")
    library().fr_quantize(
        PATHS.index(kernel_path or path()), _check_rows(x), m, k, stride, block, _check(out, torch.uint8, "out")
    )
    return out


def _check_rows(x: torch.Tensor) -> int:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU float32 tensor, got {x.dtype} on {x.device}")
    return x.data_ptr()


def matmul(
    type_id: int,
    packed: torch.Tensor,
    n: int,
    k: int,
    act: torch.Tensor,
    m: int,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel_path: str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """out[r, :n] = rows' activations times the packed weight (+ bias); out [m, >= n] float32, rows contiguous."""
    lib = library()
    if out.stride(1) != 1 or out.dtype != torch.float32 or out.shape[0] < m or out.shape[1] < n:
        raise ValueError(f"out must be float32 [>= {m}, >= {n}] with contiguous rows, got {tuple(out.shape)}")
    if packed.numel() != lib.fr_packed_bytes(type_id, n, k) or act.numel() < m * act_row_bytes(k):
        raise ValueError(
            f"packed ({packed.numel()} bytes) or act ({act.numel()}) do not fit {n} x {k} "
            f"{TYPE_NAMES.get(type_id, type_id)} for {m} rows"
        )
    if bias is not None and bias.numel() < n:
        raise ValueError(f"bias has {bias.numel()} values for {n} outputs")
    lib.fr_matmul(
        PATHS.index(kernel_path or path()),
        type_id,
        _check(packed, torch.uint8, "packed"),
        n,
        k,
        _check(act, torch.uint8, "act"),
        m,
        out.data_ptr(),
        out.stride(0),
        None if bias is None else _check(bias, torch.float32, "bias"),
        threads or torch.get_num_threads(),
    )
    return out


def loaded() -> bool:
    """Whether this process has the kernels loaded already (asking `available` may build them)."""
    return _load.cache_info().currsize > 0 and available()


def argmax(x: torch.Tensor, kernel_path: str | None = None) -> torch.Tensor:
    """x [..., n] -> int64 [...]: torch.argmax(x, -1) (the first largest, a NaN the largest). A
    float32 CPU tensor with contiguous rows goes through the kernels when the process has them
    loaded (its products do): torch's scan reads about 1 GB/s, 130 us a 152k-vocabulary row, the
    kernels' at cache speed, and a decode step takes several. Otherwise torch's own."""
    n = x.shape[-1] if x.dim() else 0
    if n == 0 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1 or not loaded():
        return x.argmax(-1)
    rows = x.reshape(-1, n)  # a view where the rows are evenly spaced, else a copy
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    at = PATHS.index(kernel_path or path())
    library().fr_argmax(at, rows.data_ptr(), rows.shape[0], n, rows.stride(0), out.data_ptr())
    return out.reshape(x.shape[:-1])


class Top2(NamedTuple):
    """A row of logits' two likeliest entries under its softmax."""

    first: int  # the argmax (torch.argmax's: the first largest)
    second: int  # the first largest of the others
    p_first: float  # their softmax probabilities
    p_second: float


def softmax_top2(x: torch.Tensor, kernel_path: str | None = None) -> Top2:
    """x [n] logits (n >= 2) -> its softmax's two likeliest entries, in one pass of the kernels
    (float32 on the CPU, the kernels loaded) where a draft token took a softmax, two argmaxes and a
    copy of the row. Otherwise through torch, whose probabilities may differ in the last bits."""
    n = x.shape[-1]
    if x.dim() != 1 or n < 2:
        raise ValueError(f"softmax_top2 takes one row of at least 2 logits, not a tensor of shape {tuple(x.shape)}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1 or not loaded():
        probs = x.float().softmax(-1)
        first = int(probs.argmax())
        rest = probs.clone()
        rest[first] = -1.0  # below any probability: the second is the largest of the rest
        second = int(rest.argmax())
        return Top2(first, second, float(probs[first]), float(probs[second]))
    idx, prob = (ctypes.c_int64 * 2)(), (ctypes.c_float * 2)()
    library().fr_softmax_top2(PATHS.index(kernel_path or path()), x.data_ptr(), n, idx, prob)
    return Top2(idx[0], idx[1], prob[0], prob[1])
