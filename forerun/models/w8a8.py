"""w8a8: int8 weights (one scale per output channel) times int8 activations (one scale per row),
through an int8 product whose cost stays nearly flat from one row to several.

Every row is quantized here, by its own peak: a row's entries become the integers
round(x / step) with step = max |x| / 127 (the peak lands exactly on ±127). The integer product is
exact, so a row's integer sums are the same alone or in any batch, and whatever kernel computes
them; the kernel turns a sum into float32 with one rounding (sum · weight scale), and the row's
step is applied after it, per element. A row comes out bit-identical alone or in any batch, and
the same through either kernel: what greedy equality between plain and speculative decoding rests on.

Two kernels, used alone or mixed by row count (`kernel()` picks per CPU, `FORERUN_W8A8_KERNEL`
overrides it); with 8-bit activations both give the same bits, so mixing them keeps rows exact:
- onednn (`torch.ops.onednn.qlinear_pointwise`, int8 activations as they are): on CPUs with AMX int8
  units it stays flat to 16 rows (the 1.5B's products, weights in memory: 58 / 60 / 60 ms for
  1 / 4 / 16 rows, fbgemm 56 / 73 / 100), but costs ~10-40 µs more per call.
- fbgemm (`quantized::linear_dynamic`): it takes float input and quantizes it with one range for the
  whole tensor, so two extra input columns hold ±(levels + ½): the range is then always the same,
  and the integer-valued rows land exactly on its levels. The columns (zero weights) are padded to a
  multiple of 32 (fbgemm slows by ~30 % on an odd K). On CPUs without VNNI (AVX2) fbgemm adds pairs
  of u8 x s8 products in int16 with saturation, so activations use 7 bits there (`reduce_range`:
  63 levels a side); where the full 8 bits do not saturate they are used. `reduce_range_needed()`
  tries it once rather than trusting CPU flags. On the AVX2 EPYC fbgemm is flat to four rows.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from forerun.base import cpu
from forerun.base.errors import ForerunError

PAD_MULTIPLE = 32
KERNELS = ("mixed", "onednn", "fbgemm")
KERNEL_ENV = "FORERUN_W8A8_KERNEL"
ONEDNN_FROM_ROWS = 2  # "mixed": onednn from this many rows (flat to 16), fbgemm below (less overhead per call)


def padded_width(in_features: int) -> int:
    """fbgemm's input width: room for the two range columns, rounded up to a multiple of 32."""
    return -(-(in_features + 2) // PAD_MULTIPLE) * PAD_MULTIPLE


def available(device: torch.device | str = "cpu") -> bool:
    return torch.device(device).type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines


@functools.cache
def reduce_range_needed() -> bool:
    """True when full-range u8 activations saturate fbgemm's int16 pair sums on this CPU."""
    n, k = 8, 64
    qweight = torch.full((n, k), 127, dtype=torch.int8)
    qweight[:, -2:] = 0  # the range columns, as real products have them
    x = torch.full((2, k), 127.0)
    x[1] = -127.0
    x[:, -2:] = torch.tensor([levels(False) + 0.5, -levels(False) - 0.5])
    y = _dynamic_linear(x, _prepack(qweight, torch.ones(n)), reduce_range=False)
    return not torch.equal(y[:, 0], torch.tensor([127.0 * 127 * (k - 2), -127.0 * 127 * (k - 2)]))


@functools.cache
def onednn_exact() -> bool:
    """onednn's int8 product runs in this PyTorch and sums extreme int8 rows exactly."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    n, k = 8, 64
    try:
        packed = torch.ops.onednn.qlinear_prepack(torch.full((n, k), 127, dtype=torch.int8), None)
        x = torch.full((2, k), 127, dtype=torch.int8)
        x[1] = -127
        y = _onednn_linear(x, packed, torch.ones(n), torch.zeros(n, dtype=torch.long))
    except RuntimeError:
        return False
    return torch.equal(y[:, 0], torch.tensor([127.0 * 127 * k, -127.0 * 127 * k]))


@functools.cache
def kernel() -> str:
    """The kernels w8a8 products use here: where the CPU has AMX int8 units, "mixed" (fbgemm for one
    row, onednn from two: onednn is flat to 16 rows there but costs more per call); elsewhere
    fbgemm alone (flat to four rows on the AVX2 EPYC). `FORERUN_W8A8_KERNEL` overrides."""
    asked = os.environ.get(KERNEL_ENV, "").strip().lower()
    if asked:
        problem = kernel_problem(asked)
        if problem is not None:
            raise ForerunError(f"{KERNEL_ENV}={asked!r}: {problem}; unset it to let forerun choose")
        return asked
    amx = "amx_int8" in cpu.flags() and onednn_exact()
    return "mixed" if amx and not reduce_range_needed() else "fbgemm"


def kernel_problem(name: str) -> str | None:
    """Why the w8a8 kernel `name` cannot run exactly here; None when it can."""
    if name not in KERNELS:
        return f"not a w8a8 kernel; use one of {', '.join(KERNELS)}"
    if name != "fbgemm" and not onednn_exact():
        return "onednn's int8 product does not run exactly in this PyTorch; use fbgemm"
    if name == "mixed" and reduce_range_needed():
        return "mixed needs 8-bit activations in fbgemm, which saturate on this CPU; use onednn or fbgemm"
    return None


def levels(reduce_range: bool) -> int:
    """Activation levels on each side of zero: 127 (8 bits), 63 where fbgemm needs 7."""
    return 63 if reduce_range else 127


def _engine() -> None:
    if torch.backends.quantized.engine != "fbgemm":
        torch.backends.quantized.engine = "fbgemm"


def _prepack(qweight: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed form of int8 weights [out, in] with per-channel scales [out]."""
    _engine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.13 flags its quantized-tensor API as deprecated
        q = torch._make_per_channel_quantized_tensor(
            qweight, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0
        )
        return torch.ops.quantized.linear_prepack(q, None)


def _dynamic_linear(x: torch.Tensor, packed, reduce_range: bool) -> torch.Tensor:
    # No warnings filter here: the product itself warns of nothing, and a catch_warnings block costs
    # ~35 µs, a tenth of a small product.
    return torch.ops.quantized.linear_dynamic(x, packed, reduce_range)


def _onednn_linear(x: torch.Tensor, packed, scale: torch.Tensor, zero_points: torch.Tensor) -> torch.Tensor:
    """int8 rows [R, in] times the packed int8 weights: float32 [R, out], each sum times its scale."""
    return torch.ops.onednn.qlinear_pointwise(
        x, 1.0, 0, packed, scale, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )


class _Scratch(threading.local):
    """Input buffers reused across calls, one per shape kind and thread."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def rows(
        self, count: int, width: int, dtype: torch.dtype = torch.float32, pinned: tuple[int, float] | None = None
    ) -> torch.Tensor:
        """[count, width]; `pinned` (column, value): that column holds +value and the next -value."""
        key = (width, dtype, pinned)
        buf = self.buffers.get(key)
        if buf is None or buf.shape[0] < count:
            # A normal tensor, not an inference one: callers write into it inside and outside inference mode.
            with torch.inference_mode(False):
                buf = torch.zeros(max(count, 2 * (buf.shape[0] if buf is not None else 8)), width, dtype=dtype)
                if pinned is not None:
                    buf[:, pinned[0]] = pinned[1]
                    buf[:, pinned[0] + 1] = -pinned[1]
            self.buffers[key] = buf
        return buf[:count]


_scratch = _Scratch()


class W8A8Linear(nn.Module):
    """y = x @ weight.T + bias with int8 weights and per-row int8 activations (float32 in and out).

    With `norm_eps` the product reads the un-normalised input and applies RMSNorm itself: the norm's
    weight is folded into the weight's columns, and since every row is scaled by its own peak
    anyway, normalising costs one more factor per row instead of two passes over the row.

    Keeps the kernel's packed weight and the int8 weight it came from (`qweight()`, for caching and
    for building other heads from it; loaded from the cache it is a memory map of the file).
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        norm_eps: float | None = None,
        kernel_name: str | None = None,
    ) -> None:
        """qweight [out, in] int8; scale [out] (weight ~ qweight * scale); bias [out] or None;
        `kernel_name`: one of KERNELS, else this CPU's `kernel()`."""
        super().__init__()
        self.norm_eps = norm_eps
        out_features, in_features = qweight.shape
        self.in_features, self.out_features = in_features, out_features
        self.kernel = kernel_name or kernel()
        problem = kernel_problem(self.kernel) if kernel_name else None
        if problem is not None:
            raise ValueError(f"w8a8 kernel {self.kernel!r}: {problem}")
        self._qweight = qweight
        self.register_buffer("scale", scale.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        # Rows from which onednn computes the product; fewer go through fbgemm.
        self._onednn_from = {"onednn": 1, "mixed": ONEDNN_FROM_ROWS, "fbgemm": sys.maxsize}[self.kernel]
        self.reduce_range = self.kernel == "fbgemm" and reduce_range_needed()
        if self.kernel != "fbgemm":
            self._onednn = torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None)
            self._zero_points = torch.zeros(out_features, dtype=torch.long)
        if self.kernel != "onednn":
            self.width = padded_width(in_features)
            padded = torch.zeros(out_features, self.width, dtype=torch.int8)
            padded[:, :in_features] = qweight
            self._fbgemm = _prepack(padded, self.scale)
            self._pin = (in_features, levels(self.reduce_range) + 0.5)
        self._inv_levels = 1.0 / levels(self.reduce_range)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        norm_eps: float | None = None,
        kernel_name: str | None = None,
    ) -> W8A8Linear:
        qweight, scale = quantize_weight(weight)
        return cls(qweight, scale, bias, norm_eps, kernel_name)

    def qweight(self) -> torch.Tensor:
        """The int8 weight [out, in]."""
        return self._qweight

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "qweight"] = self.qweight()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"kernel={self.kernel}" + (f", rms_norm_eps={self.norm_eps}" if self.norm_eps is not None else "")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)  # [R, in]
        count = rows.shape[0]
        step = rows.abs().amax(-1, keepdim=True).clamp_min_(1e-30).mul_(self._inv_levels)  # [R, 1]
        if count >= self._onednn_from:
            levels_ = torch.div(rows, step, out=_scratch.rows(count, self.in_features)).round_()
            quantized = _scratch.rows(count, self.in_features, torch.int8).copy_(levels_)  # exact: integers
            y = _onednn_linear(quantized, self._onednn, self.scale, self._zero_points)  # [R, out]
        else:
            buf = _scratch.rows(count, self.width, pinned=self._pin)  # [R, width]
            torch.div(rows, step, out=buf[:, : self.in_features]).round_()
            y = _dynamic_linear(buf, self._fbgemm, self.reduce_range)  # [R, out]
        if self.norm_eps is not None:
            # x / rms(x) / peak(x / rms(x)) == x / peak(x): the norm survives only as a factor per row.
            step.mul_(torch.rsqrt(rows.pow(2).mean(-1, keepdim=True).add_(self.norm_eps)))
        y.mul_(step)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*shape[:-1], self.out_features)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8: (qweight [out, in] int8, scale [out] float32)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


# --- a whole decoder ----------------------------------------------------------------------------


def quantize_decoder_(decoder, progress: bool = False, kernel_name: str | None = None):
    """Every product of `decoder` (float weights) to w8a8, in place; returns `decoder`.

    q/k/v and gate/up are fused into one product each, and each reads the block's raw input: the
    RMSNorm before it is folded in (`W8A8Linear.norm_eps`; the block's norm becomes an identity), and
    q comes out already scaled by 1/sqrt(head_dim). The final norm stays (its output is the hidden
    state feature-level drafters read). Norms, biases and activations are float32.
    `progress`: a bar on stderr; `kernel_name`: one of KERNELS, else this CPU's.
    """
    from tqdm import tqdm

    cfg = decoder.cfg
    q_rows = cfg.num_heads * cfg.head_dim
    for block in tqdm(
        decoder.layers,
        desc="quantizing to w8a8 (once)",
        unit="layer",
        file=sys.stderr,
        disable=not progress,
        leave=False,
    ):
        attn, mlp = block.self_attn, block.mlp
        gain = block.input_layernorm.weight.detach().float()  # [hidden]
        weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).float() * gain
        # q carries 1/sqrt(head_dim) from here: in its rows, or in its norm's gain where a norm follows them
        prescale = 1.0 if cfg.qk_norm else cfg.head_dim**-0.5
        weight[:q_rows] *= prescale
        if cfg.qk_norm:
            attn.q_norm.weight = nn.Parameter(attn.q_norm.weight.detach().float() * cfg.head_dim**-0.5)
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).float()
            bias[:q_rows] *= prescale
        attn.qkv_proj = W8A8Linear.from_float(weight, bias, block.input_layernorm.eps, kernel_name)
        attn.o_proj = W8A8Linear.from_float(attn.o_proj.weight, kernel_name=kernel_name)
        gain = block.post_attention_layernorm.weight.detach().float()
        weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).float() * gain
        mlp.gate_up_proj = W8A8Linear.from_float(weight, None, block.post_attention_layernorm.eps, kernel_name)
        mlp.down_proj = W8A8Linear.from_float(mlp.down_proj.weight, kernel_name=kernel_name)
        _fold_norms(block)
    decoder.lm_head = W8A8Linear.from_float(decoder.lm_head.weight, kernel_name=kernel_name)
    _float_norms(decoder)
    return decoder


def _fold_norms(block) -> None:
    """The block's norms now live in its fused products; their modules become identities."""
    attn, mlp = block.self_attn, block.mlp
    del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
    block.input_layernorm = nn.Identity()
    block.post_attention_layernorm = nn.Identity()
    attn.q_prescaled = True


def load_decoder_(decoder, state: dict[str, torch.Tensor], kernel_name: str | None = None):
    """Fill a decoder built on the meta device from a w8a8 state dict (what `state_dict()` of a
    quantized decoder holds: qweight, scale and bias per product, then norms and the embedding).
    `kernel_name`: one of KERNELS, else this CPU's.

    fbgemm packs weights at ~55 MB/s per thread but lets go of the GIL, so the products are packed
    on every thread torch uses (a 1.5B model: ~14 s on two cores instead of ~28 s; onednn packs
    ~10 times as fast).
    """
    names = [
        f"layers.{i}.{part}"
        for i in range(len(decoder.layers))
        for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]
    names.append("lm_head")
    eps = decoder.cfg.rms_norm_eps
    args = [
        (
            state.pop(f"{n}.qweight"),
            state.pop(f"{n}.scale"),
            state.pop(f"{n}.bias", None),
            eps if n.endswith(("qkv_proj", "gate_up_proj")) else None,
            kernel_name,
        )
        for n in names
    ]
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        products = dict(zip(names, pool.map(lambda a: W8A8Linear(*a), args)))
    for i, block in enumerate(decoder.layers):
        attn, mlp = block.self_attn, block.mlp
        attn.qkv_proj = products[f"layers.{i}.self_attn.qkv_proj"]
        attn.o_proj = products[f"layers.{i}.self_attn.o_proj"]
        mlp.gate_up_proj = products[f"layers.{i}.mlp.gate_up_proj"]
        mlp.down_proj = products[f"layers.{i}.mlp.down_proj"]
        _fold_norms(block)
    decoder.lm_head = products["lm_head"]
    result = decoder.load_state_dict(state, assign=True, strict=False)
    owned = {name for name, module in decoder.named_modules() if isinstance(module, W8A8Linear)}
    missing = [k for k in result.missing_keys if k.rpartition(".")[0] not in owned]
    if missing or result.unexpected_keys:
        raise KeyError(
            f"w8a8 weights do not fit the model: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}"
        )
    _float_norms(decoder)
    return decoder


def _float_norms(decoder) -> None:
    for module in decoder.modules():
        if hasattr(module, "eps") and hasattr(module, "weight"):  # RMSNorm
            module.weight = nn.Parameter(module.weight.detach().float(), requires_grad=False)
    decoder.activation_dtype = torch.float32
