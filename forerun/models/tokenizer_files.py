"""A model's Tokenizer from files: a tokenizer folder, or one converted once from a GGUF file's vocabulary;
whether two folders make the same tokens (`same_tokens`)."""

from __future__ import annotations

import json
from pathlib import Path

from forerun.base import files
from forerun.base.errors import ForerunError
from forerun.models.source import ModelSource
from forerun.models.tokenizer import Tokenizer

_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# The files a tokenizer's vocabulary is in (tokenizer_config.json alone has none: transformers then
# builds an empty tokenizer, and every prompt comes out as no tokens at all).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
# Every file of a folder that makes its Tokenizer's tokens and stop ids, the chat template's own
# file aside (a family's sizes ship the same tokenizer with templates that differ in a line).
_TOKEN_FILES = (
    *VOCABULARY_FILES,
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def convert_gguf_tokenizer(path: Path, tok_dir: Path) -> None:
    """Write the tokenizer held in GGUF file `path` as a tokenizer folder at `tok_dir` (whole or not at all)."""
    from transformers import AutoTokenizer

    from forerun.models.gguf_loader import open_reader

    if "tokenizer.ggml.model" not in open_reader(path).fields:
        raise ForerunError(
            f"{path} holds no tokenizer (no tokenizer.ggml.* metadata): use a GGUF file converted with its "
            "tokenizer, or load it without one (LLM: a LoadedModel from load_model(..., with_tokenizer=False)) "
            "and give prompts as token ids"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ForerunError(f"cannot build a tokenizer from {path} ({type(exc).__name__}: {exc})") from None
    files.write_atomically(tok_dir, lambda tmp: tok.save_pretrained(str(tmp)))


def same_tokens(a: Path, b: Path) -> bool:
    """Whether tokenizer folders `a` and `b` make the same tokens and stop ids: each of their token
    files the same bytes in both (or in neither), and a tokenizer class that their shared
    tokenizer_config.json names (without one, transformers would pick it from each model's config)."""
    if a.resolve() == b.resolve():
        return True
    try:
        if not json.loads((a / "tokenizer_config.json").read_text()).get("tokenizer_class"):
            return False
        return all(_bytes_or_none(a / name) == _bytes_or_none(b / name) for name in _TOKEN_FILES)
    except (OSError, ValueError, AttributeError):
        return False


def _bytes_or_none(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def load_tokenizer(tok_dir: Path, source: ModelSource) -> Tokenizer:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # A folder whose tokenizer_config names the generic class means "exactly this tokenizer.json".
    # AutoTokenizer would instead pick the class registered for config.json's model_type (qwen2 ->
    # Qwen2Tokenizer), which rebuilds its own pre-tokenizer and can tokenize differently.
    try:
        declared = json.loads((tok_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        declared = None
    if not any((tok_dir / name).is_file() for name in VOCABULARY_FILES):
        raise ForerunError(
            f"{tok_dir} has no tokenizer files (one of {', '.join(VOCABULARY_FILES)}): copy the model's "
            f"tokenizer files into it, or load {source.name} without a tokenizer and give prompts as token ids"
        )
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
