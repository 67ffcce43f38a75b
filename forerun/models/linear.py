"""The one wrapper every weight matrix sits behind, so other numeric formats drop in unchanged."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 bf16 dot products, AMX): oneDNN's own check."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# Without native bf16 matrix units (AVX2-only CPUs), a bf16 product costs time linear in its rows.
# During a prefill (and only then) a product of this many rows or more upcasts the weight to float32
# instead (measured on a 1.5B model: 8 rows 1.1 s vs 1.3 s, 16 rows 2.4 s vs 1.8 s, 48 rows 6.6 s vs
# 2.4 s per forward). Verification never does: its rows must come out exactly as one-row decoding's.
_UPCAST_ROWS = 12
# The int8 kernel's cost grows more slowly with rows: float32 wins only from about 64 rows on
# (48 rows: 2.3 s in the kernel vs 2.6 s through float32).
_INT8_FLOAT_ROWS = 64
_UPCAST_BF16 = not cpu_has_native_bf16()
_prefill: contextvars.ContextVar[bool] = contextvars.ContextVar("forerun_prefill", default=False)


class _Scratch(threading.local):
    """Per thread, so two requests prefilling at once never share a buffer."""

    def __init__(self) -> None:
        self.by_device: dict[torch.device, torch.Tensor] = {}


_scratch = _Scratch()
_SCRATCH_MAX = 1 << 26  # elements (256 MB): a vocabulary-sized LM head gets a temporary instead


def _float_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as float32 in one scratch buffer reused by every layer (valid until this thread's next call).

    A fresh multi-megabyte tensor per product costs more in page faults than the conversion itself.
    """
    if weight.numel() > _SCRATCH_MAX:
        return weight.float()
    buf = _scratch.by_device.get(weight.device)
    if buf is None or buf.numel() < weight.numel():
        buf = _scratch.by_device[weight.device] = torch.empty(weight.numel(), dtype=torch.float32, device=weight.device)
    return buf[: weight.numel()].view(weight.shape).copy_(weight)


@contextlib.contextmanager
def prefill() -> Iterator[None]:
    """Inside this block many-row products may take the float32 path (prompt processing only)."""
    token = _prefill.set(True)
    try:
        yield
    finally:
        _prefill.reset(token)


def _float_path(x: torch.Tensor, min_rows: int) -> bool:
    # The flag first: every decode-step product asks, and outside a prefill the answer is no.
    return _prefill.get() and x.device.type == "cpu" and x.numel() >= min_rows * x.shape[-1]


class Linear(nn.Module):
    """y = x @ weight.T + bias, with weight [out_features, in_features] in the model's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _UPCAST_BF16 and x.dtype == torch.bfloat16 and _float_path(x, _UPCAST_ROWS):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), _float_weight(self.weight), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """Weight-only int8 (per output row scale): half the bytes per pass, for a decode-bound model.

    A quantized target is the target: plain and speculative runs use the same int8 numbers, and the
    kernel computes each row independently of how many rows come along.
    """

    def __init__(self, source: Linear, from_meta: bool = False) -> None:
        """`from_meta`: only shape the buffers (on the meta device); a cached state dict fills them."""
        super().__init__()
        w = source.weight.detach()  # [out, in]
        if from_meta:
            self.register_buffer("qweight", torch.empty(w.shape, dtype=torch.int8, device="meta"))
            self.register_buffer("scale", torch.empty(w.shape[0], dtype=w.dtype, device="meta"))
        else:
            w = w.float()
            scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
            self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8))
            self.register_buffer("scale", scale.to(source.weight.dtype))
        self.bias = source.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if _float_path(x, _INT8_FLOAT_ROWS):
            y = F.linear(x.float(), _float_weight(self.qweight)) * self.scale.float()
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.scale.dtype), self.qweight, self.scale)
        y = y.reshape(*shape[:-1], -1)
        return y + self.bias if self.bias is not None else y


def quantize_int8_(module: nn.Module, from_meta: bool = False) -> nn.Module:
    """Replace every Linear inside `module` by its Int8Linear, in place; returns `module`."""
    for name, child in list(module.named_children()):
        if isinstance(child, Linear):
            setattr(module, name, Int8Linear(child, from_meta))
        else:
            quantize_int8_(child, from_meta)
    return module
