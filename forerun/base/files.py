"""Files forerun writes into its cache and output folders, whole or not at all, and reads back (a
damaged one named, with what to do); their checksums."""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from forerun.base.errors import ForerunError

if TYPE_CHECKING:
    import torch

_CHUNK = 1 << 20  # bytes read at a time when hashing
# What a disk or folder answers a write it refuses: full, over quota, read-only, not ours.
_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


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


def write_atomically(path: Path, write: Callable[[Path], None], member: str | None = None) -> None:
    """Run `write(tmp)` on a temporary sibling of `path`, then rename it into place.

    A reader sees the old file or the new one, never half of one, and a crash leaves no temporary
    behind; one a killed process left (no clean-up runs then) is removed by the next write of
    `path`. `tmp` may be a file or a folder; a folder replaces an older folder at `path`. `member`:
    `write` makes `tmp` a folder holding the file `member`, and that file becomes `path` (for writers
    that put a temporary of their own beside the file they are given). A write the disk or the
    folder refuses (full, read-only) is a ForerunError naming `path`.
    """
    tmp = path.with_name(f".{path.name}.{_writer()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphans(path)
        write(tmp)
        written = tmp / member if member else tmp
        if written.is_dir() and path.is_dir():
            shutil.rmtree(path)
        os.replace(written, path)
    except OSError as exc:
        in_path = exc.errno == errno.ENOTDIR or (exc.errno == errno.EEXIST and not path.parent.is_dir())
        if exc.errno == errno.EISDIR or in_path:
            what = "a file stands in its path" if in_path else "a folder stands where the file goes"
            raise ForerunError(
                f"cannot write {path}: {what}; move it away, or point FORERUN_HOME (or the output folder) "
                "at another folder"
            ) from None
        if exc.errno not in _WRITE_ERRORS:
            raise
        raise _unwritable(path, exc.strerror or str(exc)) from None
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif path.parent.is_dir():  # (a file in the path: no temporary could be made)
            tmp.unlink(missing_ok=True)


def _unwritable(path: Path, why: str) -> ForerunError:
    return ForerunError(
        f"cannot write {path} ({why}): free some space, or point FORERUN_HOME (or the output folder) "
        "at a folder you can write to"
    )


def _writer() -> str:
    """This process as a temporary's name gives it: host and process id (a FORERUN_HOME may be shared
    by several machines, whose process ids this one cannot see)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _remove_orphans(path: Path) -> None:
    """Remove the temporaries of `path` that a process of this host left when it was killed
    mid-write; another host's are left alone (whether it still writes cannot be seen from here)."""
    host = socket.gethostname()
    for orphan in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        owner, _, pid = orphan.name[len(path.name) + 2 : -len(".tmp")].rpartition("-")
        if owner != host or not pid.isdigit() or _running(int(pid)):
            continue
        try:
            if orphan.is_dir():
                shutil.rmtree(orphan)
            else:
                orphan.unlink(missing_ok=True)
        except OSError:
            pass  # not ours to remove after all: the write goes on beside it


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # running, as another user
        return True
    return True


def write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: Path, data: object, indent: int | None = None) -> None:
    write_text(path, json.dumps(data, indent=indent))


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file, written atomically (never a pickle)."""
    import safetensors.torch
    from safetensors import SafetensorError

    def write(tmp: Path) -> None:
        # safetensors writes a temporary file of its own beside the file it is given: inside ours,
        # so that a killed process leaves it where the next write of `path` removes it.
        tmp.mkdir()
        try:
            safetensors.torch.save_file(tensors, str(tmp / path.name))
        except SafetensorError as exc:  # its I/O errors (a full disk) come as this
            raise _unwritable(path, str(exc).removeprefix("Error while serializing: ")) from None

    write_atomically(path, write, member=path.name)


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
