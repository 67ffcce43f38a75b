"""Find llama-server, or build it once from a pinned llama.cpp source under FORERUN_HOME/peers/.

The source is the llama.cpp tree vendored in the llama-cpp-python sdist of `VERSION` on PyPI
(checked against `SDIST_SHA256`), built with CMake. `make peers` runs `main()` to build it ahead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from forerun.base import files
from forerun.base.errors import ForerunError
from forerun.base.paths import cache_dir
from forerun.bench.llamacpp import LlamaCppUnavailable

VERSION = "0.3.36"  # the llama-cpp-python release whose vendor/llama.cpp is built
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF")
TARGETS = ("llama-server", "llama-speculative-simple", "llama-bench")


def peer_dir() -> Path:
    return cache_dir("peers") / f"llama.cpp-{VERSION}"


def source_dir() -> Path:
    return peer_dir() / "llama.cpp"


def server_path() -> Path:
    return source_dir() / "build" / "bin" / "llama-server"


def stamp_path() -> Path:
    return peer_dir() / "built.json"


def unpacked_path() -> Path:
    return peer_dir() / "unpacked"  # the source tree is complete


def find_server() -> Path | None:
    """llama-server from a finished build, or None: the stamp is written only after a build succeeds."""
    server = server_path()
    return server if stamp_path().is_file() and server.is_file() else None


def ensure_server(say: Callable[[str], None] | None = None) -> Path:
    """The llama-server binary, built first if this machine has none (minutes, once)."""
    return find_server() or build(say)


def build(say: Callable[[str], None] | None = None, jobs: int | None = None) -> Path:
    """Download the pinned sdist, unpack its llama.cpp tree and build it; raises LlamaCppUnavailable."""
    say = say or _say
    root = peer_dir()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    jobs = jobs or os.cpu_count() or 2
    say(
        f"building llama.cpp (from llama-cpp-python {VERSION}) for the llama.cpp peer, once: about 10 "
        f"minutes on 2 idle cores, more on a busy machine. It goes in {root}; the build log is {log}."
    )
    start = time.perf_counter()
    try:
        if unpacked_path().is_file() and (source_dir() / "CMakeLists.txt").is_file():
            src = source_dir()  # an interrupted or failed build: compile what is there
        else:
            src = _unpack(_download(root / "download", say), root)
        say(f"compiling {', '.join(TARGETS)} with {jobs} jobs ...")
        with log.open("w") as out:
            _step(["cmake", "-B", "build", *CMAKE_FLAGS], src, out, log)
            _step(["cmake", "--build", "build", f"-j{jobs}", "--target", *TARGETS], src, out, log)
    except (OSError, tarfile.TarError) as exc:  # a full disk, an unreadable archive
        raise LlamaCppUnavailable(f"building llama.cpp in {root} failed: {exc}") from None
    if not server_path().is_file():
        raise LlamaCppUnavailable(f"the llama.cpp build finished but {server_path()} is missing; see {log}")
    seconds = time.perf_counter() - start
    _write_stamp(seconds)
    shutil.rmtree(root / "download", ignore_errors=True)
    say(f"llama.cpp built in {seconds / 60:.1f} minutes: {server_path()}")
    return server_path()


def _write_stamp(seconds: float) -> None:
    stamp = {
        "version": VERSION,
        "sdist_sha256": SDIST_SHA256,
        "cmake": list(CMAKE_FLAGS),
        "targets": list(TARGETS),
        "build_seconds": round(seconds),
        "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    files.write_json(stamp_path(), stamp, indent=1)


def _download(folder: Path, say: Callable[[str], None]) -> Path:
    sdist = folder / SDIST
    if not (sdist.is_file() and files.sha256_file(sdist) == SDIST_SHA256):
        say(f"downloading the llama-cpp-python {VERSION} source (75 MB) from PyPI with pip ...")
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        command += [f"llama-cpp-python=={VERSION}", "-d", str(folder)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not sdist.is_file():
            raise LlamaCppUnavailable(
                f"could not download llama-cpp-python {VERSION} with pip "
                f"({_last_line(done.stderr or done.stdout)}); check the network and run "
                "`make peers` again"
            )
    digest = files.sha256_file(sdist)
    if digest != SDIST_SHA256:
        raise LlamaCppUnavailable(
            f"{sdist} has sha256 {digest}, expected {SDIST_SHA256}; delete it and run `make peers` again"
        )
    return sdist


def _unpack(sdist: Path, root: Path) -> Path:
    """vendor/llama.cpp out of the sdist into root/llama.cpp (a half-unpacked tree is replaced)."""
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"

    def extract(tree: Path) -> None:
        # The archive's members sit under `prefix`: unpack beside, then move that folder into place.
        staging = root / "unpacking"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
                if not members:
                    raise LlamaCppUnavailable(f"{sdist} holds no {prefix}; is it the right file?")
                tar.extractall(staging, members=members, filter="data")
            unpacked = staging / prefix.rstrip("/")
            (unpacked / ".git").unlink(missing_ok=True)  # a submodule pointer into a .git that is not there
            unpacked.rename(tree)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    unpacked_path().unlink(missing_ok=True)
    files.write_atomically(source_dir(), extract)
    files.write_text(unpacked_path(), f"{SDIST} {SDIST_SHA256}\n")
    return source_dir()


def _step(command: list[str], cwd: Path, out: TextIO, log: Path) -> None:
    out.write(f"$ {' '.join(command)}\n")
    out.flush()
    try:
        done = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    except FileNotFoundError:
        raise LlamaCppUnavailable(
            f"building llama.cpp needs {command[0]}, which is not installed (apt-get install cmake g++)"
        ) from None
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise LlamaCppUnavailable(
            f"`{' '.join(command)}` failed (exit {done.returncode}); the last lines of {log}:\n" + "\n".join(tail)
        )


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def _say(message: str) -> None:
    print(f"forerun: {message}", file=sys.stderr, flush=True)


def main() -> int:
    """Build llama.cpp for the bench now, unless built already (what `make peers` runs)."""
    found = find_server()
    if found:
        _say(f"llama.cpp {VERSION} is already built: {found}")
        return 0
    try:
        build()
    except ForerunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
