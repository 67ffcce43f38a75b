"""w8a8: int8 weights (one scale per output channel) times int8 activations (one scale per row),
through fbgemm's int8 product, whose cost stays flat from one row to several.

fbgemm quantizes its input with one range for the whole tensor, so on its own a row's result would
depend on the rows beside it. Here every row is first scaled to max |x| = 1, and two extra input
columns hold +c and -c (their weight columns are zero; c a hair above 1, see `range_pin`): the range
is then always exactly [-c, c], every row is quantized by the same rule whatever else is in the
batch, the integer product is exact, and the float work after it is per element. A row comes out bit-identical alone or in
any batch: what greedy equality between plain and speculative decoding rests on. The two columns
are padded to a multiple of 32 (fbgemm slows by ~30 % on an odd K).

On CPUs without VNNI (AVX2), fbgemm adds pairs of u8 x s8 products in int16 with saturation, so
activations use 7 bits (`reduce_range`); where the full 8 bits do not saturate (VNNI, AMX) they are
used. `reduce_range_needed()` tries it once rather than trusting CPU flags.
"""
from __future__ import annotations

import functools
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

PAD_MULTIPLE = 32


def padded_width(in_features: int) -> int:
    """Input width with room for the two range columns, rounded up to a multiple of 32."""
    return -(-(in_features + 2) // PAD_MULTIPLE) * PAD_MULTIPLE


def available(device: torch.device | str = "cpu") -> bool:
    return torch.device(device).type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines


@functools.cache
def reduce_range_needed() -> bool:
    """True when full-range u8 activations saturate fbgemm's int16 pair sums on this CPU."""
    n, k = 8, 64
    qweight = torch.full((n, k), 127, dtype=torch.int8)
    packed = _prepack(qweight, torch.full((n,), 1 / 127), None)
    x = torch.ones(2, k)
    x[1] = -1.0                                      # the range [-1, 1], as the real rows have
    y = _dynamic_linear(x, packed, reduce_range=False)
    return not torch.allclose(y[0], torch.full((n,), float(k)), rtol=0.02)


def _engine() -> None:
    if torch.backends.quantized.engine != "fbgemm":
        torch.backends.quantized.engine = "fbgemm"


def _prepack(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's packed form of int8 weights [out, in] with per-channel scales [out]."""
    _engine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # torch 2.13 flags its quantized-tensor API as deprecated
        q = torch._make_per_channel_quantized_tensor(qweight, scale.double(),
                                                     torch.zeros_like(scale, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(q, bias)


def _dynamic_linear(x: torch.Tensor, packed, reduce_range: bool) -> torch.Tensor:
    # No warnings filter here: the product itself warns of nothing, and a catch_warnings block costs
    # ~35 µs, a tenth of a small product.
    return torch.ops.quantized.linear_dynamic(x, packed, reduce_range)


def range_pin(reduce_range: bool) -> float:
    """The magnitude c of the two range columns: with the range [-c, c], fbgemm's levels are
    (q - z) * 2c / qmax with z = (qmax + 1) / 2, so c = qmax / (qmax - 1) puts +1 and -1 exactly on
    the levels z ± (z - 1): a row's largest entry is represented exactly, not clipped."""
    qmax = 127 if reduce_range else 255
    return qmax / (qmax - 1)


class _Scratch(threading.local):
    """One padded input buffer per width and thread; the range columns are written once."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}

    def rows(self, count: int, in_features: int, width: int, pin: float) -> torch.Tensor:
        buf = self.buffers.get(width)
        if buf is None or buf.shape[0] < count:
            # A normal tensor, not an inference one: callers write into it inside and outside inference mode.
            with torch.inference_mode(False):
                buf = torch.zeros(max(count, 2 * (buf.shape[0] if buf is not None else 8)), width)
                buf[:, in_features] = pin
                buf[:, in_features + 1] = -pin
            self.buffers[width] = buf
        return buf[:count]


_scratch = _Scratch()


class W8A8Linear(nn.Module):
    """y = x @ weight.T + bias with int8 weights and per-row int8 activations (float32 in and out).

    With `norm_eps` the product reads the un-normalised input and applies RMSNorm itself: the norm's
    weight is folded into the weight's columns, and since every row is scaled by its own peak
    anyway, normalising costs one more factor per row instead of two passes over the row.

    Only the packed weight is kept; `qweight()` and `scale` give the int8 form back for caching.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 norm_eps: float | None = None) -> None:
        """qweight [out, in] int8; scale [out] (weight ~ qweight * scale); bias [out] or None."""
        super().__init__()
        self.norm_eps = norm_eps
        out_features, in_features = qweight.shape
        self.in_features, self.out_features = in_features, out_features
        self.width = padded_width(in_features)
        padded = torch.zeros(out_features, self.width, dtype=torch.int8)
        padded[:, :in_features] = qweight
        self.register_buffer("scale", scale.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        self._packed = _prepack(padded, self.scale, None)
        self.reduce_range = reduce_range_needed()
        self._pin = range_pin(self.reduce_range)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   norm_eps: float | None = None) -> "W8A8Linear":
        qweight, scale = quantize_weight(weight)
        return cls(qweight, scale, bias, norm_eps)

    def qweight(self) -> torch.Tensor:
        """The int8 weight [out, in], unpacked from fbgemm's form."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q, _ = torch.ops.quantized.linear_unpack(self._packed)
        return q.int_repr()[:, :self.in_features].contiguous()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "qweight"] = self.qweight()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (f", rms_norm_eps={self.norm_eps}" if self.norm_eps is not None else ""))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)                                          # [R, in]
        peak = rows.abs().amax(-1, keepdim=True).clamp_min_(1e-30)                      # [R, 1]
        buf = _scratch.rows(rows.shape[0], self.in_features, self.width, self._pin)    # [R, width]
        torch.div(rows, peak, out=buf[:, :self.in_features])
        if self.norm_eps is not None:
            # x / rms(x) / peak(x / rms(x)) == x / peak(x): the norm survives only as a factor per row.
            peak.mul_(torch.rsqrt(rows.pow(2).mean(-1, keepdim=True).add_(self.norm_eps)))
        y = torch.ops.quantized.linear_dynamic(buf, self._packed, self.reduce_range).mul_(peak)  # [R, out]
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*shape[:-1], self.out_features)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8: (qweight [out, in] int8, scale [out] float32)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


# --- a whole decoder ----------------------------------------------------------------------------


def quantize_decoder_(decoder, progress: bool = False):
    """Every product of `decoder` (float weights) to w8a8, in place; returns `decoder`.

    q/k/v and gate/up are fused into one product each, and each reads the block's raw input: the
    RMSNorm before it is folded in (`W8A8Linear.norm_eps`; the block's norm becomes an identity), and
    q comes out already scaled by 1/sqrt(head_dim). The final norm stays (its output is the hidden
    state feature-level drafters read). Norms, biases and activations are float32.
    `progress`: a bar on stderr.
    """
    from tqdm import tqdm

    cfg = decoder.cfg
    q_rows = cfg.num_heads * cfg.head_dim
    for block in tqdm(decoder.layers, desc="quantizing to w8a8 (once)", unit="layer", file=sys.stderr,
                      disable=not progress, leave=False):
        attn, mlp = block.self_attn, block.mlp
        gain = block.input_layernorm.weight.detach().float()                              # [hidden]
        weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).float() * gain
        weight[:q_rows] *= cfg.head_dim ** -0.5
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).float()
            bias[:q_rows] *= cfg.head_dim ** -0.5
        attn.qkv_proj = W8A8Linear.from_float(weight, bias, norm_eps=block.input_layernorm.eps)
        attn.o_proj = W8A8Linear.from_float(attn.o_proj.weight)
        gain = block.post_attention_layernorm.weight.detach().float()
        weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).float() * gain
        mlp.gate_up_proj = W8A8Linear.from_float(weight, norm_eps=block.post_attention_layernorm.eps)
        mlp.down_proj = W8A8Linear.from_float(mlp.down_proj.weight)
        _fold_norms(block)
    decoder.lm_head = W8A8Linear.from_float(decoder.lm_head.weight)
    _float_norms(decoder)
    return decoder


def _fold_norms(block) -> None:
    """The block's norms now live in its fused products; their modules become identities."""
    attn, mlp = block.self_attn, block.mlp
    del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
    block.input_layernorm = nn.Identity()
    block.post_attention_layernorm = nn.Identity()
    attn.q_prescaled = True


def load_decoder_(decoder, state: dict[str, torch.Tensor]):
    """Fill a decoder built on the meta device from a w8a8 state dict (what `state_dict()` of a
    quantized decoder holds: qweight, scale and bias per product, then norms and the embedding).

    fbgemm packs weights at ~55 MB/s per thread but lets go of the GIL, so the products are packed
    on every thread torch uses (a 1.5B model: ~14 s on two cores instead of ~28 s).
    """
    names = [f"layers.{i}.{part}" for i in range(len(decoder.layers))
             for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    names.append("lm_head")
    eps = decoder.cfg.rms_norm_eps
    args = [(state.pop(f"{n}.qweight"), state.pop(f"{n}.scale"), state.pop(f"{n}.bias", None),
             eps if n.endswith(("qkv_proj", "gate_up_proj")) else None) for n in names]
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
        raise KeyError(f"w8a8 weights do not fit the model: missing {missing[:3]}, "
                       f"unexpected {result.unexpected_keys[:3]}")
    _float_norms(decoder)
    return decoder


def _float_norms(decoder) -> None:
    for name, module in decoder.named_modules():
        if hasattr(module, "eps") and hasattr(module, "weight"):      # RMSNorm
            module.weight = nn.Parameter(module.weight.detach().float(), requires_grad=False)
    decoder.activation_dtype = torch.float32
