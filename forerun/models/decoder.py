"""The lean decoder: one implementation of the Llama family (llama, mistral, qwen2).

Module names follow Hugging Face's, so a safetensors state dict loads as it is. One forward serves
prefill, one-token decode, chain verification and tree verification: it takes explicit rope
positions and an optional attention mask over the cache plus the new tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from forerun.kv_cache import KVCache
from forerun.models.linear import Linear

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str       # one of SUPPORTED_ARCHITECTURES
    vocab_size: int         # rows of the embedding and of the LM head
    hidden_size: int        # width of the residual stream
    intermediate_size: int  # width of the gated MLP
    num_layers: int
    num_heads: int          # query heads
    num_kv_heads: int       # key/value heads (grouped-query attention when fewer than num_heads)
    head_dim: int
    rope_theta: float       # rope base frequency
    rms_norm_eps: float
    max_position: int       # longest context the model was trained for
    attention_bias: bool    # q/k/v projections carry a bias (qwen2)
    tie_embeddings: bool    # LM head shares the embedding matrix


@dataclass
class DecoderOutput:
    logits: torch.Tensor                     # [B, T, vocab] (T = 1 when last_only)
    hidden: torch.Tensor | None = None       # [B, T, hidden] after the final norm, when asked
    layer_hidden: torch.Tensor | None = None  # [B, T, hidden] residual stream after layer `hidden_layer`


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the reference implementations do; bf16 variance drifts.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)      # [B, H, T, D]
        k = self.k_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)   # [B, KVH, T, D]
        v = self.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)   # [B, KVH, T, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys, values = cache.write(layer, k, v)                                           # [B, KVH, S, D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                             enable_gqa=cfg.num_kv_heads != cfg.num_heads)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, cfg.num_heads * cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, layer, mask, causal):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask, causal)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        if cfg.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {cfg.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self._inv_freq: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings and isinstance(self.lm_head, Linear):
            self.lm_head.weight = self.embed_tokens.weight

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim, self.dtype, self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [B, T], shaped [B, 1, T, head_dim] to broadcast over heads."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            d = self.cfg.head_dim
            exponent = torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d
            self._inv_freq = 1.0 / (self.cfg.rope_theta ** exponent)              # [D/2]
        freqs = positions.float()[..., None] * self._inv_freq                   # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]                       # [B, 1, T, D]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                attention_mask: torch.Tensor | None = None, *, last_only: bool = False,
                output_hidden: bool = False, hidden_layer: int | None = None,
                layers: list[int] | range | None = None) -> DecoderOutput:
        """Run the new tokens against the cache and append their keys and values to it.

        tokens, positions: [B, T] (or [T]). attention_mask: bool, True where a new token may attend,
        [T, S] or [B, T, S] with S = cache.length + T; None means causal. `layers` runs a subset of
        layers (self-speculation); the cache entries of skipped layers are left untouched.
        """
        if tokens.dim() == 1:
            tokens = tokens[None]
        if positions.dim() == 1:
            positions = positions[None].expand(tokens.shape[0], -1)
        t = tokens.shape[1]
        cos, sin = self.rope(positions)
        mask, causal = self._mask(attention_mask, cache.length, t, tokens.device)
        x = self.embed_tokens(tokens)                                              # [B, T, hidden]
        layer_hidden = None
        for i in (range(self.cfg.num_layers) if layers is None else layers):
            x = self.layers[i](x, cos, sin, cache, i, mask, causal)
            if i == hidden_layer:
                layer_hidden = x
        cache.advance(t)
        if last_only:
            x = x[:, -1:]
        x = self.norm(x)
        return DecoderOutput(logits=self.lm_head(x).float(), hidden=x if output_hidden else None,
                             layer_hidden=layer_hidden)

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
