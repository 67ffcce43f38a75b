"""Where forerun keeps what it caches: FORERUN_HOME, else ~/.cache/forerun, one folder per kind."""

from __future__ import annotations

import os
from pathlib import Path

from forerun.base.files import make_folder


def forerun_home() -> Path:
    root = os.environ.get("FORERUN_HOME")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "forerun"
    return make_folder(path, "FORERUN_HOME" if root else "the cache folder")


def cache_dir(name: str) -> Path:
    """FORERUN_HOME/`name`, made if missing: every cache folder is named here, never built by hand."""
    return make_folder(forerun_home() / name, "the cache folder")


def models_dir() -> Path:
    """The embedded models, as fetched."""
    return cache_dir("models")


def converted_dir() -> Path:
    """GGUF files converted once: config, dequantized and quantized weights, tokenizer, checksums."""
    return cache_dir("converted")
