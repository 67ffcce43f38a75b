"""GGUF files converted once into FORERUN_HOME/converted/<id>/ (<id>: the first 24 hex digits of the
file's sha256): config, dequantized weights, their quantized copies and the tokenizer folder, so every
later load is a memory map."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from forerun.base import files
from forerun.base.errors import ForerunError
from forerun.base.paths import converted_dir
from forerun.models import formats
from forerun.models.build import build_decoder
from forerun.models.checksums import gguf_checksum
from forerun.models.decoder import Decoder, DecoderConfig
from forerun.models.tokenizer_files import convert_gguf_tokenizer

# Version of what a GGUF conversion writes, kept in the cached config.json. Version 1 (no field)
# un-permuted llama/mistral q/k rows wrongly; its qwen2 caches are right and stay in use.
_CONVERSION = 2


@dataclass
class ConvertedGGUF:
    config: DecoderConfig
    weights: Path  # the dequantized weights in the dtype asked for (absent when not converted)
    tokenizer: Path  # the tokenizer folder (absent when no tokenizer was asked for)


def convert_gguf(path: Path, dtype: torch.dtype, with_tokenizer: bool, convert: bool = True) -> ConvertedGGUF:
    """The cache entry of GGUF file `path`, written first where missing; `convert`: also dequantize the
    weights into it (the float and w8a8/int8 formats start from them; `gguf` reads the file itself)."""
    _check_gguf_magic(path)
    cache = converted_dir() / gguf_checksum(path)[:24]
    weights = cache / f"weights-{str(dtype).removeprefix('torch.')}.safetensors"
    config_file = cache / "config.json"
    tok_dir = cache / "tokenizer"
    cfg = _cached_config(config_file)
    if cfg is None and config_file.is_file():  # damaged, or from a converter whose weights are wrong
        for old in [config_file, *cache.glob("weights-*.safetensors")]:
            old.unlink(missing_ok=True)
    if (convert and not weights.is_file()) or cfg is None:
        cfg = _convert(path, dtype, weights if convert else None, config_file)
    if with_tokenizer and not (tok_dir / "tokenizer_config.json").is_file():
        convert_gguf_tokenizer(path, tok_dir)
    return ConvertedGGUF(cfg, weights, tok_dir)


def _cached_config(config_file: Path) -> DecoderConfig | None:
    """The config a conversion wrote, or None where there is none this version can trust."""
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
        if _is_stale(raw):
            return None
        raw.pop("conversion", None)
        return DecoderConfig(**raw)
    except (OSError, ValueError, TypeError, AttributeError):  # absent, cut short, or not this version's fields
        return None


def _convert(path: Path, dtype: torch.dtype, weights: Path | None, config_file: Path) -> DecoderConfig:
    """Read the config (and, given `weights`, every tensor) from `path` and write them to the cache."""
    from forerun.models import gguf_loader

    # Read everything before writing anything: a bad file leaves no cache entry behind.
    reader = gguf_loader.open_reader(path)
    cfg = gguf_loader.read_config(reader)
    if weights is not None:
        files.save_tensors(weights, dict(gguf_loader.iter_tensors(reader, cfg, dtype)))
    files.write_json(config_file, {**asdict(cfg), "conversion": _CONVERSION}, indent=1)
    return cfg


def _is_stale(raw: dict) -> bool:
    return raw.get("conversion", 1) < 2 and raw.get("architecture") in ("llama", "mistral")


def _check_gguf_magic(path: Path) -> None:
    """A cheap first look, before hashing a large file that is not GGUF at all."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise ForerunError(
            f"cannot read {path} ({exc.strerror or exc}): give forerun a GGUF file it can read"
        ) from None
    if head != b"GGUF":
        raise ForerunError(
            f"{path} is not a GGUF file: it starts with {head!r}, not b'GGUF'. "
            "Pass a .gguf model file (for an embedded model, `forerun models fetch --force NAME`)."
        )


def cached_decoder(cfg: DecoderConfig, weights: Path, quantization: str | None, device: torch.device) -> Decoder:
    """The decoder from the converted weights; in `quantization`, from its cached copy, made once beside them."""
    if quantization is None:
        return build_decoder(cfg, _load_cached(weights), device)
    quantized = weights.with_name(f"{weights.stem}-{formats.get(quantization).cache_tag}.safetensors")
    if quantized.is_file():
        return build_decoder(cfg, _load_cached(quantized), device, quantization)
    print(
        f"forerun: storing the model's weights as {quantization} (once; cached in {quantized.parent})",
        file=sys.stderr,
        flush=True,
    )
    decoder = formats.quantize_(build_decoder(cfg, _load_cached(weights), device), quantization, progress=True)
    files.save_tensors(quantized, {k: v.contiguous() for k, v in decoder.state_dict().items()})
    return decoder


def _load_cached(path: Path) -> dict[str, torch.Tensor]:
    return files.load_tensors(path, "delete it, and the next load converts the model again")
