"""The lean decoder: one implementation of the Llama family (llama, mistral, qwen2, qwen3).

Module names follow Hugging Face's, so a safetensors state dict loads as it is (a numeric format
may then fuse q/k/v and gate/up into one product each). One forward serves prefill, one-token
decode, chain verification and tree verification: it takes explicit rope positions and either an
attention mask over the cache plus the new tokens (prefill, drafters) or a `RowLayout` (decoding and
verification), whose attention computes every row exactly as it would come out alone.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from forerun.base.errors import ForerunError
from forerun.models import native_layer
from forerun.models.attention import RowLayout, Segment, attend, key_length
from forerun.models.kv_cache import KVCache
from forerun.models.linear import Linear
from forerun.models.norm import RMSNorm

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16}
NATIVE_ENV = "FORERUN_NATIVE_LAYERS"  # 0: row-exact forwards through PyTorch even where native layers run


def check_kv_cache_dtype(name: str) -> str:
    """`name` where it is auto or a key of KV_CACHE_DTYPES, else a clear error."""
    if name != "auto" and name not in KV_CACHE_DTYPES:
        raise ForerunError(f"kv_cache_dtype {name!r} is none of auto, {', '.join(KV_CACHE_DTYPES)}")
    return name


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int  # rows of the embedding and of the LM head
    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the gated MLP
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention when fewer than num_heads)
    head_dim: int
    rope_theta: float  # rope base frequency
    rms_norm_eps: float
    max_position: int  # longest context the model was trained for
    attention_bias: bool  # q/k/v projections carry a bias (qwen2)
    tie_embeddings: bool  # LM head shares the embedding matrix
    qk_norm: bool = False  # each head's q and k pass an RMSNorm of their own before rope (qwen3)
    # Scaled rope: rope frequency i is divided by factor i (head_dim / 2 of them; llama.cpp's
    # rope_freqs): Llama 3.1's and 3.2's "llama3" scaling, and "linear" scaling (one factor for all).
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_freq_factors is not None:  # a tuple of float32 values, as rope computes and GGUF stores them
            rounded = torch.tensor([float(f) for f in self.rope_freq_factors], dtype=torch.float32).tolist()
            object.__setattr__(self, "rope_freq_factors", tuple(rounded))


def _scored_rows(segments: list[Segment] | None, last_only: bool) -> list[int] | slice | None:
    """The rows whose logits a forward returns (None: all). last_only: the last row (of each
    segment's rows, several sequences); else a segment marked last_only gives its last row alone."""
    if segments is None:
        return slice(-1, None) if last_only else None
    if last_only:
        return [seg.stop - 1 for seg in segments]
    if not any(seg.last_only for seg in segments):
        return None
    return [r for seg in segments for r in ([seg.stop - 1] if seg.last_only else range(seg.start, seg.stop))]


@dataclass
class DecoderOutput:
    logits: torch.Tensor  # [B, T, vocab] (T = 1 when last_only)
    hidden: torch.Tensor | None = None  # [B, T, hidden] after the final norm, when asked
    layer_hidden: torch.Tensor | None = None  # [B, T, hidden] residual stream after layer `hidden_layer`


class Rope:
    """cos and sin tables for every position up to the longest seen, built once and grown by doubling.

    The sin table carries rotate_half's sign, so x·cos + roll(x, D/2)·sin is the usual
    x·cos + rotate_half(x)·sin with one op fewer.
    """

    def __init__(self, head_dim: int, theta: float, factors: tuple[float, ...] | None = None) -> None:
        """`factors`: each frequency's divisor (DecoderConfig.rope_freq_factors), or None."""
        self.head_dim, self.theta, self.factors = head_dim, theta, factors
        self.cos = self.sin = torch.empty(0, head_dim)  # [P, D]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [B, T], shaped [B, T, 1, D] to broadcast over heads."""
        cos, sin = self.rows(int(positions.max()) + 1 if positions.numel() else 0, positions.device, dtype)
        return cos[positions][:, :, None], sin[positions][:, :, None]

    def rows(self, need: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and sin tables [P, D], P >= `need` (row p: position p), contiguous."""
        if need > self.cos.shape[0] or self.cos.device != device or self.cos.dtype != dtype:
            self._build(max(need, 2 * self.cos.shape[0], 256), device, dtype)
        return self.cos, self.sin

    def _build(self, length: int, device: torch.device, dtype: torch.dtype) -> None:
        d = self.head_dim
        exponent = torch.arange(0, d, 2, dtype=torch.float32, device=device) / d
        inv_freq = 1.0 / (self.theta**exponent)  # [D/2]
        if self.factors is not None:
            inv_freq = inv_freq / torch.tensor(self.factors, dtype=torch.float32, device=device)
        freqs = torch.arange(length, device=device).float()[:, None] * inv_freq  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        sign = torch.ones(d, device=device)
        sign[: d // 2] = -1.0
        self.cos = emb.cos().to(dtype)
        self.sin = (emb.sin() * sign).to(dtype)


def llama3_rope_factors(
    head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> tuple[float, ...]:
    """Llama 3.1's rope scaling as per-frequency divisors (what llama.cpp's converter writes as
    rope_freqs): frequencies whose wavelength is past original / low_freq_factor are divided by
    `factor`, those under original / high_freq_factor kept, and those between blended smoothly."""
    low_wavelen, high_wavelen = original / low_freq_factor, original / high_freq_factor
    # The frequencies in float32, as transformers and llama.cpp's converter take them.
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D]; cos, sin [B, T, 1, D]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.qkv_proj: nn.Module | None = None  # q, k and v in one product, when a format fuses them
        if cfg.qk_norm:  # per head, over head_dim
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.q_prescaled = False  # q already carries 1/sqrt(head_dim) (folded into the weights)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        layer: int,
        mask: torch.Tensor | None,
        causal: bool,
        layout: RowLayout | list[Segment] | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        cfg = self.cfg
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.qkv_proj is not None and not cfg.qk_norm:
            qkv = self.qkv_proj(x).view(b, t, h + 2 * kvh, d)
            qk = apply_rope(qkv[:, :, : h + kvh], cos, sin)  # [B, T, H+KVH, D]
            q, k, v = qk[:, :, :h], qk[:, :, h:], qkv[:, :, h + kvh :]
        else:
            q, k, v = self._qkv(x)  # [B, T, H, D], [B, T, KVH, D] twice
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scale = 1.0 if self.q_prescaled else d**-0.5
        if isinstance(layout, list):  # several sequences, each on its own cache
            out = self._attend_segments(q[0], k[0], v[0], layout, layer, scale)[None]
            out = out if x.dtype == torch.float32 else out.to(x.dtype)  # [1, T, H*D]
        elif layout is not None:
            if b != 1:
                raise ValueError("row-exact attention takes one sequence per forward")
            cache.write_first(layer, k[0].transpose(0, 1), v[0].transpose(0, 1))
            q = q[0] if q.dtype == torch.float32 else q[0].float()
            out = attend(q if scale == 1.0 else q * scale, cache.layer_k[layer], cache.layer_v[layer], layout)[None]
            out = out if x.dtype == torch.float32 else out.to(x.dtype)  # [1, T, H*D]
        else:
            keys, values = cache.write(layer, k.transpose(1, 2), v.transpose(1, 2))  # [B, KVH, S, D]
            if keys.dtype != q.dtype:  # a cache in another dtype than the activations (kv_cache_dtype)
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=kvh != h
            )  # [B, H, T, D]
            out = out.transpose(1, 2).reshape(b, t, h * d)
        return self.o_proj(out)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, H, D], k and v [B, T, KVH, D] before rope, each head's q and k normed (qk_norm)."""
        b, t, _ = x.shape
        cfg = self.cfg
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).view(b, t, h + 2 * kvh, d).split([h, kvh, kvh], dim=2)
        else:
            q, k, v = (
                self.q_proj(x).view(b, t, h, d),
                self.k_proj(x).view(b, t, kvh, d),
                self.v_proj(x).view(b, t, kvh, d),
            )
        if cfg.qk_norm:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        return q, k, v

    @staticmethod
    def _attend_segments(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment], layer: int, scale: float
    ) -> torch.Tensor:
        """q [T, H, D], k, v [T, KVH, D] of every sequence's rows; each segment's rows are written
        to and attend over their own cache, exactly as in a forward of that sequence alone.
        Returns [T, H * D] float32."""
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=torch.float32, device=q.device)
        for seg in segments:
            rows = slice(seg.start, seg.stop)
            seg.cache.write_first(layer, k[rows].transpose(0, 1), v[rows].transpose(0, 1))
            qs = q[rows] if q.dtype == torch.float32 else q[rows].float()
            out[rows] = attend(
                qs if scale == 1.0 else qs * scale, seg.cache.layer_k[layer], seg.cache.layer_v[layer], seg.layout
            )
        return out


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one product, when a format fuses them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate).mul_(up))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, layer, mask, causal, layout):
        # .forward directly: nn.Module's call machinery costs microseconds per call, per layer, per step.
        x = x + self.self_attn.forward(self.input_layernorm(x), cos, sin, cache, layer, mask, causal, layout)
        return x + self.mlp.forward(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        if cfg.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {cfg.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.cfg = cfg
        # Given its weight, the embedding skips its random initialisation (weights are loaded after),
        # which on the meta device imports torch's compiler: over a second of every start.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.activation_dtype: torch.dtype | None = None  # None: the weights' dtype; a format may set float32
        self._rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_freq_factors)
        self._native = False  # not looked at yet (`_native_layers`)
        self.kv_cache_dtype = "auto"  # a key of KV_CACHE_DTYPES: what `new_cache` stores entries in

    @property
    def dtype(self) -> torch.dtype:
        """The dtype activations and the KV cache are computed in."""
        return self.activation_dtype or self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings and isinstance(self.lm_head, Linear):
            self.lm_head.weight = self.embed_tokens.weight

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """A cache of at least `max_len` slots (`cache_slots`), its entries in `cache_dtype`."""
        cfg = self.cfg
        slots = self.cache_slots(max_len)
        return KVCache(cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim, self.cache_dtype, self.device)

    def set_kv_cache_dtype(self, name: str) -> None:
        """What later caches store: auto, float32 or float16 (`cache_dtype`)."""
        self.kv_cache_dtype = check_kv_cache_dtype(name)

    @property
    def cache_dtype(self) -> torch.dtype:
        """What the KV cache stores (`kv_cache_dtype`). auto: float16 where the native layers run
        (half the bytes attention reads, as llama.cpp's default cache; each entry rounded to nearest
        even once, as it is written, so rows stay exact), else the activations' dtype."""
        if self.kv_cache_dtype != "auto":
            return KV_CACHE_DTYPES[self.kv_cache_dtype]
        if self._native_layers() is not None and self.cfg.head_dim <= native_layer.HALF_DIM:
            return torch.float16
        return self.dtype

    @staticmethod
    def cache_slots(max_len: int) -> int:
        """Slots a cache for `max_len` tokens has: rounded up so row-exact attention can reduce over
        whole key blocks. A cache with this many slots or more serves such a request."""
        return key_length(max_len - 1)

    @torch.inference_mode()
    def forward_ids(self, ids: list[int], cache: KVCache, **kwargs) -> DecoderOutput:
        """`forward` of a sequence's token ids from position 0 (a prompt, a chunk to label) into a fresh
        `cache`, the inputs made on this decoder's device."""
        device = self.device
        return self(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), cache, **kwargs)

    def forward_chain(self, tokens: list[int], cache: KVCache, head: nn.Module | None = None) -> torch.Tensor:
        """The last row's logits [1, N] of `tokens` fed after `cache`'s entries as a chain (a draft
        token, a catch-up), the cache advanced: `forward` with a chain layout and `last_only`, bit
        for bit, in a few native calls where the native layers run (`native_layer.forward_rows`)."""
        fast = self._native_layers()
        lean = native_layer.forward_rows(self, fast, tokens, cache, head, last_only=True) if fast is not None else None
        if lean is not None:
            _, logits = lean
            return logits
        device, start, t = self.device, cache.length, len(tokens)
        ids, where = torch.tensor(tokens, device=device), torch.arange(start, start + t, device=device)
        return self(ids, where, cache, layout=RowLayout.chain(start, t), last_only=True, head=head).logits[0]

    def forward_layout(self, tokens: list[int], cache: KVCache, layout: RowLayout) -> DecoderOutput:
        """`forward` of one sequence's `tokens` at the cache's next slots, row i at position
        layout.positions[i] and seeing what `layout` lets it (a verification), every row scored
        and its normalised state kept (`output_hidden`): bit for bit the general forward's, in a
        few native calls where the native layers run (`native_layer.forward_rows`)."""
        fast = self._native_layers()
        lean = native_layer.forward_rows(self, fast, tokens, cache, None, layout) if fast is not None else None
        if lean is not None:
            hidden, logits = lean
            return DecoderOutput(logits[None], hidden[None])
        device = self.device
        ids, where = torch.tensor(tokens, device=device), torch.tensor(layout.positions, device=device)
        return self(ids, where, cache, layout=layout, output_hidden=True)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None,
        attention_mask: torch.Tensor | None = None,
        *,
        layout: RowLayout | None = None,
        last_only: bool = False,
        output_hidden: bool = False,
        all_hidden: bool = False,
        hidden_layer: int | None = None,
        layers: list[int] | range | None = None,
        head: nn.Module | None = None,
        segments: list[Segment] | None = None,
    ) -> DecoderOutput:
        """Run the new tokens against the cache and append their keys and values to it.

        tokens, positions: [B, T] (or [T]). attention_mask: bool, True where a new token may attend,
        [T, S] or [B, T, S] with S = cache.length + T; None means causal (through the native layers
        as a chain where they run). `layout` (one sequence) instead computes every row exactly as it
        would come out alone (decoding, verification). `layers` runs a subset of layers (self-
        speculation); skipped layers' cache entries are left untouched. `head` scores with another
        head than lm_head (a draft's reduced vocabulary). `segments` (with `cache` None and tokens
        [T]) runs several sequences' rows in one forward, each segment's on its own cache and layout:
        every row comes out as in a forward of its sequence alone (continuous batching); with
        `last_only`, each segment's last row is scored (a batch's draft forwards). `all_hidden` with
        `last_only` and `output_hidden`: every row's hidden state, the last's logits (a draft head
        reads the whole prompt's features)."""
        if tokens.dim() == 1:
            tokens = tokens[None]
        if positions.dim() == 1:
            positions = positions[None].expand(tokens.shape[0], -1)
        t = tokens.shape[1]
        if segments is not None:
            layout = segments  # the blocks pass it on to attention
        elif layout is None and attention_mask is None:
            layout = self._native_chain(cache, tokens)
        x = self.embed_tokens(tokens).to(self.dtype)  # [B, T, hidden]
        order = range(self.cfg.num_layers) if layers is None else layers
        fast = self._native_layers() if layout is not None and x.shape[0] == 1 else None
        if fast is not None:  # every row-exact layer in one native call
            rows = segments if segments is not None else [Segment(0, t, cache, layout)]
            x, layer_hidden = native_layer.run_layers(self, fast, x, positions, rows, order, hidden_layer)
        else:
            x, layer_hidden = self._layers(x, positions, cache, attention_mask, layout, order, hidden_layer)
        for seg in segments if segments is not None else ():
            seg.cache.advance(seg.stop - seg.start)
        if cache is not None:
            cache.advance(t)
        out = self._score(x, _scored_rows(segments, last_only), head, fast, output_hidden, all_hidden)
        out.layer_hidden = layer_hidden
        return out

    def _score(self, x, last, head, fast, output_hidden: bool, all_hidden: bool) -> DecoderOutput:
        """The final norm over x [B, T, hidden] and the head's logits of rows `last` (None: all);
        every row's normalised state with `output_hidden` and `all_hidden`, else the scored rows'."""
        head = self.lm_head if head is None else head
        if fast is not None and not (output_hidden and all_hidden and last is not None):
            scored, logits = native_layer.score(self, fast, head, x[0] if last is None else x[0, last])
            if logits is not None:  # the final norm and the head in one native call
                return DecoderOutput(logits[None], scored[None] if output_hidden else None)
        if last is not None and not (output_hidden and all_hidden):
            x, last = x[:, last], None
        x = self.norm(x) if fast is None else native_layer.final_norm(self.norm, x)
        scored = x if last is None else x[:, last]
        return DecoderOutput(head(scored).float(), x if output_hidden else None)

    def _layers(self, x, positions, cache, attention_mask, layout, order, hidden_layer):
        """x [B, T, hidden] through the layers in `order` op by op (PyTorch): (output, the output of
        `hidden_layer` or None)."""
        t = x.shape[1]
        mask, causal = (None, False) if layout is not None else self._mask(attention_mask, cache.length, t, x.device)
        cos, sin = self._rope.tables(positions, self.dtype)  # [B, T, 1, D]
        layer_hidden = None
        for i in order:
            x = self.layers[i].forward(x, cos, sin, cache, i, mask, causal, layout)
            if i == hidden_layer:
                layer_hidden = x
        return x, layer_hidden

    @property
    def chain_prefill(self) -> bool:
        """Whether a prompt's prefill runs as a chain of exact rows (the native layers): its rows
        come out the same in any chunks, alone or in a forward beside other sequences' rows."""
        return self._native_layers() is not None

    def chains_into(self, cache: KVCache) -> bool:
        """Whether a prefill into `cache` runs as a chain of exact rows: the native layers, on a
        float32 or float16 cache of one sequence."""
        return cache.k.shape[1] == 1 and cache.k.dtype in native_layer.CACHE_DTYPES and self.chain_prefill

    def _native_chain(self, cache: KVCache | None, tokens: torch.Tensor) -> RowLayout | None:
        """A causal forward (a prompt's prefill) as a chain of rows where the native layers run
        (`chains_into`, one sequence with room for the rows): through them, one call a layer
        instead of PyTorch's ops. None: the causal mask's path."""
        if cache is None or tokens.shape[0] != 1 or cache.length + tokens.shape[1] > cache.max_len:
            return None
        return RowLayout.chain(cache.length, tokens.shape[1]) if self.chains_into(cache) else None

    def _native_layers(self):
        """The layers' native descriptions (`native_layer.prepare`), made at the first row-exact
        forward; None where the format has none (or FORERUN_NATIVE_LAYERS=0)."""
        if self._native is False:
            self._native = native_layer.prepare(self) if os.environ.get(NATIVE_ENV, "1") != "0" else None
        return self._native

    @staticmethod
    def _mask(mask: torch.Tensor | None, past: int, t: int, device) -> tuple[torch.Tensor | None, bool]:
        if mask is not None:
            return (mask[:, None] if mask.dim() == 3 else mask), False
        if t == 1:
            return None, False
        if past == 0:
            return None, True
        # Causal over new tokens that follow a filled cache: row i sees slots [0, past + i].
        cols = torch.arange(past + t, device=device)
        return cols[None, :] <= (past + torch.arange(t, device=device))[:, None], False
