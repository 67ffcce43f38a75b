"""Files forerun writes into its cache and output folders, whole or not at all, and reads back (a
damaged one named, with what to do); their checksums."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from forerun.base.errors import ForerunError

if TYPE_CHECKING:
    import torch

_CHUNK = 1 << 20  # bytes read at a time when hashing


def make_folder(path: Path, what: str, writes: tuple[str, ...] = (), writer: str = "forerun") -> Path:
    """`path` as a folder, made with its parents if missing; a clear error naming `what` (a flag, a
    setting) where it is a file or cannot be made, or where a folder sits in the place of one of the
    files `writer` writes into it (`writes`: it would fail only once its work is done)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ForerunError(f"{what} {path} is a file, not a folder: name a folder") from None
    except OSError as exc:
        raise ForerunError(
            f"{what} {path} cannot be made ({exc.strerror or exc}): name a folder you can write to"
        ) from None
    for name in writes:
        if (path / name).is_dir():
            raise ForerunError(
                f"{what} {path} holds a folder named {name}, where {writer} writes that file; "
                f"move it away, or use another {what}"
            )
    return path


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Run `write(tmp)` on a temporary sibling of `path`, then rename it into place.

    A reader sees the old file or the new one, never half of one, and a crash leaves no temporary
    behind. `tmp` may be a file or a folder; a folder replaces an older folder at `path`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if tmp.is_dir() and path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: Path, data: object, indent: int | None = None) -> None:
    write_text(path, json.dumps(data, indent=indent))


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file, written atomically (never a pickle)."""
    from safetensors.torch import save_file

    write_atomically(path, lambda tmp: save_file(tensors, str(tmp)))


def load_tensors(path: Path, remedy: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a clear error naming the file, and `remedy`, where it cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        message = f"{path} is not a readable safetensors file, damaged or cut short ({exc}); {remedy}"
        raise ForerunError(message) from None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()
