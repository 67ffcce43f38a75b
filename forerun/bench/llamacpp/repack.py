"""Whether llama.cpp's repacked weights run on this CPU: probed once per CPU, remembered under FORERUN_HOME/peers/.

By default llama.cpp repacks weights into layouts for the CPU's matrix units; on some CPUs with AMX
its AMX kernels crash the process on every batch of more than one row (llama.cpp issue #20824),
which kills a server at its first prompt. Where the probe crashes, the peer runs with --no-repack,
llama.cpp's own switch for it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from forerun.base import cpu, files
from forerun.bench.llamacpp.build import VERSION, peer_dir

REPACK_PROBE_ROWS = 4  # a pass over this many rows shows the crash
REPACK_PROBE_TIMEOUT_S = 300.0


def repack_path() -> Path:
    return peer_dir() / "repack.json"


def repack_works(binary: Path, model: Path, threads: int) -> bool:
    """Whether the default, repacked weights survive a pass over several rows on this CPU.

    Probed with llama-bench (a sibling of `binary`); without llama-bench it cannot tell: True.
    """
    bench = binary.parent / "llama-bench"
    if not bench.is_file():
        return True
    key = _cpu_key()
    path = repack_path()
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        known = {}
    if key in known:
        return bool(known[key])
    known[key] = works = _probe(bench, model, threads)
    files.write_json(path, known, indent=1)
    return works


def _cpu_key() -> str:
    """This llama.cpp on this CPU: a crash depends on both."""
    return hashlib.sha256(f"{VERSION}|{cpu.name()}|{' '.join(sorted(cpu.flags()))}".encode()).hexdigest()[:16]


def _probe(bench: Path, model: Path, threads: int) -> bool:
    """One llama-bench pass over REPACK_PROBE_ROWS prompt rows with repacking on; True if it exits cleanly."""
    command = [str(bench), "-m", str(model), "-t", str(threads), "-p", str(REPACK_PROBE_ROWS)]
    command += ["-n", "0", "-r", "1", "--repack", "1"]
    try:
        return subprocess.run(command, capture_output=True, timeout=REPACK_PROBE_TIMEOUT_S).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
