"""`forerun profile`: a pass's time sorted by kind of work, on a tiny model folder."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from forerun.base import cpu
from forerun.bench import machine
from forerun.cli import main
from forerun.commands import profile as profile_command
from forerun.commands.profile import KINDS, PRODUCT_MODULES, Breakdown, kind_of, paired_ratio, profile_pass
from forerun.models.load import load_model
from forerun.models.testing import save_hf_folder, tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tiny_model(seed=0), tmp_path_factory.mktemp("profile") / "tiny")


def test_ops_are_sorted_into_their_kinds() -> None:
    assert kind_of("quantized::linear_dynamic") == "products"
    assert kind_of("aten::_weight_int8pack_mm") == "products"
    assert kind_of("aten::bmm") == "attention"
    assert kind_of("aten::rsqrt") == "element-wise"
    assert kind_of("aten::copy_") == "copies"
    assert kind_of("aten::something_new") == "other ops"


def own_time_by_kind(top: list[tuple[str, float, int]]) -> dict[str, float]:
    """The profiled pass's own time per kind (ms, unscaled), summed op by op from its full top list."""
    by_kind = dict.fromkeys(KINDS, 0.0)
    for op, ms, _ in top:
        by_kind[kind_of(op)] += ms
    return by_kind


@pytest.mark.parametrize("quantization", [None, "w8a8"])
def test_every_product_call_is_found_and_no_kind_is_negative_or_beyond_the_pass(
    folder: Path, quantization: str | None
) -> None:
    decoder = load_model(str(folder), "float32", quantization=quantization, with_tokenizer=False).decoder
    result = profile_pass(decoder, rows=3, context=10, steps=2, top=10**6)  # every op
    assert result.rows == 3 and result.wall_ms > 0
    assert set(result.kinds) == set(KINDS)
    assert min(result.kinds.values()) >= 0, result.kinds
    # The ops' own times lie inside the profiled pass: measured alone they never exceed it.
    measured = sum(ms for kind, ms in result.kinds.items() if kind != "between ops")
    assert measured <= result.wall_ms * (1 + 1e-9), result.kinds
    # Each product module is called once per pass, and each call is one forerun::product range.
    modules = [m for m in decoder.modules() if isinstance(m, PRODUCT_MODULES)]
    calls = {op: count for op, _, count in result.top}
    assert calls["forerun::product"] == len(modules) > 0
    assert result.kinds["products"] > 0 and result.kinds["attention"] > 0
    short = profile_pass(decoder, rows=3, context=10, steps=2, top=4)
    shown = [ms for _, ms, _ in short.top]
    assert len(shown) == 4 and shown == sorted(shown, reverse=True)


def test_each_kind_is_its_ops_own_time_scaled_to_the_median_pass_and_the_rest_is_between_ops(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A clock the test owns: timed passes of 10, 40 and 20 ms (median 20, mean 23.3), then a
    # profiled pass of 30 s, far longer than its ops' own time, so a known part is between ops.
    readings = iter([0.0, 0.010, 0.0, 0.040, 0.0, 0.020, 0.0, 30.0])
    monkeypatch.setattr(profile_command, "time", SimpleNamespace(perf_counter=lambda: next(readings)))
    decoder = load_model(str(folder), "float32", with_tokenizer=False).decoder
    result = profile_pass(decoder, rows=3, context=10, steps=3, top=10**6)
    assert next(readings, None) is None  # every reading taken: three timed passes and the profiled one
    assert result.wall_ms == pytest.approx(20.0)
    own = own_time_by_kind(result.top)
    scale = 20.0 / 30_000.0  # the median pass over the profiled one
    for kind in KINDS[:-1]:
        assert result.kinds[kind] == pytest.approx(own[kind] * scale, rel=1e-9, abs=1e-12), kind
    assert own["products"] > 0 and own["attention"] > 0
    assert result.kinds["between ops"] == pytest.approx((30_000.0 - sum(own.values())) * scale, rel=1e-9)


def w8a8_weight_bytes(cfg) -> int:
    """Bytes of a w8a8 decoder's product weights, from its shape: int8 weights, float32 scales and biases."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer = (
        qkv * cfg.hidden_size
        + 4 * qkv * (2 if cfg.attention_bias else 1)
        + cfg.hidden_size * cfg.num_heads * cfg.head_dim
        + 4 * cfg.hidden_size
        + 2 * cfg.intermediate_size * cfg.hidden_size
        + 4 * 2 * cfg.intermediate_size
        + cfg.hidden_size * cfg.intermediate_size
        + 4 * cfg.hidden_size
    )
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size + 4 * cfg.vocab_size


def test_the_bound_times_the_products_alone_and_counts_each_weight_once(folder: Path) -> None:
    decoder = load_model(str(folder), "float32", quantization="w8a8", with_tokenizer=False).decoder
    result = profile_pass(decoder, rows=2, context=10, steps=2, top=4, bound=True)
    assert result.products_alone_ms is not None and result.products_alone_ms > 0
    assert result.weight_bytes == w8a8_weight_bytes(decoder.cfg)
    assert profile_pass(decoder, rows=2, context=10, steps=2, top=4).products_alone_ms is None


def test_the_cpu_line_survives_a_kernel_path_this_cpu_lacks(monkeypatch) -> None:
    from forerun import native
    from forerun.base.errors import ForerunError

    if not native.available():
        assert machine.kernels().startswith("not available (") and "\n" not in machine.kernels()
        return

    def refused() -> str:
        raise ForerunError("FORERUN_KERNEL_PATH='avx9': this CPU runs scalar")

    monkeypatch.setattr(native, "path", refused)  # asked for by the user, found only once the work is done
    assert machine.cpu_line().endswith("forerun kernels: not usable (FORERUN_KERNEL_PATH='avx9': this CPU runs scalar)")


def test_read_bandwidth_is_a_plausible_rate() -> None:
    assert 1e7 < machine.read_bandwidth(1 << 22, repeats=2) < 1e13  # bytes/s
    buffer = machine.read_buffer(1 << 22)
    assert 1e7 < machine.read_bandwidth(1 << 30, repeats=1, buffer=buffer) < 1e13  # the buffer's bytes count


def test_the_command_sets_passes_against_the_bound(folder: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("FORERUN_HOME", str(folder.parent / "home"))
    reads = iter([2e9, 1e9])  # the fastest read beside the passes is the bound's

    monkeypatch.setattr(machine, "read_bandwidth", lambda nbytes, repeats, buffer: next(reads, 0.5e9))
    assert (
        main(
            [
                "profile",
                "--model",
                str(folder),
                "--quantization",
                "w8a8",
                "--rows",
                "1",
                "--steps",
                "2",
                "--context",
                "8",
                "--bound",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    decoder = load_model(str(folder), "float32", quantization="w8a8", with_tokenizer=False).decoder
    row = next(line for line in out.splitlines() if line.startswith("| 1 |") and "GB" in line)
    read, bound_ms = row.split("|")[3:5]
    assert read.strip() == "2.0 GB/s"
    assert float(bound_ms) == pytest.approx(w8a8_weight_bytes(decoder.cfg) / 2e9 * 1000, abs=0.05)
    # Each pass against the read right after it: the first at 2 GB/s, the second at 1 GB/s.
    paired = float(row.split("|")[9])
    assert 0 < paired < float(row.split("|")[6])  # half-speed reads make a pass's own bound looser


def test_each_pass_is_set_against_the_read_taken_beside_it() -> None:
    pass_bytes = 10**9
    b = Breakdown(1, 0.0, {}, [], weight_bytes=pass_bytes, pairs=[(0.5, 2e9), (0.25, 2e9), (0.4, 1e9)])
    assert paired_ratio(b) == pytest.approx(0.5)  # 1.0, 0.5 and 0.4: the median
    with pytest.raises(ValueError, match="without bound=True"):
        paired_ratio(Breakdown(1, 0.0, {}, []))


def test_the_command_prints_one_line_per_row_count(folder: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("FORERUN_HOME", str(folder.parent / "home"))
    flags = "--dtype float32 --rows 1,2,1 --steps 1 --context 8".split()
    assert main(["profile", "--model", str(folder), *flags]) == 0
    out = capsys.readouterr().out
    assert "| rows | pass | native layers | products |" in out
    assert out.startswith(f"CPU: {cpu.describe()}; forerun kernels: ")  # the figures say what they ran on
    assert [
        line.split("|")[1].strip()
        for line in out.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    ] == ["1", "2"]  # a row count named twice is profiled once


def test_bad_rows_are_a_clear_error(folder: Path, capsys) -> None:
    assert main(["profile", "--model", str(folder), "--rows", "1,x"]) == 2
    assert "--rows takes whole numbers" in capsys.readouterr().err
    assert main(["profile", "--model", str(folder), "--rows", "0"]) == 2
    assert "--rows must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag,value,said",
    [
        ("--top", "0", "--top must be at least 1, got 0"),
        ("--top", "-3", "--top must be at least 1, got -3"),
        ("--steps", "0", "--steps must be at least 1, got 0"),
        ("--context", "-1", "--context must be at least 0, got -1"),
        ("--rows", ",", "--rows ',' names no row count"),
    ],
)
def test_a_number_out_of_range_is_named_by_its_flag_before_the_model_loads(
    capsys, flag: str, value: str, said: str
) -> None:
    assert main(["profile", "--model", "/nonexistent/forerun-model", flag, value]) == 2
    assert f"error: {said}" in capsys.readouterr().err
