"""Where forerun keeps what it caches: FORERUN_HOME, else ~/.cache/forerun, one folder per kind."""

from __future__ import annotations

import os
from pathlib import Path


def forerun_home() -> Path:
    root = os.environ.get("FORERUN_HOME")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "forerun"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir(name: str) -> Path:
    """FORERUN_HOME/`name`, made if missing: every cache folder is named here, never built by hand."""
    path = forerun_home() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    """The embedded models, as fetched."""
    return cache_dir("models")


def converted_dir() -> Path:
    """GGUF files converted once: config, dequantized and quantized weights, tokenizer, checksums."""
    return cache_dir("converted")
