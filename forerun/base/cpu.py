"""What CPU this is: its name and feature flags, read from /proc/cpuinfo (Linux), for choosing a
numeric path, keying measured costs and saying in reports what ran where."""

from __future__ import annotations

import functools
import platform


@functools.cache
def _cpuinfo_first(key: str) -> str | None:
    """The value of the first `key` line of /proc/cpuinfo, None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def name() -> str:
    """The CPU's model name ("AMD EPYC ...", "Intel(R) Xeon(R) Processor")."""
    return _cpuinfo_first("model name") or platform.processor() or platform.machine() or "unknown"


def flags() -> set[str]:
    """The CPU's feature flags (avx2, avx512_vnni, amx_int8, ...); empty where they cannot be read."""
    return set((_cpuinfo_first("flags") or "").split())


def has_amx() -> bool:
    """AMX matrix units for bf16 (and int8) products."""
    return {"amx_bf16", "amx_tile"} <= flags()
