"""Decoding and verification layers in one native call a forward (forerun/native/src/layer_impl.h).

A decoder whose every layer is GGUF products with RMSNorms (the `gguf` format) runs its row-exact
forwards here: one call runs every layer's norm, q/k/v, rope, the cache write, attention, o,
residual, norm, gate/up, SiLU, down and residual, in one parallel region, where the PyTorch path
makes some forty small calls a layer.
Attention reads, for each row, the cache slots it sees in their logical order (the root and its
ancestors, wherever a tree put them), so branch rows need no entries moved into place, and each
row's sums run in a fixed order: a row comes out the same alone or beside any others.

`prepare(decoder)` says whether a decoder can run here and keeps its layers' descriptions;
`run_layers` runs them for one forward.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from forerun import native
from forerun.models.attention import RowLayout, Segment
from forerun.models.gguf_format import GGUFEmbedding, GGUFLinear
from forerun.models.kv_cache import KVCache
from forerun.models.norm import RMSNorm

MAX_PARTS = 4
SCRATCH_ROWS = 64  # forwards of at most this many rows (decoding, verification) reuse one set of buffers
CACHE_DTYPES = (torch.float32, torch.float16)  # a float16 cache's entries are rounded to nearest even
HALF_DIM = 256  # the widest head a float16 cache serves (layer_impl.h)
ATTEND_ROWS = 8  # rows that see every slot a thread's scores hold: one cache's rows attended together
_i64, _f32p, _u8p, _ptr = (
    ctypes.c_int64,
    ctypes.POINTER(ctypes.c_float),
    ctypes.POINTER(ctypes.c_uint8),
    ctypes.c_void_p,
)


class Product(ctypes.Structure):
    _fields_ = [
        ("parts", _i64),
        ("type", _i64 * MAX_PARTS),
        ("rows", _i64 * MAX_PARTS),
        ("packed", _ptr * MAX_PARTS),
        ("inputs", _i64),
        ("out", _i64),
        ("bias", _ptr),
    ]


class LayerDesc(ctypes.Structure):
    _fields_ = [
        ("qkv", Product),
        ("o", Product),
        ("gate_up", Product),
        ("down", Product),
        ("norm1", _ptr),
        ("norm2", _ptr),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("hidden", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("ffn", _i64),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
    ]


class RowDesc(ctypes.Structure):
    _fields_ = [
        ("k", _ptr),
        ("v", _ptr),
        ("kv_half", _i64),
        ("layer_stride", _i64),
        ("slots", _i64),
        ("write", _i64),
        ("prefix", _i64),
        ("n_extra", _i64),
        ("extra", _ptr),
        ("cos", _ptr),
        ("sin", _ptr),
    ]


class PassDesc(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("row", ctypes.POINTER(RowDesc)),
        ("h", _ptr),
        ("qkv", _ptr),
        ("att", _ptr),
        ("tmp", _ptr),
        ("gu", _ptr),
        ("act_k", _ptr),
        ("act_0", _ptr),
        ("scores", _ptr),
        ("scores_stride", _i64),
    ]


@dataclass
class NativeLayers:
    """What the native layers need of a decoder, made once: a description per layer."""

    layers: list[LayerDesc]
    path: int  # index into native.PATHS
    widest: int  # the most inputs any product reads (activation buffer rows)

    def __post_init__(self) -> None:
        self.lib = native.library()  # what runs fr_layers (the profiler wraps it)
        self.array = (LayerDesc * len(self.layers))(*self.layers)  # fr_layers indexes them
        self.every = (ctypes.c_int64 * len(self.layers))(*range(len(self.layers)))  # all layers in order
        self._scratch: list[torch.Tensor] = []  # for up to SCRATCH_ROWS rows, made at first use
        self._heads: dict[int, tuple[nn.Module, Product | None]] = {}

    def head(self, module: nn.Module) -> Product | None:
        """A head's native description (the decoder's own, a draft's reduced vocabulary), made at
        its first use; None where the kernels cannot run it as the layers' products run."""
        if id(module) not in self._heads:
            ok = isinstance(module, GGUFLinear) and module.kernel == native.PATHS[self.path]
            self._heads[id(module)] = (module, _product(module) if ok else None)  # the module kept alive
        return self._heads[id(module)][1]

    def scratch(self, t: int, scores: int) -> list[torch.Tensor]:
        """A forward's working buffers for t rows, in fr_layers' PassDesc order, the last `scores`
        floats or more of attention scores. Forwards of up to SCRATCH_ROWS rows (decoding,
        verification: one at a time on a decoder, as the engine runs them) reuse one set."""
        if t > SCRATCH_ROWS:
            return self._buffers(t) + [torch.empty(scores)]
        if not self._scratch:
            self._scratch = self._buffers(SCRATCH_ROWS) + [torch.empty(0)]
        if self._scratch[-1].numel() < scores:  # a longer context: room to double
            self._scratch[-1] = torch.empty(max(scores, 2 * self._scratch[-1].numel()))
        return self._scratch

    def acts(self, t: int) -> list[torch.Tensor]:
        """The two activation buffers alone (256- and 32-blocks) for t rows: the shared ones for up
        to SCRATCH_ROWS rows, else new ones."""
        return self._acts(t) if t > SCRATCH_ROWS else self.scratch(t, 0)[5:7]

    def _acts(self, t: int) -> list[torch.Tensor]:
        act = native.act_row_bytes(self.widest)
        return [torch.empty(t, act, dtype=torch.uint8) for _ in range(2)]

    def _buffers(self, t: int) -> list[torch.Tensor]:
        first = self.layers[0]
        widths = (self.widest, first.qkv.out, first.heads * first.head_dim, first.hidden, first.gate_up.out)
        return [*(torch.empty(t, w) for w in widths), *self._acts(t)]


def _product(module: nn.Module) -> Product | None:
    if not isinstance(module, GGUFLinear) or len(module.parts) > MAX_PARTS or any(module._fallback):
        return None
    p = Product()
    p.parts = len(module.parts)
    for i, part in enumerate(module.parts):
        p.type[i], p.rows[i], p.packed[i] = part.type_id, part.rows, part.packed.data_ptr()
    p.inputs, p.out = module.in_features, module.out_features
    p.bias = None if module.bias is None else module.bias.data_ptr()
    return p


def prepare(decoder) -> NativeLayers | None:
    """The decoder's layers as native descriptions, or None when some layer cannot run natively
    (another format, a product with a fallback part, sizes that are not multiples of 16)."""
    cfg = decoder.cfg
    if decoder.dtype != torch.float32 or decoder.device.type != "cpu" or not native.available():
        return None  # (asked last: asking may build the kernels)
    if any(n % 16 for n in (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size)) or cfg.num_heads % cfg.num_kv_heads:
        return None
    layers = []
    for block in decoder.layers:
        attn, mlp = block.self_attn, block.mlp
        norms = (block.input_layernorm, block.post_attention_layernorm)
        norms += (attn.q_norm, attn.k_norm) if cfg.qk_norm else ()
        if not all(isinstance(n, RMSNorm) and n.weight.dtype == torch.float32 for n in norms) or attn.q_prescaled:
            return None
        if any(n.eps != norms[0].eps for n in norms):  # the layer computes every norm with one eps
            return None
        products = [_product(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None for p in products):
            return None
        desc = LayerDesc(*products)
        desc.norm1, desc.norm2 = norms[0].weight.data_ptr(), norms[1].weight.data_ptr()
        desc.eps, desc.scale = norms[0].eps, cfg.head_dim**-0.5
        desc.hidden, desc.heads, desc.kv_heads = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
        desc.head_dim, desc.ffn = cfg.head_dim, cfg.intermediate_size
        if cfg.qk_norm:
            desc.q_norm, desc.k_norm = norms[2].weight.data_ptr(), norms[3].weight.data_ptr()
        layers.append(desc)
    widest = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
    return NativeLayers(layers, native.PATHS.index(native.path()), widest)


def _visible(layout: RowLayout, start: int) -> list[tuple[int, list[int]]]:
    """For each row of `layout` (fed at slots start, start + 1, ...): (prefix, extra slots): it
    attends to slots [0, prefix), then to the extra slots, in logical order."""
    out: list[tuple[int, list[int]] | None] = [None] * len(layout.positions)
    for group in layout.groups:
        if group.visible is not None:  # rows that need not be exact: their mask
            for i, row in enumerate(group.rows):
                slots = group.visible[i].nonzero().flatten().tolist()
                prefix = 0
                while prefix < len(slots) and slots[prefix] == prefix:
                    prefix += 1
                out[row] = (prefix, slots[prefix:])
            continue
        holding = dict(group.moves)
        for row in group.rows:
            position = layout.positions[row]
            moved = [s for s in holding if s <= position]
            prefix = min(moved) if moved else position + 1
            out[row] = (prefix, [holding.get(s, s) for s in range(prefix, position + 1)])
    return out  # type: ignore[return-value]


Scored = tuple[torch.Tensor, torch.Tensor | None]  # (normalised rows, logits or None)


class _Rows:
    """The ctypes rows of one forward and the arrays their pointers point into (kept alive here)."""

    def __init__(self, count: int) -> None:
        self.array = (RowDesc * count)()
        self.keep: list = []


def _check_cache(cache: KVCache, rows: int, head_dim: int) -> None:
    """A clear error where `rows` new rows cannot go into `cache` through the native layers."""
    if cache.length + rows > cache.max_len:
        raise ValueError(f"KV cache overflow: {cache.length + rows} slots needed, {cache.max_len} allocated")
    if cache.k.dtype not in CACHE_DTYPES or cache.k.shape[1] != 1:
        raise ValueError(f"native layers need a cache of one sequence in {CACHE_DTYPES}, not {cache.k.dtype}")
    if cache.k.dtype == torch.float16 and head_dim > HALF_DIM:
        raise ValueError(f"a float16 cache serves heads of at most {HALF_DIM}, not {head_dim}")


def _rows(segments: list[Segment], where: list[int], cos: torch.Tensor, sin: torch.Tensor, cfg) -> tuple[_Rows, int]:
    """Every row's description, row i at position where[i] (its rope: row where[i] of the cos and sin
    tables [P, head_dim]); the most slots any row attends to."""
    total = sum(seg.stop - seg.start for seg in segments)
    rows = _Rows(total)
    most = 0
    d = cfg.head_dim
    cos_at, sin_at = cos.data_ptr(), sin.data_ptr()
    for seg in segments:
        cache = seg.cache
        _check_cache(cache, seg.stop - seg.start, d)
        layer_stride, half = cache.k.stride(0), int(cache.k.dtype == torch.float16)
        for i, (prefix, extra) in enumerate(_visible(seg.layout, cache.length)):
            r = rows.array[seg.start + i]
            r.k, r.v, r.kv_half = cache.k.data_ptr(), cache.v.data_ptr(), half
            r.layer_stride, r.slots, r.write = layer_stride, cache.max_len, cache.length + i
            r.prefix, r.n_extra = prefix, len(extra)
            if extra:
                slots = (ctypes.c_int32 * len(extra))(*extra)
                rows.keep.append(slots)
                r.extra = ctypes.addressof(slots)
            r.cos = cos_at + where[seg.start + i] * d * 4
            r.sin = sin_at + where[seg.start + i] * d * 4
            most = max(most, prefix + len(extra))
    return rows, most


def run_layers(
    decoder,
    prepared: NativeLayers,
    x: torch.Tensor,
    positions: torch.Tensor,
    segments: list[Segment],
    layers,
    hidden_layer: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [1, T, hidden] float32 through `layers` (indices), row i at position positions[0, i].
    Returns (x, the residual stream after `hidden_layer` or None), both [1, T, hidden]."""
    cfg = decoder.cfg
    t = x.shape[1]
    where = positions[0].tolist()
    cos, sin = decoder._rope.rows(max(where) + 1, x.device, torch.float32)  # [P, head_dim]
    rows, most = _rows(segments, where, cos, sin, cfg)
    threads = torch.get_num_threads()
    stride = _scores_stride(cfg, most)
    scratch = prepared.scratch(t, threads * stride)
    pass_desc = PassDesc(t, rows.array, *(b.data_ptr() for b in scratch), stride)
    x = x.contiguous()
    order = (ctypes.c_int64 * len(layers))(*layers)
    keep = hidden_layer if hidden_layer is not None and hidden_layer in layers else -1
    layer_hidden = torch.empty_like(x) if keep >= 0 else None
    prepared.lib.fr_layers(
        prepared.path,
        prepared.array,
        order,
        len(order),
        ctypes.addressof(pass_desc),
        x.data_ptr(),
        keep,
        None if layer_hidden is None else layer_hidden.data_ptr(),
        threads,
    )
    return x, layer_hidden


def _scores_stride(cfg, most: int) -> int:
    """Floats of attention scores a thread needs for rows that see at most `most` slots: room for
    ATTEND_ROWS rows of one cache at once (layer_impl.h's attend_rows, which takes fewer where a
    forward has fewer, or where their scores would not fit)."""
    return ATTEND_ROWS * max(cfg.num_heads // cfg.num_kv_heads * (-(-most // 16) * 16), 16)


def forward_rows(
    decoder,
    prepared: NativeLayers,
    tokens: list[int],
    cache: KVCache,
    head: nn.Module | None,
    layout: RowLayout | None = None,
    last_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One sequence's `tokens` fed at `cache`'s next slots through every layer, the final norm and
    `head` (None: the decoder's), the cache advanced: (the scored rows normalised [m, hidden], their
    logits [m, N]), m = 1 (the last row) with `last_only`, else every row. Row i sits at position
    layout.positions[i] and sees what `layout` lets it (None: a chain, row i at the cache's length
    + i). What `Decoder.forward` returns for the same rows, bit for bit (the same three native
    calls: embedding rows, every layer, norm and head), made from a few lines of Python where the
    general forward runs some hundred (a draft token, a verification). None, with nothing run,
    where this path does not apply (the caller takes the general forward): an embedding or head the
    kernels do not read, a norm that is not float32, more rows than the shared buffers hold. Bad
    input (a token id, a full cache) raises before anything runs, the cache untouched."""
    embed, norm, cfg, lib = decoder.embed_tokens, decoder.norm, decoder.cfg, prepared.lib
    product = prepared.head(decoder.lm_head if head is None else head)
    t, hidden = len(tokens), cfg.hidden_size
    if product is None or not isinstance(embed, GGUFEmbedding) or not 0 < t <= SCRATCH_ROWS:
        return None
    if norm.weight.dtype != torch.float32 or product.inputs != hidden:
        return None
    x = _embed(lib, embed, tokens)  # [t, hidden], the residual stream the layers update in place
    if layout is None:  # (the rope tables the rows point into stay alive in decoder._rope)
        rows, most = _chain_rows(decoder, cache, t), cache.length + t
    else:
        cos, sin = decoder._rope.rows(max(layout.positions) + 1, x.device, torch.float32)
        described, most = _rows([Segment(0, t, cache, layout)], layout.positions, cos, sin, cfg)
        rows = described.array  # (its slot lists kept alive by `described` until the calls return)
    threads = torch.get_num_threads()
    stride = _scores_stride(cfg, most)
    buffers = prepared.scratch(t, threads * stride)  # h, qkv, att, tmp, gu, act_k, act_0, scores
    run = PassDesc(t, rows, *(b.data_ptr() for b in buffers), stride)
    # What the head's call needs is made before the layers' call, which leaves every cache cold.
    m = 1 if last_only else t
    scored, logits = torch.empty(m, hidden), torch.empty(m, product.out)  # [m, hidden], [m, N]
    head_pass = PassDesc(rows=m, act_k=buffers[5].data_ptr(), act_0=buffers[6].data_ptr())
    scored_rows = x[t - m :].data_ptr()
    gain, layers, path = norm.weight.data_ptr(), len(prepared.layers), prepared.path
    lib.fr_layers(path, prepared.array, prepared.every, layers, ctypes.byref(run), x.data_ptr(), -1, None, threads)
    lib.fr_norm_head(
        path, ctypes.byref(product), gain, norm.eps, ctypes.byref(head_pass), scored_rows, hidden,
        scored.data_ptr(), logits.data_ptr(), threads,
    )  # fmt: skip
    cache.advance(t)
    return scored, logits


def _embed(lib, embed: GGUFEmbedding, tokens: list[int]) -> torch.Tensor:
    """The tokens' embedding rows [T, hidden] (float32); an IndexError naming a token id the table lacks."""
    t, stored = len(tokens), embed.raw.shape[0]
    x = torch.empty(t, embed.embedding_dim)
    ids = (ctypes.c_int64 * t)(*tokens)
    bad = lib.fr_dequantize_rows(embed.type_id, embed.raw.data_ptr(), embed.embedding_dim, ids, t, stored, x.data_ptr())
    if bad >= 0:
        raise IndexError(f"token id {tokens[bad]} out of range [0, {stored})")
    return x


def _chain_rows(decoder, cache: KVCache, t: int) -> ctypes.Array:
    """t rows fed at the cache's next slots as a chain: row i sees slots [0, length + i] (the cache
    and the rows before it), its rope at position length + i. A clear error where they cannot go
    there (`_check_cache`, as `_rows` checks a layout's)."""
    start, d = cache.length, decoder.cfg.head_dim
    _check_cache(cache, t, d)
    cos, sin = decoder._rope.rows(start + t, cache.k.device, torch.float32)
    k, v, half = cache.k.data_ptr(), cache.v.data_ptr(), int(cache.k.dtype == torch.float16)
    layer_stride, slots, cos_at, sin_at = cache.k.stride(0), cache.max_len, cos.data_ptr(), sin.data_ptr()
    row_bytes = d * cos.element_size()  # a position's row of the tables
    rows = (RowDesc * t)()
    for i, r in enumerate(rows):
        r.k, r.v, r.kv_half, r.layer_stride, r.slots = k, v, half, layer_stride, slots
        r.write, r.prefix = start + i, start + i + 1
        r.cos, r.sin = cos_at + (start + i) * row_bytes, sin_at + (start + i) * row_bytes
    return rows


def score(decoder, prepared: NativeLayers, head: nn.Module, x: torch.Tensor) -> Scored:
    """Rows x [m, hidden] through the decoder's final norm and `head` in one native call: (the
    normalised rows, their logits [m, head's outputs]); (x, None) where the head is not one the
    kernels run (another format, a fallback part, another kernel path)."""
    product, norm = prepared.head(head), decoder.norm
    if product is None or norm.weight.dtype != torch.float32 or norm.weight.shape != (product.inputs,):
        return x, None
    x = x if x.stride(-1) == 1 else x.contiguous()
    m = x.shape[0]
    scored, logits = torch.empty(m, product.inputs), torch.empty(m, product.out)
    acts = prepared.acts(m)  # held until the call returns
    pass_desc = PassDesc(rows=m)
    pass_desc.act_k, pass_desc.act_0 = acts[0].data_ptr(), acts[1].data_ptr()
    prepared.lib.fr_norm_head(
        prepared.path,
        ctypes.byref(product),
        norm.weight.data_ptr(),
        norm.eps,
        ctypes.byref(pass_desc),
        x.data_ptr(),
        x.stride(0),
        scored.data_ptr(),
        logits.data_ptr(),
        torch.get_num_threads(),
    )
    return scored, logits


def final_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The decoder's last RMSNorm over x [..., hidden] as the layers' own norms compute (a row's
    bits its own on every path), in one call where PyTorch's takes five."""
    return native.rmsnorm(x, norm.weight, norm.eps)
