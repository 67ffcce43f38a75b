"""The CUDA path, where a GPU is there (skipped elsewhere: CI has none).

The checks every drafter passes on the CPU, with the models on the GPU:
- a forward there gives the CPU's logits (float32, within rounding);
- greedy speculation is the plain target's output token for token, for every drafter: the rules,
  a draft model, and Medusa and EAGLE heads trained there by `forerun train --device cuda`;
- sampled tokens follow the target's exact distribution, and the always-accepting negative control
  fails the same check;
- the heads trained there load on the CPU and keep its greedy output too;
- the Python API takes device="cuda".

FORERUN_CUDA_TESTS_ON=cpu runs the same module on the CPU (to check the checks, without a GPU).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import perturbed
from test_drafters_common import (
    CONTROL_RUNS,
    RUNS,
    SAMPLING,
    exact_marginals,
    keep_every_draft_always,
    self_prompt,
    speculative_samples,
    total_variation,
)

from forerun import drafters
from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.cli import main
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.engine.engine import Engine
from forerun.models.load import LoadedModel, load_model
from forerun.models.testing import save_hf_folder, tiny_model

DEVICE = torch.device(os.environ.get("FORERUN_CUDA_TESTS_ON", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="no CUDA GPU on this machine"
)

GREEDY = SamplingParams(max_tokens=32)
TEXT = "def run(x):\n    return x + 1\n\n"  # the heads' corpus, repeated


def moved(model: LoadedModel) -> LoadedModel:
    return LoadedModel(model.name, copy.deepcopy(model.decoder).to(DEVICE), model.tokenizer, model.source)


@pytest.fixture(scope="module")
def target4() -> LoadedModel:
    return moved(tiny_model(2, name="target4", num_layers=4))


@pytest.fixture(scope="module")
def target2() -> LoadedModel:
    return moved(tiny_model(0, name="target2", num_layers=2))


def test_a_forward_there_gives_the_cpus_logits() -> None:
    cpu = tiny_model(2, name="target4", num_layers=4)
    there = moved(cpu)
    prompt = list(range(5, 45))
    logits = []
    for model in (cpu, there):
        decoder = model.decoder
        logits.append(decoder.forward_ids(prompt, decoder.new_cache(len(prompt))).logits.cpu())
    assert there.decoder.device.type == DEVICE.type
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def greedy_case(target4: LoadedModel) -> tuple[list[int], list[int]]:
    prompt = self_prompt(target4, 2, 30)
    return prompt, Engine(target4).generate(prompt, GREEDY).token_ids


RULES = [("ngram", {}), ("suffix", {}), ("early-exit", {"layer": 3}), ("lookahead", {})]


@pytest.mark.parametrize("setting", RULES, ids=lambda s: s[0])
def test_greedy_speculation_there_is_the_plain_output(target4, greedy_case, setting) -> None:
    prompt, plain = greedy_case
    out = Engine(target4, drafters.create(setting[0], target4, setting[1]), 3).generate(prompt, GREEDY)
    assert out.token_ids == plain
    assert 0 < out.metrics.num_accepted_tokens < out.metrics.num_draft_tokens


def test_greedy_speculation_with_a_draft_model_there_is_the_plain_output(target4, greedy_case) -> None:
    prompt, plain = greedy_case
    draft = moved(perturbed(tiny_model(2, name="target4", num_layers=4), 0.1))
    out = Engine(target4, DraftModelDrafter(target4, draft), 4).generate(prompt, GREEDY)
    assert out.token_ids == plain
    assert 0 < out.metrics.num_accepted_tokens < out.metrics.num_draft_tokens


@pytest.mark.parametrize("setting", [("ngram", {}), ("early-exit", {"layer": 1})], ids=lambda s: s[0])
def test_sampled_tokens_there_follow_the_targets_distribution(target2, setting) -> None:
    prompt = self_prompt(target2, 1, 120)
    exact = [p.cpu() for p in exact_marginals(target2, prompt, SAMPLING)]
    samples, metrics = speculative_samples(target2, drafters.create(setting[0], target2, setting[1]), 2, prompt, RUNS)
    for position, p in enumerate(exact):
        tv, tolerance = total_variation([s[position] for s in samples], p)
        assert tv < tolerance, f"token {position + 2}: TV {tv:.4f} >= {tolerance:.4f}"
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens


def test_negative_control_there_an_always_accepting_rule_fails_the_same_check(target2, monkeypatch) -> None:
    prompt = self_prompt(target2, 1, 120)
    exact = [p.cpu() for p in exact_marginals(target2, prompt, SAMPLING)]
    keep_every_draft_always(monkeypatch)
    samples, _ = speculative_samples(target2, drafters.create("ngram", target2, {}), 2, prompt, CONTROL_RUNS)
    failures = [total_variation([s[i] for s in samples], p) for i, p in enumerate(exact)]
    assert any(tv >= tolerance for tv, tolerance in failures)


# --- heads trained there ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_hf_folder(copy.deepcopy(tiny_model(seed=0)), tmp_path_factory.mktemp("tiny"))


def train_there(folder: Path, method: str, out: Path) -> dict:
    corpus = out.parent / f"corpus-{method}.py"
    corpus.write_text(TEXT * 40)
    extra = ["--heads", "2", "--lr", "3e-2"] if method == "medusa" else ["--intermediate-size", "64", "--lr", "1e-2"]
    argv = ["train", "--method", method, "--model", str(folder), "--dtype", "float32", "--device", str(DEVICE)]
    argv += ["--corpus", str(corpus), "--out", str(out), "--epochs", "40", "--draft-vocab", "64"]
    argv += ["--chunk-tokens", "48", "--top-k", "5", "--no-progress", *extra]
    loaded = []

    def load_and_record(*args, **kwargs) -> LoadedModel:
        loaded.append(load_model(*args, **kwargs))
        return loaded[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("forerun.models.load.load_model", load_and_record)
        assert main(argv) == 0
    assert [m.decoder.device.type for m in loaded] == [DEVICE.type]  # the target labels there too
    return json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def heads(folder, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("heads")
    return {method: (root / method, train_there(folder, method, root / method)) for method in ("medusa", "eagle")}


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_a_head_trained_there_learns_the_corpus(heads, method) -> None:
    _, config = heads[method]
    assert config["training"]["device"] == str(DEVICE)
    # A head that learned nothing agrees on 1 in 64 (the draft vocabulary); this one mostly predicts the text.
    assert config["training"]["final_top1_per_head"][0] > 0.5


@pytest.mark.parametrize("device", [str(DEVICE), "cpu"])
@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_a_head_trained_there_keeps_greedy_output_there_and_on_the_cpu(folder, heads, method, device) -> None:
    target = load_model(str(folder), "float32", device=device)
    prompt = target.tokenizer.encode(TEXT * 2)
    plain = Engine(target).generate(prompt, GREEDY).token_ids
    out = Engine(target, drafters.create(method, target, {"head": str(heads[method][0])}), 3).generate(prompt, GREEDY)
    assert out.token_ids == plain
    assert out.metrics.num_draft_tokens > 0


def test_the_api_runs_there(folder) -> None:
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=16)
    plain = LLM(model=str(folder), dtype="float32", device=str(DEVICE)).generate([prompt], params)[0]
    spec = LLM(model=str(folder), dtype="float32", device=str(DEVICE), speculative_method="suffix")
    out = spec.generate([prompt], params)[0]
    assert out.token_ids == plain.token_ids and len(plain.token_ids) == 16
