"""Compile forerun's kernel library with this machine's C++ compiler, once per source version.

The library lands in `FORERUN_HOME/kernels/<hash>/`, the hash covering the sources, the compiler's
version and the flags, so an edit or a new compiler builds afresh and a rerun finds it at once.
Every instruction-set path is compiled on x86-64 whatever this CPU is (`-m` flags only let the
compiler emit those instructions); which path runs is decided at run time from the CPU's features.
`python -m forerun.native.build` builds it ahead (what `make` does).

With FORERUN_EMULATE_AVX512=1 it builds, beside the real one, a library whose avx512 path is
compiled without AVX-512 instructions, its intrinsics emulated through SIMDe (`emulated_avx512.h`;
Debian's libsimde-dev), and which says every CPU runs that path: the path's tests
(`make test-avx512-emulated`) then run on a CPU without AVX-512, slowly. Never for anything else.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from forerun.base.paths import cache_dir

SOURCES = Path(__file__).parent / "src"
LIBRARY = "libforerun_kernels.so"
# Exact float semantics: no contraction of a*b+c into an fma the other paths do not make, no
# reassociation. -fno-math-errno only lets fmaf/nearbyintf inline.
COMMON = [
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-fno-math-errno",
    "-ffp-contract=off",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
]
X86_FLAGS = {
    "avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "avx512.cpp": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"],
}

EMULATE_ENV = "FORERUN_EMULATE_AVX512"
SIMDE = "simde/x86/avx512.h"  # the header the emulated avx512 path includes
EMULATED_FLAGS = {"avx512.cpp": ["-mavx2", "-mfma", "-mf16c", "-DFORERUN_EMULATED"], "api.cpp": ["-DFORERUN_EMULATED"]}


class BuildError(RuntimeError):
    """The library could not be built; the message says what the compiler said."""


@dataclass(frozen=True)
class Plan:
    compiler: str
    units: dict[str, list[str]]  # source file name -> its extra flags

    def key(self, version: str) -> str:
        digest = hashlib.sha256(version.encode())
        for name in sorted(self.units):
            digest.update(name.encode() + b"\0" + (SOURCES / name).read_bytes() + " ".join(self.units[name]).encode())
        for header in sorted(SOURCES.glob("*.h")):
            digest.update(header.name.encode() + b"\0" + header.read_bytes())
        digest.update(" ".join(COMMON).encode())
        return digest.hexdigest()[:16]


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else g++ or c++ or clang++ on PATH."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def plan() -> Plan:
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (install g++, or set CXX)")
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    units = {f.name: (X86_FLAGS.get(f.name, []) if x86 else []) for f in sorted(SOURCES.glob("*.cpp"))}
    if os.environ.get(EMULATE_ENV, "").strip() == "1":
        if not x86:
            raise BuildError(f"{EMULATE_ENV}=1 emulates the x86-64 avx512 path, and this is {platform.machine()}")
        if not _has_header(cxx, SIMDE):
            raise BuildError(f"{EMULATE_ENV}=1 needs SIMDe's headers ({SIMDE}): apt-get install libsimde-dev")
        units.update(EMULATED_FLAGS)
    return Plan(cxx, units)


def _has_header(cxx: str, header: str) -> bool:
    """Whether `cxx` finds `header` on its include path."""
    try:
        done = subprocess.run(
            [cxx, "-x", "c++", "-fsyntax-only", "-"],
            input=f"#include <{header}>\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{cxx} --version failed: {exc}") from None


def library_path() -> Path:
    """Where the library for these sources and this compiler lives (built or not)."""
    p = plan()
    return cache_dir("kernels") / p.key(_version(p.compiler)) / LIBRARY


def build(verbose: bool = False) -> Path:
    """The built library's path, compiling it first if it is not there yet."""
    p = plan()
    target = cache_dir("kernels") / p.key(_version(p.compiler)) / LIBRARY
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for name, flags in p.units.items():
            obj = Path(tmp) / (name + ".o")
            _run([p.compiler, *COMMON, "-fopenmp", *flags, "-c", str(SOURCES / name), "-o", str(obj)], verbose)
            objects.append(str(obj))
        built = Path(tmp) / LIBRARY
        _run([p.compiler, "-shared", "-fopenmp", "-o", str(built), *objects], verbose)
        os.replace(built, target)  # atomic: another process sees the whole library or none
    return target


def _run(command: list[str], verbose: bool) -> None:
    if verbose:
        print(" ".join(command), file=sys.stderr, flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{command[0]} could not run: {exc}") from None
    if done.returncode != 0:
        raise BuildError(f"{' '.join(command[:1] + command[-3:])} failed:\n{done.stderr.strip()[-2000:]}")


def main() -> int:
    try:
        path = build(verbose="-v" in sys.argv)
    except BuildError as exc:
        print(
            f"forerun: the native kernels did not build ({exc}); the gguf and q4_0 formats fall back to w8a8",
            file=sys.stderr,
        )
        return 0  # never fails an install: the formats that need no kernels still work
    print(f"forerun: native kernels ready ({path})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
