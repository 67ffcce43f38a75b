"""Bad input to bench, bench-serve, quality and tune-skip: a clear error that names the flag or file,
given before any model loads where that is cheap; nothing an earlier run wrote is lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forerun.base.errors import ForerunError
from forerun.bench.serve_load import LevelResult
from forerun.bench.store import ResultStore
from forerun.cli import main
from forerun.models.testing import save_hf_folder, tiny_model

NO_MODEL = "/nonexistent/forerun-model"  # loading it fails: an error about anything else came first


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("input")
    dataset = root / "prompts.jsonl"
    dataset.write_text(json.dumps({"prompt": "abc abc abc", "category": "code"}) + "\n")
    return {
        "target": save_hf_folder(tiny_model(seed=0), root / "target"),
        "draft": save_hf_folder(tiny_model(seed=0, num_layers=1), root / "draft"),
        "dataset": dataset,
    }


def argparse_error(capsys, argv: list[str]) -> str:
    """stderr of a command line argparse refuses (it exits 2)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


# --- bench ------------------------------------------------------------------------------------


def bench(model: str, out: Path, *extra: str, dataset: str = "spec-bench") -> list[str]:
    return [
        "bench",
        "--model",
        model,
        "--dtype",
        "float32",
        "--max-tokens",
        "3",
        "--out",
        str(out),
        "--no-progress",
    ] + [
        "--dataset",
        dataset,
        *extra,
    ]


@pytest.mark.parametrize("flag", ["--methods", "--categories", "--sweep-k", "--peers"])
def test_bench_refuses_a_comma_list_that_names_nothing(capsys, tmp_path: Path, flag: str) -> None:
    err = argparse_error(capsys, bench(NO_MODEL, tmp_path, flag, ","))
    assert f"argument {flag}: names no" in err


@pytest.mark.parametrize(
    "method,said",
    [
        ("auto:branch=x", "branch='x' is not a value --draft-branch takes (expected a whole number"),
        ("auto:branch=-1", "branch='-1' is not a value --draft-branch takes (must be at least 0, got -1)"),
        ("draft:min_confidence=high", "min_confidence='high' is not a value --draft-min-confidence takes"),
        ("draft:draft_vocab=0", "draft_vocab='0' is not a value --draft-vocab takes (must be at least 1"),
        ("auto:quantize=q9", "quantize='q9' is not one of --speculative-quantization's choices"),
        ("early-exit:skip_layers=a", "skip_layers='a' is not a value --skip-layers takes"),
    ],
)
def test_a_method_option_its_flag_would_refuse_is_an_error_before_any_model_loads(
    capsys, tmp_path: Path, method: str, said: str
) -> None:
    assert main(bench(NO_MODEL, tmp_path, "--methods", method, "--speculative-model", NO_MODEL)) == 2
    err = capsys.readouterr().err
    assert f"error: method {method!r}: {said}" in err
    assert not (tmp_path / "results.jsonl").exists()


def test_a_method_option_is_read_as_its_flag_reads_it(folders: dict[str, Path], tmp_path: Path) -> None:
    # skip_layers is a list (--skip-layers takes several): one number is a list of one, not an int.
    extra = ("--methods", "early-exit:skip_layers=1", "--no-warmup")
    assert main(bench(str(folders["target"]), tmp_path, *extra, dataset=str(folders["dataset"]))) == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["options"].get("skip_layers") for r in records] == [None, [1]]


def test_a_method_named_twice_runs_once(folders: dict[str, Path], tmp_path: Path) -> None:
    extra = ("--methods", "ngram,ngram", "--no-warmup")
    assert main(bench(str(folders["target"]), tmp_path, *extra, dataset=str(folders["dataset"]))) == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["plain", "ngram"]


def test_bench_out_that_is_a_file_or_cannot_be_made_is_a_clear_error(capsys, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert main(bench(NO_MODEL, afile, "--methods", "plain")) == 2
    assert f"--out {afile} is a file, not a folder" in capsys.readouterr().err
    assert main(bench(NO_MODEL, afile / "sub", "--methods", "plain")) == 2
    assert f"--out {afile / 'sub'} cannot be made" in capsys.readouterr().err
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("name", ["results.jsonl", "report.md"])
def test_a_folder_where_bench_writes_a_file_is_refused_before_any_model_loads(
    capsys, tmp_path: Path, name: str
) -> None:
    (tmp_path / name).mkdir()
    assert main(bench(NO_MODEL, tmp_path, "--methods", "plain")) == 2
    assert f"holds a folder named {name}, where the bench writes that file" in capsys.readouterr().err


SETTINGS = {"model": "m"}
RESULT = {"prompt_id": "p1", "method": "plain", "k": 0, "round": 0, "settings": SETTINGS, "tokens_per_s": 1.0}


def test_binary_bytes_in_results_jsonl_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_bytes((json.dumps(RESULT) + "\n").encode() + b"\xff\xfe\x00binary\n")
    with pytest.raises(ForerunError, match=r"results.jsonl, line 2: not UTF-8 text; remove the line"):
        ResultStore(path, SETTINGS)


def test_a_torn_binary_last_line_is_dropped_like_a_torn_text_one(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_bytes((json.dumps(RESULT) + "\n").encode() + b"\xff\xfe")
    assert len(ResultStore(path, SETTINGS).records) == 1
    assert path.read_text() == json.dumps(RESULT) + "\n"


@pytest.mark.parametrize(
    "line", ["{}", "[1, 2]", json.dumps({**RESULT, "k": "two"}), json.dumps({**RESULT, "settings": 3})]
)
def test_a_json_line_that_is_no_result_is_named_as_such(tmp_path: Path, line: str) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(RESULT) + "\n" + line + "\n")
    with pytest.raises(ForerunError, match=r"line 2: not a result line") as raised:
        ResultStore(path, SETTINGS)
    assert "other settings" not in str(raised.value)


# --- bench-serve ------------------------------------------------------------------------------


def serve_args(model: str, out: Path, *extra: str) -> list[str]:
    return ["bench-serve", "--model", model, "--max-tokens", "4", "--concurrency", "1", "--out", str(out), *extra]


@pytest.mark.parametrize("setups", ["", " , "])
def test_bench_serve_without_set_ups_names_the_known_ones(capsys, tmp_path: Path, setups: str) -> None:
    assert main(serve_args(NO_MODEL, tmp_path / "out", "--setups", setups)) == 2
    err = capsys.readouterr().err
    assert "no set-ups given" in err and "off, fixed, auto, off-whole, off-uncached" in err
    assert not (tmp_path / "out").exists()


def test_bench_serve_refuses_an_unknown_peer(capsys, tmp_path: Path) -> None:
    assert main(serve_args(NO_MODEL, tmp_path, "--setups", "off", "--peers", "nope")) == 2
    assert "unknown peer 'nope' in --peers; bench-serve's one peer is llama.cpp" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag,value,said",
    [
        ("--num-speculative-tokens", "0", "must be at least 1"),
        ("--quantization", "bogus", "invalid choice: 'bogus'"),
        ("--speculative-quantization", "bogus", "invalid choice: 'bogus'"),
        ("--requests-per-level", "0", "must be at least 1"),
    ],
)
def test_bench_serve_checks_its_numbers_and_formats_itself(
    capsys, tmp_path: Path, flag: str, value: str, said: str
) -> None:
    err = argparse_error(capsys, serve_args(NO_MODEL, tmp_path, "--setups", "off", flag, value))
    assert f"argument {flag}: {said}" in err


def test_bench_serve_out_that_is_a_file_is_a_clear_error(capsys, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert main(serve_args(NO_MODEL, afile, "--setups", "off")) == 2
    assert f"--out {afile} is a file, not a folder" in capsys.readouterr().err


@pytest.fixture
def fake_servers(monkeypatch) -> list[str]:
    """bench-serve with its servers never started: each level measures 10 tokens a second x the
    number of its run (1, 2, ...), so a test can tell which run a level came from."""
    from forerun.bench.serve_servers import Process
    from forerun.commands import bench_serve

    runs: list[str] = []
    monkeypatch.setattr(Process, "start", lambda self: runs.append(self.log.stem))
    monkeypatch.setattr(Process, "stop", lambda self: None)

    def level(server, model, sent, c, lengths) -> LevelResult:
        return LevelResult(server.setup, c, len(sent), 1.0, 10 * len(runs), 0.1, 0.1, 0.01, 0.01)

    monkeypatch.setattr(bench_serve, "_run_level", level)
    return runs


def serve_run(folders: dict[str, Path], out: Path, setups: str, *extra: str) -> int:
    args = serve_args(str(folders["target"]), out, "--setups", setups, "--dataset", str(folders["dataset"]))
    return main([*args, "--requests-per-level", "1", *extra])


def levels(out: Path) -> list[tuple[str, float]]:
    return [(r["setup"], r["tokens_per_s"]) for r in json.loads((out / "results.json").read_text())]


def test_bench_serve_run_again_into_a_folder_keeps_the_earlier_set_ups(
    folders: dict[str, Path], tmp_path: Path, fake_servers: list[str]
) -> None:
    assert serve_run(folders, tmp_path, "off") == 0
    assert serve_run(folders, tmp_path, "off-whole") == 0
    assert levels(tmp_path) == [("off", 10.0), ("off-whole", 20.0)]
    report = (tmp_path / "report.md").read_text()
    assert "| off | 1 |" in report and "| off-whole | 1 |" in report
    assert "The rows of off come from an earlier run into this folder" in report


def test_bench_serve_set_up_run_again_replaces_only_its_own_results(
    folders: dict[str, Path], tmp_path: Path, fake_servers: list[str]
) -> None:
    assert serve_run(folders, tmp_path, "off,off-whole") == 0
    assert serve_run(folders, tmp_path, "off-whole") == 0
    assert levels(tmp_path) == [("off", 20.0), ("off-whole", 30.0)]


def test_bench_serve_refuses_to_mix_results_made_with_other_settings(
    capsys, folders: dict[str, Path], tmp_path: Path, fake_servers: list[str]
) -> None:
    assert serve_run(folders, tmp_path, "off") == 0
    before = (tmp_path / "results.json").read_text()
    assert serve_run(folders, tmp_path, "off-whole", "--max-tokens", "5") == 2
    assert "holds off results made with other settings (max_tokens: 4 there, 5 now)" in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == before and fake_servers == ["off"]


def test_bench_serve_keeps_an_earlier_set_up_that_drafted_beside_ones_that_do_not(
    folders: dict[str, Path], tmp_path: Path, fake_servers: list[str]
) -> None:
    assert serve_run(folders, tmp_path, "fixed", "--speculative-model", str(folders["draft"])) == 0
    assert serve_run(folders, tmp_path, "off") == 0  # no draft model now: off's numbers owe nothing to one
    assert [setup for setup, _ in levels(tmp_path)] == ["fixed", "off"]


@pytest.mark.parametrize("text", ["{", "[{}]", "\udcff"])
def test_bench_serve_results_json_it_cannot_read_is_a_clear_error(
    capsys, folders: dict[str, Path], tmp_path: Path, fake_servers: list[str], text: str
) -> None:
    (tmp_path / "results.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    assert serve_run(folders, tmp_path, "off") == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'results.json'} is not" in err and "remove it to start over" in err
    assert fake_servers == []


def test_a_folder_where_bench_serve_writes_a_file_is_refused(
    capsys, folders: dict[str, Path], tmp_path: Path, fake_servers: list[str]
) -> None:
    (tmp_path / "report.md").mkdir()
    assert serve_run(folders, tmp_path, "off") == 2
    assert "holds a folder named report.md, where bench-serve writes that file" in capsys.readouterr().err


# --- quality ----------------------------------------------------------------------------------


def quality(folders: dict[str, Path], *formats: str) -> list[str]:
    model, dataset = str(folders["target"]), str(folders["dataset"])
    return ["quality", "--model", model, "--dtype", "float32", "--dataset", dataset, "--max-tokens", "3", "--json"] + [
        "--quantization",
        *formats,
    ]


def test_quality_compares_a_format_named_twice_once(capsys, folders: dict[str, Path]) -> None:
    assert main(quality(folders, "int8", "int8")) == 0
    table = json.loads(capsys.readouterr().out)
    assert list(table) == ["int8"] and table["int8"]["overall"]["positions"] == 3


@pytest.mark.parametrize("fmt", ["gguf", "q4_0"])
def test_quality_refuses_a_native_format_on_a_model_folder_before_the_reference_runs(
    capsys, monkeypatch, folders: dict[str, Path], fmt: str
) -> None:
    from forerun.commands import quality as command

    monkeypatch.setattr(command, "LLM", lambda *a, **k: pytest.fail("a model loaded before the formats were checked"))
    assert main(quality(folders, "w8a8", fmt)) == 2
    err = capsys.readouterr().err
    assert f"--quantization {fmt} computes a GGUF file's blocks" in err
    assert "compare int8 or w8a8 on it, or give a .gguf file" in err and "auto" not in err


# --- tune-skip --------------------------------------------------------------------------------


def tune(model: str, *extra: str) -> list[str]:
    return ["tune-skip", "--model", model, "--dtype", "float32", "--prompt", "hi", "--max-tokens", "2", *extra]


@pytest.mark.parametrize(
    "extra,said",
    [
        (("--layers", "5"), "--layers 5: an early-exit depth must be between 1 and the model's 2 layers"),
        (("--skip", "7"), "--skip 7: layer 7 is outside the model's layers 0..1"),
        (("--skip", "0,1"), "--skip 0,1 skips every layer of 2"),
    ],
)
def test_tune_skip_names_its_own_flags_for_layers_the_model_lacks(
    capsys, folders: dict[str, Path], extra: tuple[str, ...], said: str
) -> None:
    assert main(tune(str(folders["target"]), *extra)) == 2
    err = capsys.readouterr().err
    assert said in err and "--early-exit-layer" not in err and "--skip-layers" not in err


def test_tune_skip_refuses_a_skip_list_that_names_no_layer_before_the_model_loads(capsys) -> None:
    assert main(tune(NO_MODEL, "--skip", ",")) == 2
    assert "--skip ',' names no layer" in capsys.readouterr().err


def test_tune_skip_refuses_layer_zero(capsys) -> None:
    assert "argument --layers: must be at least 1, got 0" in argparse_error(capsys, tune(NO_MODEL, "--layers", "0"))


def test_tune_skip_says_a_prompts_file_that_is_a_folder_is_a_folder(capsys, tmp_path: Path) -> None:
    assert main(tune(NO_MODEL, "--prompts-file", str(tmp_path))) == 2
    assert f"--prompts-file {tmp_path} is a folder" in capsys.readouterr().err
