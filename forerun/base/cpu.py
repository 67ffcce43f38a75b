"""What CPU this is: its name, generation and feature flags, read from /proc/cpuinfo (Linux), for
choosing a numeric path, keying measured costs and saying in reports what ran where."""

from __future__ import annotations

import functools
import platform

# (family, model, stepping): two CPUs under one name ("AMD EPYC") can be different generations.
NUMBERS = (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo's text: lower-cased key -> value."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() and fields:
            break  # the first processor's block ends
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip().lower(), value.strip())
    return fields


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """This machine's first processor's fields, empty where /proc/cpuinfo cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return {}


def name() -> str:
    """The CPU's model name ("AMD EPYC ...", "Intel(R) Xeon(R) Processor")."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine() or "unknown"


def flags() -> set[str]:
    """The CPU's feature flags (avx2, avx512_vnni, amx_int8, ...); empty where they cannot be read."""
    return set(_cpuinfo().get("flags", "").split())


def has_amx() -> bool:
    """AMX matrix units for bf16 (and int8) products."""
    return {"amx_bf16", "amx_tile"} <= flags()


def vector_units() -> str:
    """The vector units the numeric paths choose by, in words ("AVX-512 with VNNI and bf16, no AMX");
    "" where the CPU has neither AVX2 nor AVX-512 among its flags (older x86, ARM, flags unreadable)."""
    have = flags()
    if "avx512f" in have:
        extras = [label for flag, label in (("avx512_vnni", "VNNI"), ("avx512_bf16", "bf16")) if flag in have]
        units = "AVX-512" + (" with " + " and ".join(extras) if extras else "")
    elif "avx2" in have:
        units = "AVX2, no AVX-512"
    else:
        return ""
    return units + (", AMX" if has_amx() else ", no AMX")


def describe() -> str:
    """The CPU as a report names it: its name, generation numbers and vector units, e.g.
    "AMD EPYC (family 26, model 2, stepping 1; AVX-512 with VNNI and bf16, no AMX)"."""
    info = _cpuinfo()
    numbers = ", ".join(f"{label} {info[key]}" for label, key in NUMBERS if info.get(key))
    detail = "; ".join(part for part in (numbers, vector_units()) if part)
    return f"{name()} ({detail})" if detail else name()
