"""A Hugging Face model folder read: config.json as a DecoderConfig, its *.safetensors as one state dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from forerun.base.errors import ForerunError
from forerun.base.files import load_tensors
from forerun.models.decoder import SUPPORTED_ARCHITECTURES, DecoderConfig

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def config_from_hf(raw: dict) -> DecoderConfig:
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ForerunError(
            f"unsupported architecture {arch!r} in config.json; forerun supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    scaling = raw.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ForerunError(f"rope scaling {scaling!r} is not supported yet; use a model without rope_scaling")
    missing = [key for key in REQUIRED if not isinstance(raw.get(key), int) or raw[key] < 1]
    if missing:
        raise ForerunError(
            f"config.json lacks a positive whole number for {', '.join(map(repr, missing))} (a {arch} model "
            "needs them): use the model's own config.json"
        )
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
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:  # UnicodeDecodeError is a ValueError
        raise ForerunError(f"{path} is not readable JSON ({exc}): use the model's own config.json") from None
    if not isinstance(raw, dict):
        raise ForerunError(f"{path} holds {type(raw).__name__}, not a JSON object: use the model's own config.json")
    cfg = config_from_hf(raw)
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise ForerunError(f"{folder} has no *.safetensors weights (forerun never loads pickled .bin files)")
    state: dict[str, torch.Tensor] = {}
    for f in weight_files:
        state.update({k: v.to(dtype) for k, v in load_tensors(f, "download the model again").items()})
    return cfg, state
