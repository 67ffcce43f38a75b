"""Bad input to profile, quality, tune-skip and models: a clear error, given before the work it
would waste, that names what was wrong and what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forerun.api import LLM
from forerun.base.errors import ForerunError
from forerun.cli import main
from forerun.commands import models as models_command
from forerun.commands.tune_skip import candidate_settings
from forerun.models.embedded import EMBEDDED
from forerun.models.fetch import embedded_model, model_file
from forerun.models.testing import save_hf_folder, tiny_model


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A FORERUN_HOME of the test's own: conftest's links the user's models folder, which the models
    tests write into."""
    home = tmp_path / "home"
    monkeypatch.setenv("FORERUN_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tiny_model(seed=0), tmp_path_factory.mktemp("qa") / "tiny")


def user_error(capsys: pytest.CaptureFixture, code: int) -> str:
    """stderr of a command that refused its input: exit code 2 and one `error:` line, no traceback."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


# --- models fetch -----------------------------------------------------------------------------


@pytest.fixture
def fetched(home: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names `forerun models fetch` asks to fetch (nothing is downloaded)."""
    calls: list[str] = []

    def fetch(name: str, force: bool = False) -> Path:
        calls.append(name)
        return model_file(embedded_model(name))

    monkeypatch.setattr(models_command, "fetch", fetch)
    return calls


def test_models_fetch_refuses_an_unknown_name_before_fetching_the_known_ones(capsys, fetched: list[str]) -> None:
    known = next(iter(EMBEDDED))
    err = user_error(capsys, main(["models", "fetch", known, "nope"]))
    assert fetched == []  # a typo in the last name costs no download of the first
    assert "unknown model name 'nope'" in err and "`forerun models list` shows them" in err
    assert "path to a .gguf file" not in err  # fetch takes embedded names only


def test_models_fetch_fetches_a_name_given_twice_once(capsys, fetched: list[str]) -> None:
    known = next(iter(EMBEDDED))
    assert main(["models", "fetch", known, known]) == 0
    assert fetched == [known]


def test_models_fetch_refuses_a_folder_where_the_model_file_goes_before_fetching(capsys, fetched: list[str]) -> None:
    model = next(iter(EMBEDDED.values()))
    model_file(model).mkdir(parents=True)
    err = user_error(capsys, main(["models", "fetch", model.name]))
    assert fetched == []
    assert f"{model_file(model)} is a folder" in err and "move it away" in err


# --- quality ----------------------------------------------------------------------------------


def quality(folder: Path, dataset: Path) -> list[str]:
    return ["quality", "--model", str(folder), "--dtype", "float32", "--quantization", "int8"] + [
        "--dataset",
        str(dataset),
        "--max-tokens",
        "2",
        "--json",
    ]


def test_quality_names_a_prompt_beyond_the_context_before_the_reference_writes_any(
    capsys, monkeypatch: pytest.MonkeyPatch, folder: Path, tmp_path: Path
) -> None:
    dataset = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "abc", "category": "short"}, {"prompt": "abcd " * 300, "category": "long"}]
    dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ran = "the reference wrote a continuation before every prompt was checked"
    monkeypatch.setattr(LLM, "generate", lambda *a, **k: pytest.fail(ran))
    err = user_error(capsys, main(quality(folder, dataset)))
    assert "--dataset prompt 2 (category long): prompt (" in err and "beyond the model's context of 1024" in err


def test_quality_names_a_prompt_that_encodes_to_nothing(capsys, folder: Path, tmp_path: Path) -> None:
    plain = save_hf_folder(tiny_model(seed=0), tmp_path / "plain")
    (plain / "chat_template.jinja").unlink()  # no template to wrap the prompt: "" encodes to no token
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"prompt": "abc"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    err = user_error(capsys, main(quality(plain, dataset)))
    assert "--dataset prompt 2 (category default): the prompt is empty" in err


# --- tune-skip --------------------------------------------------------------------------------


def test_tune_skip_says_a_one_layer_model_has_no_setting_to_try() -> None:
    with pytest.raises(ForerunError, match="this model has only 1: there is no setting to try") as refused:
        candidate_settings(1)
    assert "pass --layers or --skip" not in str(refused.value)  # neither could help a single layer


def test_tune_skip_names_a_prompt_beyond_the_context_before_measuring_any(
    capsys, monkeypatch: pytest.MonkeyPatch, folder: Path
) -> None:
    ran = "a prompt was measured before every prompt was checked"
    monkeypatch.setattr(LLM, "generate", lambda *a, **k: pytest.fail(ran))
    argv = ["tune-skip", "--model", str(folder), "--dtype", "float32", "--max-tokens", "2", "--layers", "1"]
    err = user_error(capsys, main([*argv, "--prompt", "hi", "abcd " * 300]))
    assert "prompt 2 of 2: prompt (" in err and "beyond the model's context of 1024" in err


def test_tune_skip_runs_a_prompt_that_fits_its_max_tokens_though_not_four(
    capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from forerun import api
    from forerun.policy.pass_costs import PassCosts

    # Pass costs as given: measuring them on a busy machine costs more than the rest of the test.
    monkeypatch.setattr(api, "cached_pass_costs", lambda model: PassCosts([1e-3 * (1 + r / 8) for r in range(16)]))
    small = save_hf_folder(tiny_model(seed=0, max_position=64), tmp_path / "small")
    argv = ["tune-skip", "--model", str(small), "--dtype", "float32", "--layers", "1", "--json"]
    code = main([*argv, "--max-tokens", "2", "--ignore-eos", "--prompt", "a" * 62])  # 62 tokens + 2: the context
    out, err = capsys.readouterr()
    assert code == 0, err
    assert [json.loads(line)["tokens"] for line in out.splitlines()] == [2, 2]
