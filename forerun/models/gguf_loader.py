"""Read a GGUF file: its architecture, its tensors dequantized under Hugging Face names, its tokenizer."""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from forerun.base.errors import ForerunError
from forerun.models.decoder import SUPPORTED_ARCHITECTURES, DecoderConfig

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


_REFETCH = "download it again (for an embedded model, `forerun models fetch --force NAME`)"


def open_reader(path: Path):
    """The file's header (`gguf_file.GGUFFile`: metadata and the tensor table, tensors memory-mapped)."""
    from forerun.models.gguf_file import GGUFFile, GGUFFormatError

    try:
        return GGUFFile(path)
    except GGUFFormatError as exc:
        raise ForerunError(f"{path} is not a readable GGUF file: {exc}; {exc.remedy or _REFETCH}") from None
    except (OSError, ValueError, UnicodeDecodeError, struct.error) as exc:
        raise ForerunError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}). "
            f"It may be truncated or corrupt: {_REFETCH}."
        ) from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _float32_value(value) -> float:
    """The number a float32 field was written from: 1e-6 is stored as 9.99999997e-07; read back 1e-6."""
    return float(str(np.float32(value)))


def read_config(reader) -> DecoderConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ForerunError(
            f"unsupported architecture {arch!r} in GGUF file; forerun supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}

    def need(key: str) -> int:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ForerunError(
                f"the GGUF file lacks the metadata key {arch}.{key}; it may be corrupt or "
                "written by an incompatible converter"
            )
        return int(value)

    if "token_embd.weight" not in names:
        raise ForerunError("the GGUF file has no token_embd.weight tensor; it is not a complete model")
    heads = need("attention.head_count")
    hidden = need("embedding_length")
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return DecoderConfig(
        architecture=arch,
        vocab_size=int(emb.shape[1]),  # GGUF shapes run fastest dimension first: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_layers=need("block_count"),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=_float32_value(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_freq_factors=_rope_factors(reader, arch, head_dim),
        rms_norm_eps=_float32_value(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(_field(reader, f"{arch}.context_length", 4096)),
        attention_bias="blk.0.attn_q.bias" in names,
        tie_embeddings="output.weight" not in names,
        qk_norm=arch == "qwen3",
    )


def _rope_factors(reader, arch: str, head_dim: int) -> tuple[float, ...] | None:
    """Each rope frequency's divisor: the file's rope_freqs tensor (Llama 3.1's scaling, as
    llama.cpp's converter writes it) times a linear scaling's factor; None for plain rope. Other
    scalings are refused: plain rope on a model trained with scaled rope writes fluent, wrong text."""
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ForerunError(
            f"rope scaling {scaling!r} is not supported yet (llama3 and linear are); use a model without it"
        )
    factors = None
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is not None:
        data = np.asarray(tensor.data)
        if data.dtype != np.float32 or data.size != head_dim // 2 or not np.isfinite(data).all() or (data <= 0).any():
            raise ForerunError(
                f"the GGUF file's rope_freqs.weight must hold {head_dim // 2} positive float32 factors "
                f"(one per rope frequency of a {head_dim}-wide head); it may be corrupt"
            )
        factors = tuple(float(f) for f in data.reshape(-1))
    if scaling == "linear":
        factor = _float32_value(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
        if not factor > 0:
            raise ForerunError(f"the GGUF file's {arch}.rope.scaling.factor must be positive, got {factor}")
        factors = tuple(f * factor for f in factors or (1.0,) * (head_dim // 2))
    return factors


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


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving (its rope pairs rows 2i, 2i+1; ours pairs i, i + D/2).

    llama.cpp's converter writes reshape(H, 2, D/2).swapaxes(1, 2); the inverse is
    reshape(H, D/2, 2).swapaxes(1, 2). The two differ (the permutation is not its own inverse).
    Works for weights [rows, in] and biases [rows] alike.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_tensors(
    reader, cfg: DecoderConfig, dtype: torch.dtype, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor in `dtype`) for every tensor the decoder needs; a progress bar on
    stderr while it dequantizes (about half a minute for a 1.5B model)."""
    import gguf
    from tqdm import tqdm

    for t in tqdm(
        reader.tensors,
        desc=f"converting to {str(dtype).removeprefix('torch.')} (once)",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
        leave=False,
    ):
        name = hf_name(t.name)
        if name is None:
            continue
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
            array = np.array(array, dtype=np.float32, copy=True).reshape([int(d) for d in reversed(t.shape)])
        except Exception as exc:
            raise ForerunError(f"cannot read tensor {t.name} ({exc}); the GGUF file may be corrupt") from None
        if cfg.architecture in ("llama", "mistral"):
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                array = unpermute(array, cfg.num_heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                array = unpermute(array, cfg.num_kv_heads)
        yield name, torch.from_numpy(array).to(dtype)


def expected_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a decoder reads, with its GGUF shape (fastest dimension first: [in, out])."""
    h, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (h, cfg.vocab_size), "output_norm.weight": (h,)}
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (h, cfg.vocab_size)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        shapes.update(
            {
                p + "attn_norm.weight": (h,),
                p + "ffn_norm.weight": (h,),
                p + "attn_q.weight": (h, q),
                p + "attn_k.weight": (h, kv),
                p + "attn_v.weight": (h, kv),
                p + "attn_output.weight": (q, h),
                p + "ffn_gate.weight": (h, f),
                p + "ffn_up.weight": (h, f),
                p + "ffn_down.weight": (f, h),
            }
        )
        if cfg.attention_bias:
            shapes.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)})
        if cfg.qk_norm:
            shapes.update({p + "attn_q_norm.weight": (cfg.head_dim,), p + "attn_k_norm.weight": (cfg.head_dim,)})
    return shapes


def check_tensors(reader, cfg: DecoderConfig, path: Path) -> None:
    """Before any work: every tensor the model needs is there, shaped as its metadata says, with all
    its bytes inside the file; else a ForerunError naming the file and the tensor."""
    import gguf

    tensors = {t.name: t for t in reader.tensors}
    size = Path(path).stat().st_size
    for name, shape in expected_shapes(cfg).items():
        t = tensors.get(name)
        if t is None:
            raise ForerunError(
                f"{path}: tensor {name} is missing; the file is incomplete or not a {cfg.architecture} model"
            )
        got = tuple(int(d) for d in t.shape)
        if got != shape:
            raise ForerunError(
                f"{path}: tensor {name} has shape {list(got)}, the model's metadata says "
                f"{list(shape)}; the file is corrupt or inconsistent"
            )
        block, type_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        need = int(np.prod(got)) // block * type_bytes
        if int(t.data_offset) + need > size or t.data.nbytes < need:
            raise ForerunError(
                f"{path}: tensor {name} runs past the end of the file ({size:,} bytes); "
                "it is truncated: download it again (for an embedded model, "
                "`forerun models fetch --force NAME`)"
            )
