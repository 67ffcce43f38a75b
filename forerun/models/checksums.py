"""What names a model's weights across runs: a GGUF file's sha256 (hashed once per file version), a folder's stats."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from forerun.base import files
from forerun.base.paths import converted_dir
from forerun.models import fetch as fetching
from forerun.models.embedded import EMBEDDED
from forerun.models.source import ModelSource


def gguf_checksum(path: Path) -> str:
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
        index[key] = files.sha256_file(path)
        files.write_json(index_file, index)
    return index[key]


def source_identity(source: ModelSource) -> str | None:
    """A GGUF file's sha256; a model folder's path with its config's and weights' sizes and times
    (cheap, and changes when they do); None for anything else (a model built in memory)."""
    if source.kind == "gguf":
        return gguf_checksum(source.path)
    if source.kind == "hf":
        stats = [
            (f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for f in sorted(source.path.glob("*.safetensors")) + [source.path / "config.json"]
        ]
        return hashlib.sha256(f"{source.path.resolve()}:{stats}".encode()).hexdigest()
    return None
