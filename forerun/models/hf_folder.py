"""A Hugging Face model folder read: config.json as a DecoderConfig, its *.safetensors as one state dict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from forerun.base.config import is_finite, is_whole
from forerun.base.errors import ForerunError
from forerun.base.files import load_tensors
from forerun.models.decoder import SUPPORTED_ARCHITECTURES, DecoderConfig, llama3_rope_factors

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
INDEX = "model.safetensors.index.json"  # which shard holds each tensor, as save_pretrained writes it
_OWN_CONFIG = "use the model's own config.json"


def config_from_hf(raw: dict) -> DecoderConfig:
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ForerunError(
            f"unsupported architecture {arch!r} in config.json; forerun supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _check_computable(raw)
    missing = [key for key in REQUIRED if not is_whole(raw.get(key)) or raw[key] < 1]
    if missing:
        raise ForerunError(
            f"config.json lacks a positive whole number for {', '.join(map(repr, missing))} (a {arch} model "
            f"needs them): {_OWN_CONFIG}"
        )
    heads = raw["num_attention_heads"]
    kv_heads = _whole(raw, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ForerunError(
            f"config.json's num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}: {_OWN_CONFIG}"
        )
    head_dim = _whole(raw, "head_dim", raw["hidden_size"] // heads)
    rope = _rope(raw)
    theta = _number(rope, "rope_theta", 10000.0)
    return DecoderConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rope_freq_factors=_rope_factors(rope.get("rope_scaling"), head_dim, theta),
        rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6),
        max_position=_context(raw, arch),
        attention_bias=_flag(raw, "attention_bias", arch == "qwen2"),
        tie_embeddings=_flag(raw, "tie_word_embeddings", False),
        qk_norm=arch == "qwen3",
    )


def _rope(raw: dict) -> dict:
    """Where config.json keeps the rope's settings: at the top (rope_theta, rope_scaling), or, as
    transformers 5 writes them, in `rope_parameters` (rope_theta and rope_type together)."""
    nested = raw.get("rope_parameters")
    if nested is None:
        return raw
    if not isinstance(nested, dict):
        raise ForerunError(f"config.json's rope_parameters is {nested!r}, not an object or null: {_OWN_CONFIG}")
    return {**raw, **nested, "rope_scaling": nested}


def _check_computable(raw: dict) -> None:
    """Refuse what the decoder would compute differently from the model: it would run, fluent and wrong."""
    scaling = _rope(raw).get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ForerunError(f"config.json's rope_scaling is {scaling!r}, not an object or null: {_OWN_CONFIG}")
    if scaling and _scaling_kind(scaling) not in (None, "default", "linear", "llama3"):
        raise ForerunError(
            f"rope scaling {scaling!r} is not supported yet (llama3 and linear are); use a model without it"
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' names for the same function
        raise ForerunError(
            f"config.json's hidden_act {act!r} is not supported: forerun's decoder computes silu (SwiGLU) "
            "MLPs only; use a model whose hidden_act is silu"
        )


def _scaling_kind(scaling: dict) -> object:
    return scaling.get("rope_type", scaling.get("type"))


def _rope_factors(scaling: dict | None, head_dim: int, theta: float) -> tuple[float, ...] | None:
    """Each rope frequency's divisor under config.json's rope_scaling (llama3 or linear), or None."""
    kind = _scaling_kind(scaling) if scaling else None
    if kind in (None, "default"):
        return None
    factor = _number(scaling, "factor", 0.0)
    if not factor > 0:
        raise ForerunError(f"config.json's rope_scaling {scaling!r} lacks its factor: {_OWN_CONFIG}")
    if kind == "linear":
        return (factor,) * (head_dim // 2)
    low, high = _number(scaling, "low_freq_factor", 1.0), _number(scaling, "high_freq_factor", 4.0)
    if not high > low:
        raise ForerunError(f"config.json's rope_scaling needs high_freq_factor > low_freq_factor: {_OWN_CONFIG}")
    original = _whole(scaling, "original_max_position_embeddings", 8192)
    return llama3_rope_factors(head_dim, theta, factor, low, high, original)


def _context(raw: dict, arch: str) -> int:
    """The longest context: the model's, bounded by a sliding attention window where one is on (the
    decoder attends over the whole context, which equals the window's attention only inside it)."""
    longest = _whole(raw, "max_position_embeddings", 4096)
    window_on = arch == "mistral" or (arch in ("qwen2", "qwen3") and raw.get("use_sliding_window") is True)
    window = _whole(raw, "sliding_window", None) if window_on else None
    if window is None or window >= longest:
        return longest
    print(
        f"forerun: config.json's sliding_window {window}: contexts are limited to {window} tokens "
        "(forerun attends over the whole context, which equals the window's attention up to there)",
        file=sys.stderr,
        flush=True,
    )
    return window


def _whole(raw: dict, key: str, default: int | None) -> int | None:
    """A positive whole number of config.json's (absent or null: `default`)."""
    value = raw.get(key)
    if value is None:
        return default
    if not is_whole(value) or value < 1:
        raise ForerunError(f"config.json's {key} must be a positive whole number, got {value!r}: {_OWN_CONFIG}")
    return int(value)


def _number(raw: dict, key: str, default: float) -> float:
    """A positive finite number of config.json's (absent or null: `default`)."""
    value = raw.get(key)
    if value is None:
        return default
    if not is_finite(value) or not value > 0:
        raise ForerunError(f"config.json's {key} must be a positive number, got {value!r}: {_OWN_CONFIG}")
    return float(value)


def _flag(raw: dict, key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ForerunError(f"config.json's {key} must be true or false, got {value!r}: {_OWN_CONFIG}")
    return value


def read_hf_folder(folder: Path, dtype: torch.dtype) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
    """(config, every weight in `dtype`); the tokenizer files are read from the same folder."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:  # UnicodeDecodeError is a ValueError
        raise ForerunError(f"{path} is not readable JSON ({exc}): {_OWN_CONFIG}") from None
    if not isinstance(raw, dict):
        raise ForerunError(f"{path} holds {type(raw).__name__}, not a JSON object: {_OWN_CONFIG}")
    cfg = config_from_hf(raw)
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in weight_files(folder):
        for name, tensor in load_tensors(f, "download the model again").items():
            if name in origin:
                raise ForerunError(
                    f"tensor {name} is in both {origin[name].name} and {f.name} in {folder}: the folder holds "
                    f"two sets of weights; keep one, or add the model's {INDEX}"
                )
            origin[name], state[name] = f, tensor.to(dtype)
    return cfg, state


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files that hold the model: those its index names where it has one (a file
    beside them, such as a consolidated copy, is not read), else every one in the folder."""
    index = folder / INDEX
    if not index.is_file():
        found = sorted(folder.glob("*.safetensors"))
        if not found:
            raise ForerunError(f"{folder} has no *.safetensors weights (forerun never loads pickled .bin files)")
        return found
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (ValueError, OSError, AttributeError) as exc:
        raise ForerunError(f"{index} is not readable JSON ({exc}): download the model again") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ForerunError(f"{index} has no weight_map of tensor names to files: download the model again")
    names = sorted(set(weight_map.values()))
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise ForerunError(
            f"{INDEX} in {folder} names weight files that are not there: "
            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} (missing); download them, or the "
            "model, again"
        )
    return [folder / name for name in names]
