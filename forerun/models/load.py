"""Turn a model name or path into a ready decoder and tokenizer, converting and caching once.

Accepted everywhere a model is named: an embedded name, a `.gguf` file, a Hugging Face model
folder (config.json, *.safetensors, tokenizer files), or a hub id when a network is there.
GGUF weights are dequantized once and cached as safetensors keyed by the file's sha256, so every
later load is a memory map.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from forerun.base.errors import ForerunError
from forerun.base.paths import converted_dir
from forerun.models import fetch as fetching
from forerun.models import formats
from forerun.models.decoder import SUPPORTED_ARCHITECTURES, Decoder, DecoderConfig
from forerun.models.embedded import EMBEDDED
from forerun.models.tokenizer import Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class ModelSource:
    kind: str  # "gguf" or "hf"
    path: Path  # the .gguf file or the model folder
    name: str  # what the user called it


@dataclass
class LoadedModel:
    name: str
    decoder: Decoder
    tokenizer: Tokenizer | None
    source: ModelSource
    load_seconds: float = 0.0


def model_identity(model: LoadedModel) -> str | None:
    """What names these weights across runs, for caches of things measured on a model: a GGUF
    file's sha256, a model folder's path with its config's and weights' sizes and times; None for a
    model built in memory (nothing to cache against)."""
    source = model.source
    if source.kind == "gguf":
        return _gguf_checksum(source.path)
    if source.kind == "hf":
        stats = [
            (f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for f in sorted(source.path.glob("*.safetensors")) + [source.path / "config.json"]
        ]
        return hashlib.sha256(f"{source.path.resolve()}:{stats}".encode()).hexdigest()
    return None


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


def resolve(spec: str) -> ModelSource:
    """Find the weights behind `spec`, fetching an embedded model if needed."""
    if spec in EMBEDDED:
        return ModelSource("gguf", fetching.fetch(spec), spec)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ForerunError(f"{path} is not a .gguf file; pass a .gguf file or a model folder")
        return ModelSource("gguf", path, spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ForerunError(
                f"{path} has no config.json; a model folder needs config.json, *.safetensors and tokenizer files"
            )
        return ModelSource("hf", path, spec)
    known = ", ".join(sorted(EMBEDDED))
    if path.suffix == ".gguf" or spec.startswith((".", "/", "~")):
        raise ForerunError(
            f"{spec}: no such file or folder. Pass an existing .gguf file or model folder, "
            f"or an embedded model name ({known})"
        )
    if spec.count("/") == 1:
        return ModelSource("hf", _hub_download(spec), spec)
    raise ForerunError(
        f"unknown model {spec!r}: not an embedded name ({known}), "
        "not an existing .gguf file or model folder, and not a hub id (owner/name)"
    )


def _hub_download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
    except Exception as exc:
        raise ForerunError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(exc).__name__}). "
            "Without a network, pass a local path instead: a .gguf file or a model folder."
        ) from None
    return Path(folder)


QUANTIZATIONS = (*formats.FORMATS, formats.AUTO)


def load_model(
    spec: str,
    dtype: str | torch.dtype = "bfloat16",
    device: str | None = "cpu",
    with_tokenizer: bool = True,
    quantization: str | None = None,
) -> LoadedModel:
    """`quantization` (see forerun/models/formats.py) stores every product in that format; for a
    GGUF source the quantized weights are cached beside the converted ones, so only the first such
    load pays for it."""
    start = time.perf_counter()
    if quantization not in (None, formats.AUTO):
        formats.get(quantization)  # an unknown name fails before any work
    source = resolve(spec)
    torch_dtype, torch_device = parse_dtype(dtype), resolve_device(device)
    quantization = formats.resolve(quantization, torch_device, source.kind)
    if quantization is not None:
        formats.check_device(quantization, torch_device)
    if quantization == formats.GGUF and source.kind != "gguf":
        raise ForerunError(
            f"--quantization gguf computes a GGUF file's own blocks, and {spec} is a model folder; "
            "use w8a8 (or auto) for it"
        )
    if source.kind == "gguf" and quantization == formats.GGUF:
        cfg, _, tok_dir = _load_gguf(source.path, torch_dtype, with_tokenizer, convert=False)
        decoder = _build_gguf(source.path, cfg, torch_device)
    elif source.kind == "gguf":
        cfg, weights, tok_dir = _load_gguf(source.path, torch_dtype, with_tokenizer)
        decoder = _build_cached(cfg, weights, quantization, torch_device)
    else:
        cfg, state, tok_dir = _load_hf_folder(source.path, torch_dtype)
        decoder = build_decoder(cfg, state, torch_device)
        if quantization:
            formats.quantize_(decoder, quantization)
    tokenizer = load_tokenizer(tok_dir, source) if with_tokenizer else None
    return LoadedModel(source.name, decoder, tokenizer, source, time.perf_counter() - start)


def _build_cached(cfg: DecoderConfig, weights: Path, quantization: str | None, device: torch.device) -> Decoder:
    from safetensors.torch import load_file

    if quantization is None:
        return build_decoder(cfg, load_file(str(weights)), device)
    quantized = weights.with_name(f"{weights.stem}-{formats.get(quantization).cache_tag}.safetensors")
    if quantized.is_file():
        return build_decoder(cfg, load_file(str(quantized)), device, quantization)
    print(
        f"forerun: storing the model's weights as {quantization} (once; cached in {quantized.parent})",
        file=sys.stderr,
        flush=True,
    )
    decoder = formats.quantize_(build_decoder(cfg, load_file(str(weights)), device), quantization, progress=True)
    _atomic_save_tensors({k: v.contiguous() for k, v in decoder.state_dict().items()}, quantized)
    return decoder


def _build_gguf(path: Path, cfg: DecoderConfig, device: torch.device) -> Decoder:
    """The `gguf` format: products over the file's own blocks (no conversion, nothing cached)."""
    from forerun.models import gguf_format, gguf_loader

    reader = gguf_loader.open_reader(path)
    gguf_loader.check_tensors(reader, cfg, path)
    try:
        return gguf_format.load_decoder(reader, cfg).to(device)
    except (KeyError, ValueError) as exc:
        raise ForerunError(f"{path}: its tensors do not fit the model ({exc}); the file may be corrupt") from None


def build_decoder(
    cfg: DecoderConfig, state: dict[str, torch.Tensor], device: torch.device, quantization: str | None = None
) -> Decoder:
    """Build on the meta device and adopt `state` without copying; `quantization`: state holds that
    format's cached weights."""
    with torch.device("meta"):
        decoder = Decoder(cfg)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if quantization is not None:
        try:
            return formats.get(quantization).load(decoder, state).to(device).eval()
        except (KeyError, RuntimeError) as exc:
            raise ForerunError(
                f"the cached {quantization} weights do not fit the model ({str(exc)[-300:]}); "
                "delete them and load again"
            ) from None
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing = set(decoder.state_dict()) - set(state)
    if missing:
        raise ForerunError(f"the weights lack {len(missing)} tensors the model needs, e.g. {sorted(missing)[:3]}")
    try:
        decoder.load_state_dict({k: state[k] for k in decoder.state_dict()}, assign=True, strict=True)
    except RuntimeError as exc:  # shapes that contradict the config
        raise ForerunError(f"the weights do not match the model's configuration: {str(exc).strip()[-300:]}") from None
    decoder.tie_weights()
    return decoder.to(device).eval()


# --- GGUF -------------------------------------------------------------------------------------


def _gguf_checksum(path: Path) -> str:
    """sha256 of a GGUF file, remembered per (path, size, mtime) so a rerun skips the hashing."""
    for model in EMBEDDED.values():
        if path.resolve() == fetching.model_file(model).resolve():
            return model.sha256
    st = path.stat()
    index_file = converted_dir() / "checksums.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = {}
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    if key not in index:
        index[key] = fetching.sha256_of(path)
        _atomic_write_text(index_file, json.dumps(index))
    return index[key]


def _atomic_save_tensors(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write a safetensors file under a temporary name and rename it: never a half-written cache."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(state, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# Version of what a GGUF conversion writes, kept in the cached config.json. Version 1 (no field)
# un-permuted llama/mistral q/k rows wrongly; its qwen2 caches are right and stay in use.
_CONVERSION = 2


def _is_stale(raw: dict) -> bool:
    return raw.get("conversion", 1) < 2 and raw.get("architecture") in ("llama", "mistral")


def _check_gguf_magic(path: Path) -> None:
    """A cheap first look, before hashing a large file that is not GGUF at all."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        raise ForerunError(
            f"{path} is not a GGUF file: it starts with {head!r}, not b'GGUF'. "
            "Pass a .gguf model file (for an embedded model, `forerun models fetch --force NAME`)."
        )


def _load_gguf(path: Path, dtype: torch.dtype, with_tokenizer: bool, convert: bool = True):
    """(config, converted weights file, tokenizer folder); `convert`: also dequantize the weights
    into the cache (the float and w8a8/int8 formats start from them; `gguf` reads the file itself)."""
    from forerun.models import gguf_loader

    _check_gguf_magic(path)
    cache = converted_dir() / _gguf_checksum(path)[:24]
    weights = cache / f"weights-{str(dtype).removeprefix('torch.')}.safetensors"
    config_file = cache / "config.json"
    tok_dir = cache / "tokenizer"
    if config_file.is_file() and _is_stale(json.loads(config_file.read_text())):
        for old in [config_file, *cache.glob("weights-*.safetensors")]:
            old.unlink(missing_ok=True)
    if (convert and not weights.is_file()) or not config_file.is_file():
        # Read everything before writing anything: a bad file leaves no cache entry behind.
        reader = gguf_loader.open_reader(path)
        cfg = gguf_loader.read_config(reader)
        cache.mkdir(parents=True, exist_ok=True)
        if convert:
            _atomic_save_tensors(dict(gguf_loader.iter_tensors(reader, cfg, dtype)), weights)
        _atomic_write_text(config_file, json.dumps({**asdict(cfg), "conversion": _CONVERSION}, indent=1))
    raw = json.loads(config_file.read_text())
    raw.pop("conversion", None)
    cfg = DecoderConfig(**raw)
    if with_tokenizer and not (tok_dir / "tokenizer_config.json").is_file():
        _convert_gguf_tokenizer(path, tok_dir)
    return cfg, weights, tok_dir


def _convert_gguf_tokenizer(path: Path, tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ForerunError(f"cannot build a tokenizer from {path} ({type(exc).__name__}: {exc})") from None
    tmp = tok_dir.with_name(f".{tok_dir.name}.{os.getpid()}.tmp")
    try:
        tok.save_pretrained(str(tmp))
        if tok_dir.exists():
            shutil.rmtree(tok_dir)
        os.replace(tmp, tok_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- Hugging Face folders ---------------------------------------------------------------------


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


def _load_hf_folder(folder: Path, dtype: torch.dtype):
    from safetensors.torch import load_file

    cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ForerunError(f"{folder} has no *.safetensors weights (forerun never loads pickled .bin files)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
    return cfg, state, folder


_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(tok_dir: Path, source: ModelSource) -> Tokenizer | None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # A folder whose tokenizer_config names the generic class means "exactly this tokenizer.json".
    # AutoTokenizer would instead pick the class registered for config.json's model_type (qwen2 ->
    # Qwen2Tokenizer), which rebuilds its own pre-tokenizer and can tokenize differently.
    try:
        declared = json.loads((tok_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        declared = None
    generic = declared in _GENERIC_TOKENIZER_CLASSES and (tok_dir / "tokenizer.json").is_file()
    try:
        hf = (PreTrainedTokenizerFast if generic else AutoTokenizer).from_pretrained(str(tok_dir))
    except Exception as exc:
        raise ForerunError(f"cannot load the tokenizer of {source.name} from {tok_dir} ({exc})") from None
    extra: list[int] = []
    gen_cfg = tok_dir / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return Tokenizer(hf, extra)
