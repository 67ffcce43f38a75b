"""What a server says of its model beside its name, read from the weights' files as llama.cpp's
server reports them: the file type's name (`ftype`: the GGUF's `general.file_type`, or guessed from
the most common tensor type as llama.cpp guesses it), the parameter count and the bytes of all
tensors, the vocabulary's kind (llama.cpp's `llama_vocab_type`), and the model's shape.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from forerun.models.decoder import DecoderConfig
from forerun.models.source import ModelSource

# llama.cpp's `llama_ftype` names (llama_ftype_name), by the number GGUF's general.file_type holds.
FTYPE_NAMES = {
    0: "all F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K - Medium",
    11: "Q3_K - Small",
    12: "Q3_K - Medium",
    13: "Q3_K - Large",
    14: "Q4_K - Small",
    15: "Q4_K - Medium",
    16: "Q5_K - Small",
    17: "Q5_K - Medium",
    18: "Q6_K",
    19: "IQ2_XXS - 2.0625 bpw",
    20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small",
    22: "IQ3_XS - 3.3 bpw",
    23: "IQ3_XXS - 3.0625 bpw",
    24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw",
    26: "IQ3_S - 3.4375 bpw",
    27: "IQ3_S mix - 3.66 bpw",
    28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw",
    30: "IQ4_XS - 4.25 bpw",
    31: "IQ1_M - 1.75 bpw",
    32: "BF16",
    36: "TQ1_0 - 1.69 bpw ternary",
    37: "TQ2_0 - 2.06 bpw ternary",
    38: "MXFP4 MoE",
    39: "NVFP4",
}
UNKNOWN_FTYPE = "unknown, may not work"
GUESSED = 1024  # llama.cpp's LLAMA_FTYPE_GUESSED bit
# The file type llama.cpp guesses from the most common tensor type, where general.file_type is absent
# (a K-quant's "Medium" mix; GGML's type names, safetensors' dtype names).
GUESSED_FTYPE = {
    "F32": 0,
    "F16": 1,
    "BF16": 32,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q8_0": 7,
    "Q2_K": 10,
    "Q3_K": 12,
    "Q4_K": 15,
    "Q5_K": 17,
    "Q6_K": 18,
    "TQ1_0": 36,
    "TQ2_0": 37,
    "IQ2_XXS": 19,
    "IQ2_XS": 20,
    "IQ2_S": 28,
    "IQ3_XXS": 23,
    "IQ1_S": 24,
    "IQ1_M": 31,
    "IQ4_NL": 25,
    "IQ4_XS": 30,
    "IQ3_S": 26,
    "MXFP4": 38,
}
# llama.cpp's `llama_vocab_type`, by GGUF's tokenizer.ggml.model.
VOCAB_TYPES = {"no_vocab": 0, "none": 0, "llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}


@dataclass(frozen=True)
class ModelCard:
    """The served model's facts (llama.cpp's /v1/models `meta` and /props `model_ftype`)."""

    file_format: str  # gguf or safetensors (ModelSource.file_format); "" for a model built in memory
    ftype: str  # llama.cpp's name for the weights' file type; "" where there is no file
    n_params: int  # elements of all tensors
    size: int  # bytes of all tensors
    vocab_type: int  # llama.cpp's llama_vocab_type (0: none or not known)
    n_vocab: int  # rows of the embedding
    n_ctx_train: int  # the longest context the model was trained for
    n_embd: int  # width of the residual stream

    def meta(self, n_ctx: int) -> dict:
        """llama.cpp's `meta` of a /v1/models entry, the server serving `n_ctx` positions a request."""
        return {
            "vocab_type": self.vocab_type,
            "n_vocab": self.n_vocab,
            "n_ctx": n_ctx,
            "n_ctx_train": self.n_ctx_train,
            "n_embd": self.n_embd,
            "n_params": self.n_params,
            "size": self.size,
            "ftype": self.ftype,
        }


def model_card(source: ModelSource, cfg: DecoderConfig) -> ModelCard:
    """The card of the model at `source` (configured as `cfg`), its files' headers read."""
    shape = {"n_vocab": cfg.vocab_size, "n_ctx_train": cfg.max_position, "n_embd": cfg.hidden_size}
    if source.kind == "gguf":
        return ModelCard(source.file_format, **_gguf_facts(source.path), **shape)
    if source.kind == "hf":
        return ModelCard(source.file_format, **_safetensors_facts(source.path), **shape)
    return ModelCard(source.file_format, "", 0, 0, 0, **shape)


def ftype_name(file_type: int | None, tensor_types: list[tuple[str, str]]) -> str:
    """llama.cpp's name for a file's type: `file_type` (general.file_type) where the file gives one,
    else guessed from `tensor_types` ((name, type) each) as llama.cpp guesses: the type of most tensors
    (in name order, the first to reach the most), named with a "(guessed) " prefix."""
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        name = FTYPE_NAMES.get(file_type & ~GUESSED, UNKNOWN_FTYPE)
        return "(guessed) " + name if file_type & GUESSED else name
    counts: Counter[str] = Counter()
    most, most_type = 0, "F32"
    for _, kind in sorted(tensor_types):
        counts[kind] += 1
        if counts[kind] > most:
            most, most_type = counts[kind], kind
    guessed = GUESSED_FTYPE.get(most_type)
    return "(guessed) " + (FTYPE_NAMES[guessed] if guessed is not None else UNKNOWN_FTYPE)


def _gguf_facts(path: Path) -> dict:
    from forerun.models.gguf_loader import open_reader

    reader = open_reader(path)
    tensors = reader.tensors
    file_type = reader.fields.get("general.file_type")
    vocab = reader.fields.get("tokenizer.ggml.model")
    return {
        "ftype": ftype_name(
            file_type.contents() if file_type is not None else None, [(t.name, t.tensor_type.name) for t in tensors]
        ),
        "n_params": sum(math.prod(int(d) for d in t.shape) for t in tensors),
        "size": sum(t.n_bytes for t in tensors),
        "vocab_type": VOCAB_TYPES.get(vocab.contents() if vocab is not None else None, 0),
    }


def _safetensors_facts(folder: Path) -> dict:
    """A folder's safetensors headers (each file's first 8 bytes say how long its JSON header is)."""
    from forerun.models.hf_folder import weight_files

    kinds: list[tuple[str, str]] = []
    n_params = size = 0
    for file in weight_files(folder):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            kinds.append((name, entry["dtype"]))
            n_params += math.prod(entry["shape"])
            start, stop = entry["data_offsets"]
            size += stop - start
    return {"ftype": ftype_name(None, kinds), "n_params": n_params, "size": size, "vocab_type": _hf_vocab_type(folder)}


def _hf_vocab_type(folder: Path) -> int:
    """llama.cpp's vocabulary kind for a folder's tokenizer.json (what its converter would write:
    SentencePiece-style BPE with byte fallback is llama's, other BPE GPT-2's); 0 where not known."""
    try:
        model = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("model") or {}
    except (OSError, ValueError):
        return 0
    kind = model.get("type")
    if kind == "BPE":
        return VOCAB_TYPES["llama" if model.get("byte_fallback") else "gpt2"]
    return {"Unigram": VOCAB_TYPES["t5"], "WordPiece": VOCAB_TYPES["bert"]}.get(kind, 0)
