"""Read a GGUF file: its architecture, its tensors dequantized under Hugging Face names, its tokenizer."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from forerun.errors import ForerunError
from forerun.models.decoder import SUPPORTED_ARCHITECTURES, DecoderConfig

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises many types on a bad or short file
        raise ForerunError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}). "
            "It may be truncated or corrupt: download it again (for an embedded model, "
            "`forerun models fetch --force NAME`)."
        ) from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_config(reader) -> DecoderConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ForerunError(f"unsupported architecture {arch!r} in GGUF file; "
                           f"forerun supports: {', '.join(SUPPORTED_ARCHITECTURES)}")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return DecoderConfig(
        architecture=arch,
        vocab_size=int(emb.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(_field(reader, f"{arch}.context_length", 4096)),
        attention_bias="blk.0.attn_q.bias" in names,
        tie_embeddings="output.weight" not in names,
    )


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name (without the `model.` prefix) of a GGUF tensor, or None."""
    match = _BLOCK_RE.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        mapped = _BLOCK_NAMES.get(part)
        return f"layers.{layer}.{mapped}.{kind}" if mapped else None
    stem, _, kind = gguf_name.rpartition(".")
    mapped = _TOP_NAMES.get(stem)
    return f"{mapped}.{kind}" if mapped else None


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp stores llama q/k rows interleaved for its rope; undo that for rotate-half rope.
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_tensors(reader, cfg: DecoderConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor in `dtype`) for every tensor the decoder needs."""
    import gguf

    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ForerunError(f"cannot read tensor {t.name} ({exc}); the GGUF file may be corrupt") from None
        array = np.array(array, dtype=np.float32, copy=True).reshape([int(d) for d in reversed(t.shape)])
        if cfg.architecture in ("llama", "mistral"):
            if name.endswith("q_proj.weight"):
                array = _unpermute(array, cfg.num_heads)
            elif name.endswith("k_proj.weight"):
                array = _unpermute(array, cfg.num_kv_heads)
        yield name, torch.from_numpy(array).to(dtype)
