"""`forerun profile`: a pass's time sorted by kind of work, on a tiny model folder."""
from __future__ import annotations

from pathlib import Path

import pytest

from forerun.cli import main
from forerun.commands.profile import KINDS, kind_of, profile_pass
from forerun.models.load import load_model
from forerun.testing import save_hf_folder, tiny_model


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


@pytest.mark.parametrize("quantization", [None, "w8a8"])
def test_the_kinds_add_up_to_the_pass_and_products_are_found(folder: Path, quantization: str | None) -> None:
    decoder = load_model(str(folder), "float32", quantization=quantization, with_tokenizer=False).decoder
    result = profile_pass(decoder, rows=3, context=10, steps=2, top=4)
    assert result.rows == 3 and result.wall_ms > 0
    assert set(result.kinds) == set(KINDS)
    assert sum(result.kinds.values()) == pytest.approx(result.wall_ms, rel=1e-6)
    assert result.kinds["products"] > 0 and result.kinds["attention"] > 0
    assert len(result.top) == 4 and result.top[0][1] >= result.top[-1][1]


def test_the_command_prints_one_line_per_row_count(folder: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("FORERUN_HOME", str(folder.parent / "home"))
    assert main(["profile", "--model", str(folder), "--dtype", "float32", "--rows", "1,2", "--steps", "1",
                 "--context", "8"]) == 0
    out = capsys.readouterr().out
    assert "| rows | pass | products |" in out
    assert [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()] == ["1", "2"]


def test_bad_rows_are_a_clear_error(folder: Path, capsys) -> None:
    assert main(["profile", "--model", str(folder), "--rows", "1,x"]) == 2
    assert "--rows takes whole numbers" in capsys.readouterr().err
    assert main(["profile", "--model", str(folder), "--rows", "0"]) == 2
    assert "--rows must be at least 1" in capsys.readouterr().err
