"""The CPU as reports name it and as measured costs are keyed: its generation numbers and vector units,
not only its name, since one name ("AMD EPYC") has covered CPUs with AVX2 only and with AVX-512."""

from __future__ import annotations

import pytest

from forerun.base import cpu

ZEN5 = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 26
model		: 2
model name	: AMD EPYC
stepping	: 1
flags		: fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni avx512_vp2intersect

processor	: 1
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 17
model name	: another CPU
bogomips	: 5192.19
"""
ZEN2 = "cpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC\nstepping\t: 0\nflags\t\t: fpu avx avx2 fma\n"
XEON = (
    "cpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum\nstepping\t: 8\n"
    "flags\t\t: avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n"
)


def _pretend_cpuinfo(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: cpu.parse_cpuinfo(text))


def test_the_first_processor_is_read_and_model_is_not_model_name() -> None:
    fields = cpu.parse_cpuinfo(ZEN5)
    assert fields["model"] == "2" and fields["model name"] == "AMD EPYC" and fields["cpu family"] == "26"
    assert "bogomips" not in fields  # the second processor's block is not read


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (ZEN5, "AMD EPYC (family 26, model 2, stepping 1; AVX-512 with VNNI and bf16, no AMX)"),
        (ZEN2, "AMD EPYC (family 23, model 49, stepping 0; AVX2, no AVX-512, no AMX)"),
        (XEON, "Intel(R) Xeon(R) Platinum (family 6, model 143, stepping 8; AVX-512 with VNNI and bf16, AMX)"),
        ("model name\t: old\nflags\t\t: fpu sse avx\n", "old"),  # no AVX2: no vector units worth naming
        ("\nmodel name\t: x\nflags\t:\n", "x"),  # a leading blank line, an empty flags line
        ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU part\t: 0xd0c\n", None),  # ARM
    ],
)
def test_describe_tells_apart_cpus_of_one_name(
    monkeypatch: pytest.MonkeyPatch, text: str, expected: str | None
) -> None:
    _pretend_cpuinfo(monkeypatch, text)
    assert cpu.describe() == (expected or cpu.name()) and cpu.describe()  # ARM: the platform's name


def test_without_cpuinfo_the_name_stands_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_cpuinfo(monkeypatch, "")
    assert cpu.flags() == set() and cpu.vector_units() == ""
    assert cpu.describe() == cpu.name() and cpu.name()  # platform's name, never empty
