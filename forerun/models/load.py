"""Turn a model name or path into a ready decoder and tokenizer: `load_model`, and the LoadedModel it returns
(`load_tokenizer_of`: the tokenizer alone).

Accepted everywhere a model is named: an embedded name, a `.gguf` file, a Hugging Face model
folder (config.json, *.safetensors, tokenizer files), or a hub id when a network is there
(source.py). GGUF weights are converted once into a cache (gguf_cache.py); a folder is read as it is
(hf_folder.py); either way the decoder is built by build.py and the tokenizer by tokenizer_files.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from forerun.base.errors import ForerunError
from forerun.models import formats
from forerun.models.build import build_decoder, build_gguf_decoder
from forerun.models.checksums import source_identity
from forerun.models.decoder import Decoder, check_kv_cache_dtype
from forerun.models.gguf_cache import cached_decoder, convert_gguf
from forerun.models.hf_folder import read_hf_folder
from forerun.models.source import ModelSource, resolve
from forerun.models.tokenizer import Tokenizer
from forerun.models.tokenizer_files import load_tokenizer, same_tokens

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
QUANTIZATIONS = (*formats.FORMATS, formats.AUTO)
REBLOCKED = "blocks-q4_0.safetensors"  # a GGUF's re-blocked tensors (`q4_0`), in its cache folder


@dataclass
class LoadedModel:
    name: str
    decoder: Decoder
    tokenizer: Tokenizer | None
    source: ModelSource
    load_seconds: float = 0.0
    tokenizer_dir: Path | None = None  # the folder its tokenizer was read from


def model_identity(model: LoadedModel) -> str | None:
    """What names these weights across runs, for caches of things measured on a model: a GGUF
    file's sha256, a model folder's path with its config's and weights' sizes and times; None for a
    model built in memory (nothing to cache against)."""
    return source_identity(model.source)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ForerunError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}") from None


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "cpu"):
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ForerunError("--device cuda was asked for, but no CUDA GPU is available; use --device cpu")
        return torch.device(device)
    raise ForerunError(f"unknown device {device!r}; use cpu or cuda")


def load_model(
    spec: str,
    dtype: str | torch.dtype = "bfloat16",
    device: str | None = "cpu",
    with_tokenizer: bool = True,
    quantization: str | None = None,
    draft: bool = False,
    kv_cache_dtype: str = "auto",
    tokens_like: LoadedModel | None = None,
) -> LoadedModel:
    """`quantization` (see forerun/models/formats.py) stores every product in that format; for a
    GGUF source the quantized weights are cached beside the converted ones, so only the first such
    load pays for it. `draft`: the model drafts for another (its "auto" format may differ).
    `kv_cache_dtype`: what its KV caches store (Decoder.cache_dtype). `tokens_like`: a loaded model
    whose Tokenizer this one takes where its tokenizer files are that model's (a draft model of the
    target's family: the same tokens, no second tokenizer to load or compare)."""
    start = time.perf_counter()
    check_kv_cache_dtype(kv_cache_dtype)  # before any work
    if quantization not in (None, formats.AUTO):
        formats.get(quantization)  # an unknown name fails before any work
    source = resolve(spec)
    torch_dtype, torch_device = parse_dtype(dtype), resolve_device(device)
    quantization = formats.resolve(quantization, torch_device, source.kind, draft)
    if quantization is not None:
        formats.check_device(quantization, torch_device)
    if quantization in formats.NATIVE and source.kind != "gguf":
        raise ForerunError(
            f"--quantization {quantization} computes a GGUF file's blocks, and {spec} is a model folder; "
            "use w8a8 (or auto) for it"
        )
    if source.kind == "gguf" and quantization in formats.NATIVE:
        converted = convert_gguf(source.path, torch_dtype, with_tokenizer, convert=False)
        reblock = converted.weights.parent / REBLOCKED if quantization == formats.Q4_0 else None
        decoder = build_gguf_decoder(source.path, converted.config, torch_device, reblock)
        tok_dir = converted.tokenizer
    elif source.kind == "gguf":
        converted = convert_gguf(source.path, torch_dtype, with_tokenizer)
        decoder = cached_decoder(converted.config, converted.weights, quantization, torch_device)
        tok_dir = converted.tokenizer
    else:
        cfg, state = read_hf_folder(source.path, torch_dtype)
        decoder, tok_dir = build_decoder(cfg, state, torch_device), source.path
        if quantization:
            formats.quantize_(decoder, quantization)
    decoder.set_kv_cache_dtype(kv_cache_dtype)
    tokenizer = _tokenizer(tok_dir, source, tokens_like) if with_tokenizer else None
    if tokenizer is not None and tokenizer.vocab_size > decoder.cfg.vocab_size:
        raise ForerunError(
            f"{spec}'s tokenizer has {tokenizer.vocab_size} tokens, but the model scores only "
            f"{decoder.cfg.vocab_size}: the tokenizer is not this model's; use the model's own tokenizer files"
        )
    seconds = time.perf_counter() - start
    return LoadedModel(source.name, decoder, tokenizer, source, seconds, tok_dir if with_tokenizer else None)


def _tokenizer(tok_dir: Path, source: ModelSource, like: LoadedModel | None) -> Tokenizer:
    """The tokenizer in `tok_dir`: `like`'s own where its files make the same tokens, else loaded."""
    if like is not None and like.tokenizer is not None and like.tokenizer_dir is not None:
        if same_tokens(tok_dir, like.tokenizer_dir):
            return like.tokenizer
    return load_tokenizer(tok_dir, source)


def load_tokenizer_of(spec: str) -> Tokenizer:
    """The tokenizer of the model `spec` names (as load_model takes it), without reading or converting
    its weights: for a client of a server that holds the model (no bf16 copy kept for a tokenizer)."""
    source = resolve(spec)
    tok_dir = (
        convert_gguf(source.path, torch.bfloat16, True, convert=False).tokenizer
        if source.kind == "gguf"
        else source.path
    )
    return load_tokenizer(tok_dir, source)
