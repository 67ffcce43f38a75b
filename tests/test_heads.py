"""Draft heads on tiny models: training on the target's own text, exact greedy and sampled output,
Medusa's tree from its choices, heads refused by other targets, resumed training, the command."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch

from forerun import drafters
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.cli import main
from forerun.drafters.medusa import check_choices, choices_tree
from forerun.engine.engine import Engine
from forerun.heads import (
    HeadConfig,
    build_head,
    float_weight,
    save_head,
    target_checksum,
)
from forerun.models.load import LoadedModel
from forerun.models.testing import save_hf_folder, tiny_model
from forerun.train.data import Manifest, make_shards, read_examples
from forerun.train.trainer import TrainConfig, Trainer
from forerun.verification.tree import DraftTree
from tests.test_drafters_common import (
    CONTROL_RUNS,
    RUNS,
    SAMPLING,
    exact_marginals,
    keep_every_draft_always,
    speculative_samples,
    total_variation,
)

PATTERN = [10, 11, 12, 13, 14, 15, 16]
SUCCESSOR = dict(zip(PATTERN, PATTERN[1:] + PATTERN[:1]))


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    """A tiny target that writes a repeating pattern: its LM head maps each pattern token's
    feature to the next one (a random model's own text is noise no head can learn from few steps)."""
    model = tiny_model(7, name="looper", num_layers=2)
    decoder = model.decoder
    with torch.no_grad():
        # Logits follow the current token: embedding row e_t, LM head row for t+1 aligned with e_t.
        emb = decoder.embed_tokens.weight
        emb.mul_(6.0)
        head = decoder.lm_head.weight
        head.zero_()
        # After the final norm the feature is about 8 x the unit embedding: the successor's logit
        # is about 4, so sampling at temperature 1 mostly, not always, follows the pattern.
        for a, b in SUCCESSOR.items():
            head[b] = emb[a] / emb[a].norm() * 0.5
        for layer in decoder.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    return model


def prompts_of(count: int, start: int = 0) -> list[list[int]]:
    """Short prompts that end inside the pattern, at varied phases, with a little noise before."""
    out = []
    for i in range(start, start + count):
        phase = i % len(PATTERN)
        out.append([40 + i % 7, 50 + i % 5] + (PATTERN * 2)[phase : phase + 4])
    return out


def test_the_target_writes_its_pattern(target) -> None:
    prompt = prompts_of(1)[0]
    out = Engine(target).generate(prompt, SamplingParams(max_tokens=14)).token_ids
    text = prompt[-1:] + out
    assert all(SUCCESSOR[a] == b for a, b in zip(text, text[1:])), out


def head_config(target: LoadedModel, method: str) -> HeadConfig:
    cfg = target.decoder.cfg
    return HeadConfig(
        method,
        target_checksum(target),
        target.name,
        cfg.hidden_size,
        cfg.vocab_size,
        cfg.vocab_size,
        num_heads=3 if method == "medusa" else 0,
        intermediate_size=64 if method == "eagle" else 0,
    )


def trained(target: LoadedModel, method: str, folder: Path, steps: int, lr: float) -> tuple[Path, Trainer]:
    """A head trained for `steps` optimizer steps on the target's answers, saved in folder/head."""
    data = folder / "data"
    if not (data / "manifest.json").exists():
        make_shards(target, prompts_of(24), data, max_tokens=24, shard_tokens=300, progress=False)
    config = head_config(target, method)
    torch.manual_seed(0)
    head = build_head(config, target)
    head.vocab.copy_(torch.arange(config.vocab_size))
    head.init_projection(float_weight(target.decoder.lm_head))
    trainer = Trainer(
        head,
        TrainConfig(method, epochs=50, lr=lr, batch_rows=64, checkpoint_every_s=1e9),
        data,
        folder / "run",
        target.decoder.embed_tokens if method == "eagle" else None,
    )
    trainer.run(progress=False, max_steps=steps)
    save_head(folder / "head", config, head)
    return folder / "head", trainer


@pytest.fixture(scope="module")
def medusa_head(target, tmp_path_factory) -> tuple[Path, Trainer]:
    return trained(target, "medusa", tmp_path_factory.mktemp("medusa"), steps=60, lr=3e-2)


@pytest.fixture(scope="module")
def eagle_head(target, tmp_path_factory) -> tuple[Path, Trainer]:
    return trained(target, "eagle", tmp_path_factory.mktemp("eagle"), steps=60, lr=1e-2)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_training_on_the_targets_answers_runs_in_bfloat16(target, tmp_path, method) -> None:
    data = tmp_path / "data"
    make_shards(target, prompts_of(6), data, max_tokens=12, shard_tokens=300, progress=False)
    losses = []
    for bf16 in (False, True):
        torch.manual_seed(0)
        head = build_head(head_config(target, method), target)
        head.vocab.copy_(torch.arange(target.decoder.cfg.vocab_size))
        config = TrainConfig(method, epochs=5, lr=1e-2, batch_rows=64, checkpoint_every_s=1e9, bf16=bf16)
        embed = target.decoder.embed_tokens if method == "eagle" else None
        trainer = Trainer(head, config, data, tmp_path / f"run-{bf16}", embed)
        losses.append(trainer.run(progress=False, max_steps=4).loss)
        assert all(p.dtype == torch.float32 for p in head.parameters())
    assert all(math.isfinite(loss) for loss in losses[1]) and losses[1] != losses[0]


# --- data ---------------------------------------------------------------------------------------


def test_shards_hold_the_targets_answers_and_features(target, tmp_path) -> None:
    prompts = prompts_of(5)
    manifest = make_shards(target, prompts, tmp_path, max_tokens=6, shard_tokens=25, progress=False)
    assert manifest.prompts_done == 5 and len(manifest.shards) >= 2  # more than one shard
    examples = list(read_examples(tmp_path))
    for prompt, example in zip(prompts, examples):
        answer = Engine(target).generate(prompt, SamplingParams(max_tokens=6)).token_ids
        assert example.tokens.tolist() == prompt + answer and example.answer == len(prompt)
        decoder = target.decoder
        out = decoder(
            example.tokens,
            torch.arange(len(example.tokens)),
            decoder.new_cache(len(example.tokens)),
            output_hidden=True,
        )
        assert torch.allclose(example.hidden, out.hidden[0], atol=0.05)  # stored in bfloat16
    # Resumable: a second call with more prompts answers only the new ones.
    more = make_shards(
        target, prompts + prompts_of(2, start=5), tmp_path, max_tokens=6, shard_tokens=25, progress=False
    )
    assert more.prompts_done == 7 and Manifest.read(tmp_path).shards[: len(manifest.shards)] == manifest.shards


# --- training -------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["medusa", "eagle"])
def test_training_on_a_repeating_text_drives_accuracy_and_acceptance_near_one(
    target, medusa_head, eagle_head, which
) -> None:
    folder, trainer = medusa_head if which == "medusa" else eagle_head
    last = trainer.history.accuracy[-5:]
    for head in range(len(last[0])):
        assert sum(a[head] for a in last) / len(last) > 0.9, trainer.history.accuracy[-1]
    assert trainer.history.loss[-1] < trainer.history.loss[0]
    drafter = drafters.create(which, target, {"head": str(folder)})
    prompt = prompts_of(1, start=30)[0]  # not among the training prompts
    params = SamplingParams(max_tokens=41)  # the first token, then ten steps of 3 drafts + 1
    out = Engine(target, drafter, 3).generate(prompt, params)
    assert out.token_ids == Engine(target).generate(prompt, params).token_ids
    # A tree drafts siblings that must lose; the acceptance that counts is per depth along the path.
    m = out.metrics
    assert m.num_drafts > 5 and min(m.accepted_per_position) / m.num_drafts > 0.9, m.to_dict()


# --- exactness ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_target() -> LoadedModel:
    """A random tiny model the heads were not trained on: their guesses are often wrong there,
    so greedy checks see both kept and rejected drafts."""
    return tiny_model(2, name="target4", num_layers=4)


def retargeted(folder: Path, target: LoadedModel, into: Path) -> Path:
    """The same head weights, registered for `target` (for exactness checks on another model)."""
    into.mkdir(parents=True, exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["target_checksum"] = target_checksum(target)
    (into / "config.json").write_text(json.dumps(config))
    (into / "head.safetensors").write_bytes((folder / "head.safetensors").read_bytes())
    return into


MEDUSA_SHAPES = [None, [[0]], [[0], [0, 0], [0, 0, 0]], [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]]]
EAGLE_SHAPES = [{}, {"nodes": 1, "branch": 1}, {"nodes": 6, "branch": 2}, {"nodes": 24, "branch": 4}]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(
    "which,options", [("medusa", {"choices": c}) for c in MEDUSA_SHAPES] + [("eagle", o) for o in EAGLE_SHAPES]
)
def test_greedy_output_equals_plain_for_every_tree_shape(
    target, medusa_head, eagle_head, tmp_path, which, options, k
) -> None:
    from tests.test_drafters_common import self_prompt

    other = tiny_model(2, name="target4", num_layers=4)
    trained = (medusa_head if which == "medusa" else eagle_head)[0]
    # On another model the head's drafts are rejected; on the pattern it learnt, kept.
    cases = [(other, retargeted(trained, other, tmp_path / "head"), [self_prompt(other, s, 30) for s in (1, 2)])]
    cases.append((target, trained, prompts_of(2, start=40)))
    kept, drafted = [], 0
    for model, folder, prompts in cases:
        for prompt in prompts:
            plain = Engine(model).generate(prompt, SamplingParams(max_tokens=30)).token_ids
            drafter = drafters.create(which, model, {"head": str(folder), **{n: v for n, v in options.items() if v}})
            out = Engine(model, drafter, k).generate(prompt, SamplingParams(max_tokens=30))
            assert out.token_ids == plain
            kept.append(out.metrics.num_accepted_tokens)
            drafted += out.metrics.num_draft_tokens
    assert 0 < sum(kept) < drafted  # paths were kept and drafts rejected: both sides of the rule ran


def test_greedy_output_equals_plain_on_the_pattern_too(target, medusa_head, eagle_head) -> None:
    cases = [("medusa", medusa_head), ("eagle", eagle_head), ("auto-head", eagle_head), ("auto-head", medusa_head)]
    for which, (folder, _) in cases:
        for prompt in prompts_of(3, start=40):
            plain = Engine(target).generate(prompt, SamplingParams(max_tokens=25)).token_ids
            out = Engine(target, drafters.create(which, target, {"head": str(folder)}), 4).generate(
                prompt, SamplingParams(max_tokens=25)
            )
            assert out.token_ids == plain


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_auto_head_drafts_from_the_suffix_on_long_matches_and_from_the_head_elsewhere(
    target, medusa_head, eagle_head, kind
) -> None:
    folder = (eagle_head if kind == "eagle" else medusa_head)[0]
    drafter = drafters.create("auto-head", target, {"head": str(folder), "long_match": 4})
    engine = Engine(target, drafter, 4)
    for prompt in prompts_of(3, start=40):
        plain = Engine(target).generate(prompt, SamplingParams(max_tokens=40)).token_ids
        assert engine.generate(prompt, SamplingParams(max_tokens=40)).token_ids == plain
    # The pattern repeats: long matches go to the suffix drafter, the start of each answer to the head.
    assert drafter.steps["suffix"] > 0 and drafter.steps[kind] > 0, drafter.steps
    with pytest.raises(ForerunError, match="needs --speculative-head"):
        drafters.create("auto-head", target, {})


@pytest.fixture(scope="module")
def sampling_case(target) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    prompt = prompts_of(1, start=50)[0]
    return (prompt, *exact_marginals(target, prompt, SAMPLING))


# The pattern is sharp; at temperature 1 with top-k 4 over this target the heads are right often
# but not always, so drafts are kept and rejected.
@pytest.mark.parametrize("which", ["medusa", "eagle", "auto-head"])
def test_sampled_tokens_follow_the_targets_distribution(target, medusa_head, eagle_head, sampling_case, which) -> None:
    prompt, second, third = sampling_case
    folder = (medusa_head if which == "medusa" else eagle_head)[0]
    samples, metrics = speculative_samples(
        target, drafters.create(which, target, {"head": str(folder)}), 2, prompt, RUNS
    )
    for position, exact in ((0, second), (1, third)):
        tv, tolerance = total_variation([s[position] for s in samples], exact)
        assert tv < tolerance, f"token {position + 2}: TV {tv:.4f} >= {tolerance:.4f}"
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens


@pytest.mark.parametrize("which", ["medusa", "eagle", "auto-head"])
def test_a_seeded_sample_is_plain_decodings_with_that_seed_whatever_a_head_drafts(
    target, medusa_head, eagle_head, which
) -> None:
    """Heads draw their drafts with the positions' uniforms: the text is plain decoding's, and a
    Medusa tree's siblings that drew one number are one node."""
    folder = (medusa_head if which == "medusa" else eagle_head)[0]
    drafter = drafters.create(which, target, {"head": str(folder)})
    trees = []
    propose = drafter.propose
    drafter.propose = lambda *args: trees.append(propose(*args)) or trees[-1]
    kept = 0
    for seed, prompt in enumerate(prompts_of(3, start=60)):
        params = SamplingParams(temperature=1.0, top_k=4, max_tokens=24, seed=seed)
        out = Engine(target, drafter, 4).generate(prompt, params)
        assert out.token_ids == Engine(target).generate(prompt, params).token_ids, seed
        kept += out.metrics.num_accepted_tokens
    assert kept > 0
    for tree in filter(None, trees):
        siblings = [(tree.parents[i], token) for i, token in enumerate(tree.tokens)]
        assert len(set(siblings)) == len(siblings)


@pytest.mark.parametrize("which", ["medusa", "eagle", "auto-head"])
def test_negative_control_an_always_accepting_rule_fails_with_heads(
    target, medusa_head, eagle_head, sampling_case, monkeypatch, which
) -> None:
    prompt, second, third = sampling_case
    folder = (medusa_head if which == "medusa" else eagle_head)[0]
    keep_every_draft_always(monkeypatch)
    samples, _ = speculative_samples(
        target, drafters.create(which, target, {"head": str(folder)}), 2, prompt, CONTROL_RUNS
    )
    failures = [total_variation([s[i] for s in samples], exact) for i, exact in ((0, second), (1, third))]
    assert any(tv >= tolerance for tv, tolerance in failures)


# --- Medusa's tree as data ------------------------------------------------------------------------


def test_the_tree_built_from_medusa_choices_matches_a_hand_built_mask() -> None:
    choices = check_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], num_heads=3)
    paths, parents = choices_tree(choices, depth=3)
    assert paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert parents == [-1, -1, 0, 0, 1, 2]
    mask = DraftTree(list(range(6)), parents).attention_mask(past=0)[1:, 1:]  # nodes x nodes
    # Row i sees itself and its ancestors: (0,0,0) sees (0,), (0,0) and itself.
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [0, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 0, 0, 1, 0, 0],
            [0, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, want)
    assert choices_tree(choices, depth=1) == ([(0,), (1,)], [-1, -1])  # the policy's K cuts depth


@pytest.mark.parametrize(
    "choices,message",
    [
        ([[0], [0, 0, 0]], "lacks its parent"),
        ([[0, 0, 0, 0]], "4 deep"),
        ([[-1]], "not a path"),
        ([], "empty"),
        ([[True]], "not True or False"),
        ([[0], [0, 50]], r"names rank 50, but the heads score 50 tokens"),
    ],
)
def test_malformed_medusa_choices_are_refused(choices, message) -> None:
    with pytest.raises(ForerunError, match=message):
        check_choices(choices, num_heads=3, ranks=50)
    assert check_choices([[0], [49]], num_heads=3, ranks=50) == [(0,), (49,)]


# --- heads belong to their target -----------------------------------------------------------------


def test_a_damaged_head_file_is_named_with_what_to_do(medusa_head, target, tmp_path) -> None:
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "config.json").write_bytes((medusa_head[0] / "config.json").read_bytes())
    (folder / "head.safetensors").write_bytes(b"garbage")
    with pytest.raises(ForerunError, match="head.safetensors is not a readable safetensors file.*train the head"):
        drafters.create("medusa", target, {"head": str(folder)})


@pytest.mark.parametrize("which", ["medusa", "eagle"])
def test_a_head_trained_for_another_target_is_refused(medusa_head, eagle_head, other_target, which) -> None:
    folder = (medusa_head if which == "medusa" else eagle_head)[0]
    with pytest.raises(ForerunError, match="trained on looper.*not on this target target4"):
        drafters.create(which, other_target, {"head": str(folder)})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nodes": 10**9}, "--eagle-nodes 1000000000 verifies more rows a step than the model's context of 1024"),
        ({"nodes": 1024}, "--eagle-nodes 1024 verifies more rows"),
        ({"nodes": 8, "branch": 9}, "--eagle-branch 9 is more than --eagle-nodes 8"),
        ({"branch": 10**5}, "--eagle-branch 100000 is more than --eagle-nodes 16"),
    ],
)
def test_an_eagle_tree_beyond_the_context_or_branches_beyond_its_nodes_are_refused(
    target, eagle_head, options, message
) -> None:
    with pytest.raises(ForerunError, match=re.escape(message)):
        drafters.create("eagle", target, {"head": str(eagle_head[0]), **options})
    drafters.create("eagle", target, {"head": str(eagle_head[0]), "nodes": 1023, "branch": 1023})  # the most


def test_a_head_of_the_other_kind_or_no_head_is_a_clear_error(target, medusa_head, tmp_path) -> None:
    with pytest.raises(ForerunError, match="holds a medusa head, not a eagle head"):
        drafters.create("eagle", target, {"head": str(medusa_head[0])})
    with pytest.raises(ForerunError, match="needs --speculative-head"):
        drafters.create("medusa", target, {})
    with pytest.raises(ForerunError, match="is not a draft head"):
        drafters.create("medusa", target, {"head": str(tmp_path)})


# --- resume ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_resume_continues_from_the_checkpoint_as_if_never_stopped(target, medusa_head, tmp_path, method) -> None:
    data = medusa_head[1].data  # the shards made for the medusa fixture

    def fresh(out: Path) -> Trainer:
        torch.manual_seed(0)
        head = build_head(head_config(target, method), target)
        head.vocab.copy_(torch.arange(target.decoder.cfg.vocab_size))
        return Trainer(
            head,
            TrainConfig(method, epochs=3, lr=1e-2, batch_rows=64, checkpoint_every_s=1e9),
            data,
            out,
            target.decoder.embed_tokens if method == "eagle" else None,
        )

    whole, second = whole_and_resumed(fresh, tmp_path)
    a, b = whole.head.state_dict(), second.head.state_dict()
    assert list(a) == list(b)  # the same tensors, then each one equal
    for name in a:
        assert torch.equal(a[name], b[name]), name


def whole_and_resumed(fresh, folder: Path) -> tuple[Trainer, Trainer]:
    """Two trainers from `fresh(out)`: one run 8 steps straight, one stopped after 4, checkpointed,
    and resumed to 8 under another random seed (the checkpoint's random state must win)."""
    whole = fresh(folder / "whole")
    torch.manual_seed(5)
    whole.run(progress=False, max_steps=8)
    first = fresh(folder / "parts")
    torch.manual_seed(5)
    first.run(progress=False, max_steps=4)
    first.save_checkpoint()
    torch.manual_seed(123)
    second = fresh(folder / "parts")
    second.run(resume=True, progress=False, max_steps=8)
    assert second.progress.step == 8 and second.history.steps == list(range(1, 9))
    return whole, second


# --- the command ----------------------------------------------------------------------------------


def test_training_prompts_take_each_category_in_turn() -> None:
    from forerun.base.prompts import Prompt
    from forerun.commands.train import round_robin

    prompts = [Prompt(f"{c}{i}", c, c, f"{c} {i}") for c, n in (("a", 3), ("b", 1), ("c", 2)) for i in range(n)]
    assert [p.prompt_id for p in round_robin(prompts)] == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert round_robin([]) == []


def test_train_command_makes_a_head_that_generate_uses(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    folder = save_hf_folder(copy.deepcopy(tiny_model(seed=0)), tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"abc{i} abc{i} abc"}) + "\n" for i in range(6)))
    out = tmp_path / "head"
    args = [
        "train",
        "--method",
        "medusa",
        "--model",
        str(folder),
        "--dtype",
        "float32",
        "--quantization",
        "w8a8",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--epochs",
        "1",
        "--max-tokens",
        "12",
        "--heads",
        "2",
        "--draft-vocab",
        "64",
        "--no-progress",
    ]
    assert main(args) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["method"] == "medusa" and config["draft_vocab"] == 64
    # The first two prompts (--eval-prompts 2, one category) are answered for measuring only.
    assert config["training"]["sequences"] == 4 and config["training"]["eval_prompt_ids"] == ["1", "2"]
    assert config["training"]["prompt_ids"] == ["3", "4", "5", "6"]  # record numbers, from 1
    assert len(config["training"]["held_out_kept_per_depth"]) == 2  # one per medusa head
    assert (out / "head.safetensors").is_file() and (out / "curves.png").is_file()
    assert main(args) == 2  # a checkpoint is there: --resume or another --out
    assert main(args + ["--resume"]) == 0
    # An EAGLE head of the same target reads the same shards: no prompt is answered again.
    shards = sorted((out / "data").iterdir())
    eagle = [
        "train",
        "--method",
        "eagle",
        "--model",
        str(folder),
        "--dtype",
        "float32",
        "--quantization",
        "w8a8",
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "eagle"),
        "--data",
        str(out / "data"),
        "--epochs",
        "1",
        "--max-tokens",
        "12",
        "--draft-vocab",
        "64",
        "--intermediate-size",
        "32",
        "--no-progress",
    ]
    assert main(eagle) == 0
    assert sorted((out / "data").iterdir()) == shards and not (tmp_path / "eagle" / "data").exists()
    eagle_config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert eagle_config["intermediate_size"] == 32
    assert eagle_config["training"]["unroll"] == 3 and eagle_config["training"]["projection"] == "frozen"
    assert len(eagle_config["training"]["held_out_kept_per_depth"]) == 5  # the chain's depths
    common = [
        "generate",
        "--model",
        str(folder),
        "--dtype",
        "float32",
        "--prompt",
        "abc1 abc1",
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--json",
    ]
    import contextlib
    import io

    def record(extra: list[str]) -> dict:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert main(common + extra) == 0
        return json.loads(buffer.getvalue())

    plain = record([])
    spec = record(
        [
            "--speculative-method",
            "medusa",
            "--speculative-head",
            str(out),
            "--num-speculative-tokens",
            "2",
            "--medusa-choices",
            "[[0], [1], [0, 0]]",
        ]
    )
    assert spec["token_ids"] == plain["token_ids"] and spec["spec"]["num_draft_tokens"] > 0
    # bench takes one head of each kind and runs both beside plain.
    bench = [
        "bench",
        "--model",
        str(folder),
        "--dtype",
        "float32",
        "--dataset",
        str(prompts),
        "--limit-per-category",
        "2",
        "--max-tokens",
        "8",
        "--no-warmup",
        "--no-progress",
        "--out",
        str(tmp_path / "bench"),
        "--methods",
        "medusa,eagle,auto-head",
        "--speculative-head",
        f"{out},{tmp_path / 'eagle'}",
    ]
    assert main(bench) == 0
    records = [json.loads(line) for line in (tmp_path / "bench" / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"plain", "medusa", "eagle", "auto-head"}  # auto-head: the EAGLE head
    assert all(r["identical_to_plain"] for r in records)
    assert main(bench[:-1] + [f"{out},{out}"]) == 2  # two medusa heads: which one?
    assert main(bench[:-2]) == 2  # heads named, none given
    # With no --methods, bench runs every method a head was given for.
    only_eagle = bench[:-4] + ["--speculative-head", str(tmp_path / "eagle"), "--out", str(tmp_path / "bench2")]
    assert main(only_eagle) == 0
    methods = {json.loads(line)["method"] for line in (tmp_path / "bench2" / "results.jsonl").read_text().splitlines()}
    assert {"eagle", "auto-head"} <= methods and "medusa" not in methods


@pytest.mark.parametrize("which", ["medusa", "eagle"])
def test_drafters_of_one_target_share_one_copy_of_a_head(target, medusa_head, eagle_head, which) -> None:
    folder = str((medusa_head if which == "medusa" else eagle_head)[0])
    first, second = (drafters.create(which, target, {"head": folder}) for _ in range(2))
    module = "heads" if which == "medusa" else "head"
    assert getattr(first, module) is getattr(second, module)  # a server's lanes hold one head between them


@pytest.mark.skipif(not __import__("forerun").native.available(), reason="native kernels unavailable")
def test_heads_on_a_gguf_target_run_on_its_kernels_and_equal_plain(
    target, medusa_head, eagle_head, tmp_path, monkeypatch
) -> None:
    from forerun.heads import shared_head
    from forerun.models.gguf_format import GGUFLinear
    from forerun.models.load import load_model
    from tests.test_load import write_gguf

    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    blocks = load_model(
        str(write_gguf(target, tmp_path / "looper.gguf", quant="Q8_0")), with_tokenizer=False, quantization="gguf"
    )
    for which, (folder, _) in (("medusa", medusa_head), ("eagle", eagle_head)):
        head_folder = retargeted(folder, blocks, tmp_path / which)
        _, head = shared_head(head_folder, blocks, which)
        assert any(isinstance(m, GGUFLinear) for m in head.modules())  # the model's kernels, Q8_0
        with monkeypatch.context() as patch:
            # Drafting looks embedding rows up; the whole table dequantized (`weight`) costs a
            # second a request on a real vocabulary and is never needed.
            patch.setattr(type(blocks.decoder.embed_tokens), "weight", property(_no_whole_table))
            for prompt in prompts_of(3, start=40):
                plain = Engine(blocks).generate(prompt, SamplingParams(max_tokens=25)).token_ids
                out = Engine(blocks, drafters.create(which, blocks, {"head": str(head_folder)}), 4).generate(
                    prompt, SamplingParams(max_tokens=25)
                )
                assert out.token_ids == plain
                assert out.metrics.num_draft_tokens > 0


def _no_whole_table(embedding) -> torch.Tensor:
    raise AssertionError("the whole embedding table was dequantized while drafting")
