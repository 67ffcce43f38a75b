"""A whole decoder from a GGUF file in the `gguf` (or `q4_0`) format: every product, the embedding
and the LM head read the file's tensors as stored (`gguf_format`), and a tensor in a block type the
kernels do not read runs as a w8a8 product of its dequantized weights, with one line saying which."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from forerun import native
from forerun.models.decoder import Decoder
from forerun.models.gguf_format import (
    REBLOCK_TYPE,
    GGUFEmbedding,
    GGUFLinear,
    Part,
    Reblocked,
    dequantized,
    raw_rows,
    say,
)
from forerun.models.gguf_loader import unpermute


def load_decoder(reader, cfg, reblocked: Reblocked | None = None):
    """A `Decoder` whose products, embedding and LM head read `reader`'s tensors as stored (the file
    stays memory-mapped; only the tile layout the kernels read is a copy, made here in seconds), or
    with `reblocked`, its wider products' tensors as Q4_0 blocks."""
    source = _Tensors(reader, cfg, reblocked)
    with torch.device("meta"):
        decoder = Decoder(cfg)
    for i, block in enumerate(decoder.layers):
        attn, mlp, p = block.self_attn, block.mlp, f"blk.{i}."
        biases = [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"] if cfg.attention_bias else None
        attn.qkv_proj = source.product([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], biases)
        attn.o_proj = source.product([p + "attn_output.weight"])
        mlp.gate_up_proj = source.product([p + "ffn_gate.weight", p + "ffn_up.weight"])
        mlp.down_proj = source.product([p + "ffn_down.weight"])
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
        block.input_layernorm.weight = source.vector(p + "attn_norm.weight")
        if cfg.qk_norm:
            attn.q_norm.weight = source.vector(p + "attn_q_norm.weight")
            attn.k_norm.weight = source.vector(p + "attn_k_norm.weight")
        block.post_attention_layernorm.weight = source.vector(p + "ffn_norm.weight")
    decoder.embed_tokens = source.embedding("token_embd.weight")
    decoder.norm.weight = source.vector("output_norm.weight")
    decoder.lm_head = source.product(["output.weight" if "output.weight" in source.tensors else "token_embd.weight"])
    decoder.activation_dtype = torch.float32
    left = [n for n, t in [*decoder.named_parameters(), *decoder.named_buffers()] if t.is_meta]
    if left:
        raise KeyError(f"the GGUF file did not fill {left[:3]}")
    if source.fell_back:
        names = source.fell_back
        say(
            f"--quantization gguf: {len(names)} tensors are in block types the native kernels do not read "
            f"and run as w8a8 products instead: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
        )
    if reblocked is not None:
        reblocked.save()
    return decoder.eval()


class _Tensors:
    """A GGUF file's tensors as the pieces of a decoder: products, vectors, the embedding."""

    def __init__(self, reader, cfg, reblocked: Reblocked | None = None) -> None:
        self.tensors = {t.name: t for t in reader.tensors}
        self.reblocked = reblocked
        # llama.cpp interleaves llama/mistral q and k rows for its rope; ours pairs i with i + D/2.
        self.permute = (
            {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads} if cfg.architecture in ("llama", "mistral") else {}
        )
        self.fell_back: list[str] = []  # tensors in block types the kernels do not read

    def _order(self, name: str, rows: int) -> np.ndarray | None:
        part = name.split(".")[-2]
        if part not in self.permute or not name.startswith("blk."):
            return None
        return unpermute(np.arange(rows), self.permute[part])

    def part(self, name: str) -> tuple[Part, nn.Module | None, int]:
        """(the tensor's rows as a product part, a fallback module for a type the kernels lack, inputs)."""
        t = self.tensors[name]
        k, n, type_id = int(t.shape[0]), int(t.shape[1]), int(t.tensor_type)
        order = self._order(name, n)
        raw = None
        if self.reblocked is not None and self.reblocked.wants(t):
            type_id, raw = native.TYPES[REBLOCK_TYPE], self.reblocked.rows(name, t)
        elif native.supports(type_id):
            raw = raw_rows(t.data, n)
        if raw is not None:
            raw = raw if order is None else raw[torch.from_numpy(order)].contiguous()
            return Part(type_id, n, native.repack(type_id, raw.view(-1), n, k), raw), None, k
        self.fell_back.append(f"{name} ({t.tensor_type.name})")
        dense = dequantized(t).reshape(n, -1)
        dense = dense if order is None else dense[order]
        weight = torch.from_numpy(np.ascontiguousarray(dense))
        return Part(type_id, n, torch.empty(0, dtype=torch.uint8), None), _fallback_product(weight), k

    def product(self, names: list[str], biases: list[str] | None = None) -> GGUFLinear:
        parts, fallbacks, k = [], [], 0
        for name in names:
            part, fallback, k = self.part(name)
            parts.append(part)
            fallbacks.append(fallback)
        bias = torch.cat([self.vector(name).detach() for name in biases]) if biases else None
        return GGUFLinear(k, parts, bias, fallbacks if any(f is not None for f in fallbacks) else None)

    def vector(self, name: str) -> nn.Parameter:
        """A 1-D tensor (a norm's gain, a bias) as float32, rows reordered like its product's."""
        values = dequantized(self.tensors[name]).reshape(-1)
        order = self._order(name, values.shape[0])
        values = values if order is None else values[order]
        return nn.Parameter(torch.from_numpy(np.array(values, dtype=np.float32)), requires_grad=False)

    def embedding(self, name: str) -> nn.Module:
        t = self.tensors[name]
        dim, vocab = int(t.shape[0]), int(t.shape[1])
        if native.supports(int(t.tensor_type)):
            return GGUFEmbedding(int(t.tensor_type), raw_rows(t.data, vocab), vocab, dim)
        return nn.Embedding.from_pretrained(torch.from_numpy(dequantized(t).reshape(vocab, -1).copy()), freeze=True)


def _fallback_product(weight: torch.Tensor) -> nn.Module:
    """A tensor the kernels cannot read: a w8a8 product of its dequantized weights (row-exact too)."""
    from forerun.models import w8a8
    from forerun.models.linear import Linear

    if w8a8.available("cpu"):
        return w8a8.W8A8Linear.from_float(weight)
    layer = Linear(weight.shape[1], weight.shape[0])
    layer.weight = nn.Parameter(weight.float(), requires_grad=False)
    return layer
