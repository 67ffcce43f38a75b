"""A Hugging Face model folder read: config.json as a DecoderConfig, its *.safetensors as one state dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from forerun.base.errors import ForerunError
from forerun.models.decoder import SUPPORTED_ARCHITECTURES, DecoderConfig


def config_from_hf(raw: dict) -> DecoderConfig:
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ForerunError(
            f"unsupported architecture {arch!r} in config.json; forerun supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    scaling = raw.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ForerunError(f"rope scaling {scaling!r} is not supported yet; use a model without rope_scaling")
    heads = raw["num_attention_heads"]
    return DecoderConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=raw.get("max_position_embeddings", 4096),
        attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def read_hf_folder(folder: Path, dtype: torch.dtype) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
    """(config, every weight in `dtype`); the tokenizer files are read from the same folder."""
    from safetensors.torch import load_file

    cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise ForerunError(f"{folder} has no *.safetensors weights (forerun never loads pickled .bin files)")
    state: dict[str, torch.Tensor] = {}
    for f in weight_files:
        state.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
    return cfg, state
