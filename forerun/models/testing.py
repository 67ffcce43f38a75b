"""Tiny random models for tests and examples: fp32, a few layers, a small vocabulary, no downloads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from forerun.models.decoder import Decoder, DecoderConfig
from forerun.models.load import LoadedModel, ModelSource
from forerun.models.tokenizer import Tokenizer

# A character-level vocabulary: specials, then printable ASCII.
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
# A code model's fill-in-the-middle markers and padding, after the characters (`infill=True`).
_INFILL = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def tiny_config(vocab_size: int = 128, num_layers: int = 2, architecture: str = "qwen2", **overrides) -> DecoderConfig:
    fields = dict(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position=1024,
        attention_bias=architecture == "qwen2",
        tie_embeddings=False,
    )
    fields.update(overrides)
    return DecoderConfig(**fields)


def tiny_decoder(cfg: DecoderConfig | None = None, seed: int = 0, scale: float = 1.0) -> Decoder:
    """A random float32 decoder. `scale` sharpens the logits (larger: more peaked distributions)."""
    cfg = cfg or tiny_config()
    gen = torch.Generator().manual_seed(seed)
    decoder = Decoder(cfg)
    for name, p in decoder.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            p.data.fill_(1.0)
        else:
            p.data = torch.randn(p.shape, generator=gen) * (0.5 / p.shape[-1] ** 0.5)
    decoder.lm_head.weight.data *= scale * 8
    decoder.tie_weights()
    return decoder.eval()


def tiny_tokenizer_folder(folder: Path, infill: bool = False) -> Path:
    """Write a character-level Hugging Face tokenizer (with a chat template) into `folder`; with
    `infill`, Qwen2.5-Coder's fill-in-the-middle tokens follow the characters."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = _SPECIALS + (_INFILL if infill else [])
    vocab = {t: i for i, t in enumerate(_SPECIALS + _CHARS + (_INFILL if infill else []))}
    tok = HFTok(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=specials
    )
    fast.chat_template = (
        # a variable of its own (chat_template_kwargs): a system line
        "{% if greeting is defined %}<|im_start|>system\n{{ greeting }}<|im_end|>\n{% endif %}"
        # tools as Qwen's template shows them, shortly: each function's name; calls in <tool_call> blocks
        "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
        "<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}"
        "{% for c in m.tool_calls or [] %}<tool_call>\n"
        '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
        "{% endfor %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


def tiny_tokenizer(folder: Path, infill: bool = False) -> Tokenizer:
    from transformers import AutoTokenizer

    return Tokenizer(AutoTokenizer.from_pretrained(str(tiny_tokenizer_folder(folder, infill))))


TINY_VOCAB = len(_SPECIALS) + len(_CHARS)  # 99 tokens
TINY_INFILL_VOCAB = TINY_VOCAB + len(_INFILL)  # with infill=True's tokens


def tiny_model(seed: int = 0, tokenizer: Tokenizer | None = None, name: str = "tiny", **cfg_overrides) -> LoadedModel:
    cfg = tiny_config(vocab_size=TINY_VOCAB if tokenizer is None else tokenizer.vocab_size, **cfg_overrides)
    return LoadedModel(name, tiny_decoder(cfg, seed), tokenizer, ModelSource("memory", Path("."), name))


def save_hf_folder(model: LoadedModel, folder: Path, infill: bool = False) -> Path:
    """Save a tiny model as a Hugging Face folder (config.json + model.safetensors + tokenizer, with
    the fill-in-the-middle tokens where `infill`)."""
    from safetensors.torch import save_file

    cfg = model.decoder.cfg
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "architectures": ["Qwen2ForCausalLM"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    state = {
        f"model.{k}" if k != "lm_head.weight" else k: v.contiguous()
        for k, v in model.decoder.state_dict().items()
        if not (cfg.tie_embeddings and k == "lm_head.weight")
    }
    save_file(state, str(folder / "model.safetensors"))
    tiny_tokenizer_folder(folder, infill)
    return folder


# --- GGUF blocks for tiny models ------------------------------------------------------------------
# gguf-py quantizes the 32-input block types (Q4_0, Q5_0, Q8_0, ...) but not the K-quants; these
# write valid Q4_K / Q5_K / Q6_K blocks (plain min/max scales, not llama.cpp's searched ones), so
# tests can build small GGUF models in every type the native kernels read.


def _f16_bytes(values):
    import numpy as np

    return np.asarray(values, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def _pack_k4_scales(sc, mn):
    """8 six-bit scales and mins per block [n, 8] -> the 12 packed bytes of Q4_K / Q5_K [n, 12]."""
    import numpy as np

    s = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    s[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return s


def _quantize_k4(blocks, levels: int):
    """Q4_K (levels 15) or Q5_K (31) of float blocks [n, 256]: (d, dmin, sc, mn, q) per block."""
    import numpy as np

    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)  # [n, 8]
    scale = (sub.max(-1) - low) / levels
    d = np.maximum(scale.max(-1), 1e-10) / 63  # [n]
    dmin = np.maximum((-low).max(-1), 1e-10) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / dmin[:, None]), 0, 63).astype(np.uint8)
    step = np.maximum(d[:, None] * sc, 1e-30)[..., None]
    q = np.clip(np.round((sub + (dmin[:, None] * mn)[..., None]) / step), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q.reshape(-1, 256)


def quantize_k(array, kind: str):
    """Float32 rows [n, k] (k a multiple of 256) as GGUF's Q4_K, Q5_K or Q6_K bytes [n, k / 256 * size]."""
    import numpy as np

    rows = array.shape[0]
    blocks = np.ascontiguousarray(array, dtype=np.float32).reshape(-1, 256)
    n = blocks.shape[0]
    if kind in ("Q4_K", "Q5_K"):
        d, dmin, sc, mn, q = _quantize_k4(blocks, 15 if kind == "Q4_K" else 31)
        lo = (q & 0xF).reshape(n, 4, 2, 32)
        qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
        parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k4_scales(sc, mn)]
        if kind == "Q5_K":
            high = (q >> 4).reshape(n, 8, 32)  # bit 4 of element 32 j + l
            qh = np.zeros((n, 32), dtype=np.uint8)
            for j in range(8):
                qh |= (high[:, j] << j).astype(np.uint8)
            parts.append(qh)
        parts.append(qs)
    elif kind == "Q6_K":
        sub = blocks.reshape(n, 16, 16)
        scale = np.abs(sub).max(-1) / 32  # [n, 16]
        d = (np.maximum(np.abs(scale).max(-1), 1e-10) / 127).astype(np.float16).astype(np.float32)
        sc = np.clip(np.round(scale / d[:, None]), -128, 127).astype(np.int8)
        step = np.where(sc == 0, 1e30, d[:, None] * sc)[..., None]
        q = (np.clip(np.round(sub / step), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
        ql = np.concatenate(
            [(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4), (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=-1
        )  # [n, 2, 64]
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        parts = [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)]
    else:
        raise ValueError(f"not a K-quant type: {kind}")
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def gguf_bytes(array, kind: str):
    """Float32 rows [n, k] as GGUF blocks of type `kind` (a gguf.GGMLQuantizationType name)."""
    import gguf

    if kind.endswith("_K"):
        return quantize_k(array, kind)
    return gguf.quants.quantize(array, getattr(gguf.GGMLQuantizationType, kind))
