"""`forerun train` and its stored data against careless input: data made from another model, other
prompts or other text is never mixed in; damaged shards, manifests and checkpoints are named; flags
out of range are refused before the model loads."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from forerun.base import paths
from forerun.base.errors import ForerunError
from forerun.cli import main
from forerun.heads import build_head, read_config
from forerun.models.fetch import _last_lines
from forerun.models.testing import save_hf_folder, tiny_model
from forerun.train.data import Manifest, make_shards, read_examples
from forerun.train.soft_labels import LabelManifest, check_stored, make_label_shards
from forerun.train.trainer import TrainConfig, Trainer
from tests.test_heads import head_config, prompts_of
from tests.test_heads import target as target  # noqa: F401 (the module's fixture)


def shards(target, folder: Path, prompts: list[list[int]], max_tokens: int = 4) -> Manifest:
    return make_shards(target, prompts, folder, max_tokens=max_tokens, shard_tokens=30, progress=False)


# --- the target's answers --------------------------------------------------------------------------


def test_answers_of_another_model_length_or_prompts_are_refused_and_the_same_ones_resume(target, tmp_path) -> None:
    shards(target, tmp_path, prompts_of(3))
    with pytest.raises(ForerunError, match="another model's answers"):
        shards(tiny_model(8, name="other", num_layers=1), tmp_path, prompts_of(3))
    with pytest.raises(ForerunError, match="answers of up to 4 tokens, not --max-tokens 5"):
        shards(target, tmp_path, prompts_of(3), max_tokens=5)
    with pytest.raises(ForerunError, match="answers to other prompts than these"):
        shards(target, tmp_path, prompts_of(3, start=1))
    with pytest.raises(ForerunError, match="answers to 3 prompts, more than the 2 given"):
        shards(target, tmp_path, prompts_of(2))
    assert shards(target, tmp_path, prompts_of(5)).prompts_done == 5  # the same three, then two more


def test_a_damaged_manifest_or_shard_of_answers_is_named(target, tmp_path) -> None:
    manifest = shards(target, tmp_path, prompts_of(2))
    shard = tmp_path / manifest.shards[0]
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(ForerunError, match=f"{shard.name} is not a readable safetensors file"):
        list(read_examples(tmp_path))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ForerunError, match="manifest.json is not a manifest of answers"):
        Manifest.read(tmp_path)


# --- labelled text ----------------------------------------------------------------------------------


def test_labels_of_other_text_are_refused_and_the_same_text_resumes(target, tmp_path) -> None:
    text = [[10 + i % 7 for i in range(n, n + 12)] for n in range(6)]
    make_label_shards(target, text[:4], tmp_path, top_k=4, shard_tokens=30, progress=False)
    with pytest.raises(ForerunError, match="labels of other text than this run's \\(its chunk 2 differs\\)"):
        make_label_shards(target, [text[0], text[5], *text[2:]], tmp_path, top_k=4, progress=False)
    with pytest.raises(ForerunError, match="its chunk 4 differs"):  # the text ran out before the labels
        make_label_shards(target, text[:3], tmp_path, top_k=4, progress=False)
    assert make_label_shards(target, text, tmp_path, top_k=4, progress=False).chunks_done == 6


def test_labelled_answers_must_begin_with_this_runs_prompts(target, tmp_path) -> None:
    prompts = prompts_of(3)
    answers = [p + [10, 11, 12] for p in prompts]
    manifest = make_label_shards(target, answers, tmp_path, top_k=4, progress=False)
    check_stored(tmp_path, manifest, prompts, "answers to other prompts", prefix=True)  # no error
    with pytest.raises(ForerunError, match="labels of answers to other prompts than this run's \\(its chunk 3"):
        check_stored(tmp_path, manifest, [*prompts[:2], prompts_of(1, start=9)[0]], "answers to other prompts", True)
    assert LabelManifest.read(tmp_path).chunks_done == 3


# --- checkpoints ------------------------------------------------------------------------------------


def trainer(target, data: Path, out: Path, heads: int) -> Trainer:
    config = head_config(target, "medusa")
    config.num_heads = heads
    head = build_head(config, target)
    head.vocab.copy_(torch.arange(config.vocab_size))
    return Trainer(head, TrainConfig("medusa", epochs=1, lr=1e-3, checkpoint_every_s=1e9), data, out)


def test_a_checkpoint_of_another_head_or_a_damaged_one_is_named(target, tmp_path, capsys) -> None:
    shards(target, tmp_path / "data", prompts_of(3))
    first = trainer(target, tmp_path / "data", tmp_path / "run", heads=2)
    first.run(resume=True, progress=False, max_steps=1)
    assert "no checkpoint in" in capsys.readouterr().err  # --resume with nothing to resume says so
    first.save_checkpoint()
    with pytest.raises(ForerunError, match="another head or other settings .*--heads"):
        trainer(target, tmp_path / "data", tmp_path / "run", heads=3).run(resume=True, progress=False)
    state = tmp_path / "run" / "checkpoint" / "state.json"
    state.write_text("garbage")
    with pytest.raises(ForerunError, match="state.json cannot be read"):
        trainer(target, tmp_path / "data", tmp_path / "run", heads=2).run(resume=True, progress=False)
    weights = tmp_path / "run" / "checkpoint" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ForerunError, match="weights.safetensors is not a readable safetensors file"):
        trainer(target, tmp_path / "data", tmp_path / "run", heads=2).run(resume=True, progress=False)


# --- the command's flags -----------------------------------------------------------------------------


def train(tmp_path: Path, *flags: str) -> list[str]:
    return ["train", "--method", "eagle", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "h"), *flags]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "inf"], "--lr must be a positive number, got inf"),
        (["--lr", "nan"], "--lr must be a positive number, got nan"),
        (["--intermediate-size", "0"], "--intermediate-size must be at least 1, got 0"),
        (["--train-minutes", "nan"], "--train-minutes must be a positive number of minutes"),
        (["--budget-minutes", "inf"], "--budget-minutes must be a positive number of minutes"),
        (["--checkpoint-minutes", "-1"], "--checkpoint-minutes must be 0 or more minutes, got -1"),
        (["--method", "medusa", "--heads", "100000"], "--heads is how many future positions a medusa head guesses"),
        (["--seed", str(2**64)], f"--seed must be a whole number in [-2**63, 2**64), got {2**64}"),
        (["--seed", str(-(2**63) - 1)], "--seed must be a whole number in [-2**63, 2**64)"),
        (["--prompts", "missing.jsonl"], "dataset 'missing.jsonl' is neither 'spec-bench' nor an existing JSONL"),
    ],
)
def test_train_flags_out_of_range_are_refused_before_the_model_loads(tmp_path, capsys, flags, message) -> None:
    # The model does not exist: the error seen is the flag's, so it came before any load.
    assert main(train(tmp_path, *flags)) == 2
    assert message in capsys.readouterr().err


def test_an_out_or_data_folder_that_is_a_file_is_named(tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    assert main(["train", "--method", "eagle", "--model", "m", "--out", str(tmp_path / "file")]) == 2
    assert f"--out {tmp_path / 'file'} is a file, not a folder" in capsys.readouterr().err
    assert main(train(tmp_path, "--data", str(tmp_path / "file"))) == 2
    assert f"--data {tmp_path / 'file'} is a file, not a folder" in capsys.readouterr().err


def test_prompts_all_held_out_for_measuring_name_eval_prompts_before_any_answer(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    folder = save_hf_folder(copy.deepcopy(tiny_model(seed=0)), tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"abc{i}"}) + "\n" for i in range(2)))
    argv = ["train", "--method", "medusa", "--model", str(folder), "--dtype", "float32", "--prompts", str(prompts)]
    assert main([*argv, "--out", str(tmp_path / "h"), "--draft-vocab", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "of 2 prompts, 2 are held out for measuring (--eval-prompts 2 per category)" in err
    assert not (tmp_path / "h" / "held-out.safetensors").exists()  # refused before answering them


# --- elsewhere ---------------------------------------------------------------------------------------


def test_a_model_folder_given_as_a_head_is_named(tmp_path) -> None:
    folder = save_hf_folder(copy.deepcopy(tiny_model(seed=0)), tmp_path / "tiny")
    with pytest.raises(ForerunError, match="is a model folder, not a draft head"):
        read_config(folder)


def test_a_forerun_home_that_is_a_file_is_named(tmp_path, monkeypatch) -> None:
    (tmp_path / "home").write_text("x")
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    with pytest.raises(ForerunError, match="FORERUN_HOME .*home is a file, not a folder"):
        paths.models_dir()


def test_a_failed_download_shows_pips_error_lines_whole() -> None:
    stderr = "WARNING: Location 'x' is ignored\nERROR: Could not find a version that satisfies\nERROR: No match\n"
    assert _last_lines(stderr) == "ERROR: Could not find a version that satisfies\nERROR: No match"
    assert _last_lines("a\n\nb\n") == "a\nb" and _last_lines("") == "(nothing on stderr)"
