"""Self-speculation: the draft is the target's first L layers (or all but a skip set) reading the
target's own KV cache; full depth accepts every draft; the cache comes back as it was; bad
settings get clear errors; `forerun tune-skip` reports every setting it tries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forerun import drafters
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.cli import main
from forerun.commands.tune_skip import candidate_settings
from forerun.drafters.early_exit import draft_layers
from forerun.engine.engine import Engine
from forerun.models.load import LoadedModel
from forerun.models.testing import save_hf_folder, tiny_model

PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6]


@pytest.fixture(scope="module")
def target4() -> LoadedModel:
    return tiny_model(2, name="target4", num_layers=4)


def prefilled(target: LoadedModel, context: list[int]):
    """A target cache holding context[:-1], as the engine leaves it before a step."""
    decoder = target.decoder
    cache = decoder.new_cache(64)
    decoder(torch.tensor(context[:-1]), torch.arange(len(context) - 1), cache)
    return cache


def test_the_layers_the_draft_runs() -> None:
    assert draft_layers(4) == [0, 1, 2]  # default: the first three quarters
    assert draft_layers(5) == [0, 1, 2]
    assert draft_layers(28) == list(range(21))
    assert draft_layers(1) == [0]
    assert draft_layers(4, layer=3) == [0, 1, 2]
    assert draft_layers(6, skip_layers=[1, 3, 4]) == [0, 2, 5]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_full_depth_accepts_every_draft(target4, temperature) -> None:
    drafter = drafters.create("early-exit", target4, {"layer": 4})
    params = SamplingParams(temperature=temperature, max_tokens=31, seed=0)
    out = Engine(target4, drafter, 5).generate(PROMPT, params)
    m = out.metrics
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens
    assert m.acceptance_rate == 1.0 and m.mean_accepted_length > 5  # 6 tokens per pass after prefill
    if temperature == 0:
        assert out.token_ids == Engine(target4).generate(PROMPT, params).token_ids


@pytest.mark.parametrize("layers", [1, 2, 4])
def test_a_prefix_draft_reading_the_target_cache_is_the_truncated_model(target4, layers) -> None:
    """Greedy drafts equal those of the first `layers` layers run from scratch over the whole text."""
    decoder = target4.decoder
    context = PROMPT + [12, 13]
    drafter = drafters.create("early-exit", target4, {"layer": layers})
    drafter.start(PROMPT, prefilled(target4, context), 64)
    tree = drafter.propose(context, 4, SamplingParams(), None)
    expected, text = [], list(context)
    for _ in range(4):
        logits = decoder(
            torch.tensor(text),
            torch.arange(len(text)),
            decoder.new_cache(len(text)),
            last_only=True,
            layers=range(layers),
        ).logits[0, -1]
        expected.append(int(logits.argmax()))
        text.append(expected[-1])
    assert tree.tokens == expected and tree.probs is None


@pytest.mark.parametrize("options", [{"layer": 2}, {"skip_layers": [1, 2]}])
def test_proposing_leaves_the_target_cache_as_it_found_it(target4, options) -> None:
    context = PROMPT + [12, 13]
    cache = prefilled(target4, context)
    length, k, v = cache.length, cache.k[:, :, :, : cache.length].clone(), cache.v[:, :, :, : cache.length].clone()
    drafter = drafters.create("early-exit", target4, options)
    drafter.start(PROMPT, cache, 64)
    tree = drafter.propose(context, 5, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert len(tree) == 5 and cache.length == length
    assert torch.equal(cache.k[:, :, :, :length], k) and torch.equal(cache.v[:, :, :, :length], v)


def test_sampled_drafts_carry_the_distribution_they_were_drawn_from(target4) -> None:
    context = PROMPT + [12]
    drafter = drafters.create("early-exit", target4, {"layer": 1})
    drafter.start(PROMPT, prefilled(target4, context), 64)
    tree = drafter.propose(context, 3, SamplingParams(temperature=1.0, top_k=5), torch.Generator().manual_seed(1))
    assert tree.probs.shape == (3, target4.decoder.cfg.vocab_size)
    assert torch.allclose(tree.probs.sum(-1), torch.ones(3))
    assert all((row > 0).sum() == 5 for row in tree.probs)  # top-k applies to the draft too
    assert all(float(tree.probs[i, t]) > 0 for i, t in enumerate(tree.tokens))


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"layer": 0}, "--early-exit-layer"),
        ({"layer": 5}, "--early-exit-layer"),
        ({"layer": 2, "skip_layers": [1]}, "not both"),
        ({"skip_layers": [4]}, "--skip-layers"),
        ({"skip_layers": [0, 1, 2, 3]}, "every layer"),
    ],
)
def test_bad_settings_get_a_clear_error(target4, options, needle) -> None:
    with pytest.raises(ForerunError, match=needle):
        drafters.create("early-exit", target4, options)


# --- forerun tune-skip -----------------------------------------------------------------------------


def test_default_candidates_keep_the_first_and_last_layers() -> None:
    settings = candidate_settings(28)
    layers = [s.options["layer"] for s in settings if "layer" in s.options]
    skips = [s.options["skip_layers"] for s in settings if "skip_layers" in s.options]
    assert layers == [7, 14, 21]
    assert skips and all(0 not in s and 27 not in s for s in skips)
    assert len({tuple(s) for s in skips}) == len(skips)


def test_given_candidates_are_checked_against_the_model() -> None:
    assert [s.flags for s in candidate_settings(4, [2], [[1, 2]])] == ["--early-exit-layer 2", "--skip-layers 1 2"]
    with pytest.raises(ForerunError, match="--early-exit-layer"):
        candidate_settings(4, [9], None)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tiny_model(seed=2, num_layers=4), tmp_path_factory.mktemp("tune") / "tiny")


def test_tune_skip_reports_plain_decoding_and_every_setting(capsys, folder) -> None:
    code = main(
        [
            "tune-skip",
            "--model",
            str(folder),
            "--dtype",
            "float32",
            "--prompt",
            "abcab",
            "hello",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--layers",
            "2",
            "4",
            "--skip",
            "1,2",
            "--json",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["flags"] for r in rows] == ["", "--early-exit-layer 2", "--early-exit-layer 4", "--skip-layers 1 2"]
    assert all(r["tokens"] == 16 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["spec"] is None and rows[0]["speedup"] == 1.0
    full = rows[2]["spec"]
    assert full["acceptance_rate"] == 1.0  # all four layers: the target itself


def test_tune_skip_table_names_the_fastest_setting_or_says_none_pays(capsys, folder) -> None:
    code = main(
        [
            "tune-skip",
            "--model",
            str(folder),
            "--dtype",
            "float32",
            "--prompt",
            "abcab",
            "--max-tokens",
            "6",
            "--layers",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "plain decoding" in out and "first 3 of 4 layers" in out
    assert "fastest: --speculative-method early-exit --early-exit-layer 3" in out or "no setting beat" in out


def test_tune_skip_bad_skip_list_exits_2(capsys, folder) -> None:
    assert main(["tune-skip", "--model", str(folder), "--dtype", "float32", "--skip", "1,x"]) == 2
    assert "--skip '1,x'" in capsys.readouterr().err
