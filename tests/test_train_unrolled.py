"""Training for the test a head faces: EAGLE unrolled on its own features, measured per depth on
held-out answers while it trains, on corpus labels mixed with the target's labelled answers.

- `forward_unrolled` computes, for every position at once, what the drafter computes step by step
  against its cache (the true rows, then the chain's own rows);
- the held-out measure (`chain_acceptance`) equals chains drafted one by one and compared with the
  target's greedy tokens;
- an unrolled head keeps deep chains on held-out text; the trainer logs the measure at the start,
  at checkpoints and at the end, and stops at its time budget;
- label folders mix in proportion, chunk by chunk; `forerun train --answers` labels the target's answers, resumes
  without answering a prompt twice, and refuses flags that do not apply.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from forerun.base.errors import ForerunError
from forerun.cli import main
from forerun.heads import build_head, float_weight, save_head
from forerun.heads.eagle import EagleHead
from forerun.models.load import LoadedModel
from forerun.models.testing import save_hf_folder, tiny_model
from forerun.train.held_out import HeldOutSequence, chain_acceptance, make_held_out
from forerun.train.soft_labels import LabelManifest, make_label_shards
from forerun.train.soft_losses import count_chunks, read_soft_examples
from forerun.train.trainer import TrainConfig, Trainer
from tests import test_train_soft as soft
from tests.test_heads import head_config
from tests.test_train_soft import TEXT, TOP_K, chunks_of

# test_train_soft's tiny target (it follows a repeated text), its tokenizer and its label folders.
target, tokenizer, labels = soft.target, soft.tokenizer, soft.labels


def column_of(target: LoadedModel) -> torch.Tensor:
    return torch.arange(target.decoder.cfg.vocab_size)  # every token is a column of itself


def fresh_head(target: LoadedModel, method: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    head = build_head(head_config(target, method), target)
    head.vocab.copy_(torch.arange(target.decoder.cfg.vocab_size))
    head.init_projection(float_weight(target.decoder.lm_head))
    return head


def perturbed(head: torch.nn.Module) -> torch.nn.Module:
    """Every weight moved off its initial value (o and down start at zero: the layer would vanish)."""
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head


@pytest.fixture(scope="module")
def held_out(target, tokenizer, tmp_path_factory) -> list[HeldOutSequence]:
    """The target's greedy answers to prompts of the repeated text, cut at phases the training
    chunks also start at (training never sees these answers)."""
    prompts = [tokenizer.encode((TEXT * 2)[offset:]) for offset in (0, 3, 8)]
    return make_held_out(target, prompts, 24, tmp_path_factory.mktemp("held"))


# --- the unrolled forward is what drafting computes -------------------------------------------------


@torch.no_grad()
def drafted_chain(head: EagleHead, embed, tokens: torch.Tensor, hidden: torch.Tensor, t: int, depth: int) -> list:
    """The features a drafter predicts from position t, step by step against the head's cache:
    the true pairs (embed(x_{p+1}), f_p) for p <= t, then one row per depth that sees the true
    rows, the chain's earlier rows and itself (teacher-forced tokens)."""
    cache = head.new_cache(t + depth + 1, hidden.device)
    out = head(embed(tokens[1 : t + 2]).float(), hidden[: t + 1], torch.arange(t + 1), cache)
    chain, feature, slots = [out[-1]], out[-1], []
    for j in range(2, depth + 1):
        base = cache.length
        visible = torch.zeros(1, base + 1, dtype=torch.bool)
        visible[0, : t + 1] = True
        visible[0, slots] = True
        visible[0, base] = True
        feature = head(
            embed(tokens[t + j : t + j + 1]).float(), feature[None], torch.tensor([t + j - 1]), cache, visible
        )[0]
        slots.append(base)
        chain.append(feature)
    return chain


def test_the_unrolled_forward_predicts_what_the_drafter_predicts_at_every_depth(target, labels) -> None:
    head = perturbed(fresh_head(target, "eagle")).eval()
    embed = target.decoder.embed_tokens
    e = next(read_soft_examples(labels["train"]))
    embeds = embed(e.tokens[1:]).float()
    with torch.no_grad():
        outs = head.forward_unrolled(embeds, e.hidden[:-1], 4)
        torch.testing.assert_close(outs[0], head.forward_train(embeds[None], e.hidden[:-1][None])[0])
    for t in (0, 5, 17, len(e.tokens) - 6):
        chain = drafted_chain(head, embed, e.tokens, e.hidden, t, 4)
        for j, feature in enumerate(chain, start=1):
            torch.testing.assert_close(outs[j - 1][t + j - 1], feature, rtol=1e-4, atol=1e-4, msg=f"t={t} depth={j}")
    # Depth 2 really reads the head's own feature: fed the true one instead, it differs.
    true_fed = head.forward_unrolled(embeds, e.hidden[:-1], 1)[0]
    assert not torch.allclose(outs[1][1:], true_fed[1:], atol=1e-3)


# --- the held-out measure ------------------------------------------------------------------------


@torch.no_grad()
def brute_force_kept(head, method: str, sequences, embed, depth: int) -> list[float]:
    """Chains drafted one start at a time, each token compared with the target's greedy one."""
    kept, chains = [0] * depth, 0
    for s in sequences:
        for t in range(s.answer - 1, len(s.tokens) - depth):
            if method == "eagle":
                features = drafted_chain(head, embed, s.tokens, s.hidden, t, depth)
                guesses = [int(head.logits(f).argmax()) for f in features]
            else:
                guesses = head(s.hidden[t : t + 1]).argmax(-1)[:, 0].tolist()
            chains += 1
            for j in range(depth):
                if guesses[j] != int(s.greedy[t + j + 1]):
                    break
                kept[j] += 1
    return [k / chains for k in kept]


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_held_out_acceptance_counts_chains_as_drafting_them_one_by_one_does(target, held_out, method) -> None:
    head = perturbed(fresh_head(target, method, seed=3)).eval()
    embed = target.decoder.embed_tokens
    measured = chain_acceptance(head, method, held_out, column_of(target), embed)
    depth = 5 if method == "eagle" else head.num_heads
    assert measured.kept == pytest.approx(brute_force_kept(head, method, held_out, embed, depth))
    assert measured.chains == sum(len(s.tokens) - depth - s.answer + 1 for s in held_out)
    assert measured.kept == sorted(measured.kept, reverse=True)  # a chain kept through j is kept through j-1


def test_a_token_outside_the_draft_vocabulary_is_never_kept(target, held_out) -> None:
    head = perturbed(fresh_head(target, "medusa")).eval()
    column = column_of(target).clone()
    column[:] = -100  # no token can be drafted
    assert chain_acceptance(head, "medusa", held_out, column, None).kept == [0.0, 0.0, 0.0]


def test_held_out_answers_are_the_targets_greedy_text_and_are_stored(target, tokenizer, held_out, tmp_path) -> None:
    from forerun.base.config import SamplingParams
    from forerun.engine.engine import Engine

    prompt = tokenizer.encode(TEXT * 2)
    first = held_out[0]
    answer = Engine(target).generate(prompt, SamplingParams(max_tokens=24)).token_ids
    assert first.tokens.tolist() == prompt + answer and first.answer == len(prompt)
    assert first.greedy[first.answer - 1 : -1].tolist() == answer  # the label after p is x_{p+1}
    again = make_held_out(target, [prompt], 24, tmp_path)
    reread = make_held_out(target, [prompt], 24, tmp_path)
    torch.testing.assert_close(again[0].hidden, reread[0].hidden, rtol=0, atol=1e-2)  # stored as bfloat16
    assert reread[0].tokens.tolist() == again[0].tokens.tolist()
    other = tokenizer.encode(TEXT)  # as many prompts, other ones: answered anew, not read back
    assert make_held_out(target, [other], 24, tmp_path)[0].tokens.tolist()[: len(other)] == other


# --- training for the test -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def answer_labels(target, tokenizer, tmp_path_factory) -> Path:
    """The target's labelled answers to other prompts (as `forerun train --answers` makes them):
    its greedy answers leave the repeated text for a loop of their own, which only answers teach."""
    from forerun.train.data import answer_prompts

    prompts = [tokenizer.encode((TEXT * 3)[o : o + n]) for o in (0, 2, 5) for n in (14, 17, 21)]
    folder = tmp_path_factory.mktemp("answers")
    answers = (s.tokens for s in answer_prompts(target, prompts, 24))
    make_label_shards(target, answers, folder, top_k=TOP_K, shard_tokens=128, progress=False)
    return folder


@pytest.fixture(scope="module")
def unrolled(target, labels, answer_labels, held_out, tmp_path_factory) -> Trainer:
    head = fresh_head(target, "eagle")
    config = TrainConfig("eagle", epochs=5, lr=1e-3, checkpoint_every_s=1e9, soft=True, unroll=3)
    out = tmp_path_factory.mktemp("unrolled")
    data = [labels["train"], answer_labels]
    trainer = Trainer(head, config, data, out, target.decoder.embed_tokens, held_out=held_out)
    trainer.run(progress=False)
    return trainer


def test_an_unrolled_head_keeps_deep_chains_on_held_out_answers(unrolled) -> None:
    before, after = unrolled.history.eval_kept[0], unrolled.history.eval_kept[-1]
    assert unrolled.history.eval_steps[0] == 0 and unrolled.history.eval_steps[-1] == unrolled.progress.step
    # Measured before training and at the end of each epoch (a held-out set this small is jumpy).
    assert len(unrolled.history.eval_steps) == 6 and before == [0.0] * 5
    assert after[0] > 0.8 and after[2] > 0.5, unrolled.history.eval_kept  # three tokens from its own features
    assert max(k[2] for k in unrolled.history.eval_kept) > 0.75, unrolled.history.eval_kept
    assert len(unrolled.history.accuracy[-1]) == 3  # top-1 agreement per unrolled step, in the bar


def test_the_curves_show_the_held_out_measure(unrolled, tmp_path) -> None:
    import copy

    import matplotlib.pyplot as plt

    from forerun.train.trainer import plot_history

    plot_history(unrolled.history, tmp_path / "curves.png", "eagle", "eagle")
    without = copy.deepcopy(unrolled.history)
    without.eval_kept, without.eval_steps = [], []
    plot_history(without, tmp_path / "no-held-out.png", "eagle", "eagle")
    # The held-out measure is a panel of its own: three panels where two would be without it.
    widths = [plt.imread(tmp_path / name).shape[1] for name in ("curves.png", "no-held-out.png")]
    assert widths[0] * 2 == widths[1] * 3, widths


def test_training_stops_at_its_time_budget_and_measures_there(target, labels, held_out, tmp_path) -> None:
    config = TrainConfig("eagle", epochs=50, lr=1e-2, checkpoint_every_s=1e9, soft=True, max_seconds=1e-9)
    trainer = Trainer(fresh_head(target, "eagle"), config, labels["train"], tmp_path, target.decoder.embed_tokens)
    trainer.held_out = held_out
    trainer.run(progress=False)
    assert trainer.progress.step == 1 and trainer.history.eval_steps == [0, 1]
    assert (tmp_path / "checkpoint" / "state.json").is_file()


# --- mixed label folders -------------------------------------------------------------------------


def test_label_folders_mix_in_proportion_chunk_by_chunk(target, tokenizer, tmp_path) -> None:
    a, b = tmp_path / "corpus", tmp_path / "answers"
    make_label_shards(target, chunks_of(tokenizer, 60), a, top_k=TOP_K, shard_tokens=64, progress=False)
    make_label_shards(target, chunks_of(tokenizer, 20, offset=4), b, top_k=TOP_K, shard_tokens=64, progress=False)
    alone = {folder: list(read_soft_examples(folder)) for folder in (a, b)}
    assert min(len(LabelManifest.read(folder).shards) for folder in (a, b)) >= 2  # streamed across shards
    # The i-th of a folder's n chunks belongs at (i + 0.5) / n of the epoch.
    placed = [((i + 0.5) / len(alone[f]), k, i, e) for k, f in enumerate((a, b)) for i, e in enumerate(alone[f])]
    expected = [e for *_, e in sorted(placed, key=lambda p: p[:3])]
    mixed = list(read_soft_examples([a, b]))
    assert len(mixed) == count_chunks([a, b]) == count_chunks(a) + count_chunks(b) == len(expected)
    for got, want in zip(mixed, expected):
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.hidden, want.hidden)
    from_b = [i for i, e in enumerate(expected) if any(e is x for x in alone[b])]
    assert from_b[0] < 3 and from_b[-1] > len(mixed) - 4  # b runs through the epoch, not in a block


# --- the command ---------------------------------------------------------------------------------


@pytest.fixture
def model_folder(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    return save_hf_folder(copy.deepcopy(tiny_model(seed=0)), tmp_path / "tiny")


def answer_args(folder: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--method",
        "eagle",
        "--model",
        str(folder),
        "--dtype",
        "float32",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--epochs",
        "1",
        "--max-tokens",
        "10",
        "--draft-vocab",
        "64",
        "--intermediate-size",
        "32",
        "--top-k",
        "4",
        "--eval-prompts",
        "1",
        "--no-progress",
        *extra,
    ]


def test_train_with_answers_labels_them_and_resumes_without_answering_twice(
    model_folder, tmp_path, monkeypatch
) -> None:
    import forerun.train.data as data_module

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"abc{i} abc{i} abc"}) + "\n" for i in range(6)))
    answered: list[int] = []
    batches: list[int] = []
    real = data_module.answer_prompts

    def counting(target, todo, max_tokens, batch_size=data_module.BATCH):
        answered.append(len(todo))
        batches.append(batch_size)
        return real(target, todo, max_tokens, batch_size)

    monkeypatch.setattr(data_module, "answer_prompts", counting)
    shared = tmp_path / "shared"
    first = tmp_path / "first"
    extra = ("--answers", "2", "--data", str(shared), "--answer-batch", "3")
    assert main(answer_args(model_folder, prompts, first, *extra)) == 0
    config = json.loads((first / "config.json").read_text())["training"]
    assert config["answers"] == 2 and config["prompt_ids"] == ["2", "3"] and config["eval_prompt_ids"] == ["1"]
    assert config["unroll"] == 3 and len(config["held_out_kept_per_depth"]) == 5 and config["answer_batch"] == 3
    assert (shared / "answer-labels" / "labels.json").is_file() and not (shared / "labels").exists()
    assert answered == [1, 2]  # the held-out prompt, then the two to train on
    assert batches == [data_module.BATCH, 3]  # the answers to train on, --answer-batch at a time
    # More answers into the same labels: only the new prompts are answered.
    second = tmp_path / "second"
    assert main(answer_args(model_folder, prompts, second, "--answers", "4", "--data", str(shared))) == 0
    assert answered == [1, 2, 1, 2]
    assert batches[-1] == data_module.BATCH  # no --answer-batch on a CPU: its default
    assert json.loads((second / "config.json").read_text())["training"]["answers"] == 4
    assert json.loads((second / "config.json").read_text())["training"]["answer_batch"] == data_module.BATCH


def test_a_gpu_answers_more_prompts_together_by_default() -> None:
    from forerun.commands.train import default_answer_batch
    from forerun.train.data import BATCH, PADDED_BATCH

    assert default_answer_batch(torch.device("cpu")) == BATCH == 8
    assert default_answer_batch(torch.device("cuda")) == PADDED_BATCH == 64


def test_answers_are_the_same_however_many_prompts_are_answered_together(target) -> None:
    from forerun.train.data import engine_answers

    prompts = [[5 + i, 6, 7 + 2 * i] for i in range(5)]
    alone = [s.tokens for s in engine_answers(target, prompts, 12, batch_size=1)]
    for size in (2, 5):
        assert [s.tokens for s in engine_answers(target, prompts, 12, batch_size=size)] == alone
    assert all(len(tokens) > 3 for tokens in alone)  # something was answered


def test_prompts_padded_into_one_batch_answer_as_each_does_alone(target, monkeypatch) -> None:
    import forerun.train.data as data_module
    from forerun.train.data import engine_answers, padded_answers

    monkeypatch.setattr(data_module, "PADDED_PREFILL", 4)  # prompts of 3 to 14 tokens read in 1 to 4 parts
    prompts = [[5 + i, 6, 7 + 2 * i] * (1 + i % 3) + [9] * i for i in range(6)]
    alone = [s.tokens[s.answer :] for s in engine_answers(target, prompts, 12, batch_size=1)]
    assert padded_answers(target.decoder, prompts, 12, frozenset()) == alone
    assert padded_answers(target.decoder, prompts, 1, frozenset()) == [answer[:1] for answer in alone]
    # A stop token: the third answer's fifth, which it also writes first; an answer ends at its first one, kept.
    stop = alone[2][4]
    cut = [answer[: answer.index(stop) + 1] if stop in answer else answer for answer in alone]
    assert padded_answers(target.decoder, prompts, 12, frozenset({stop})) == cut
    assert len(cut[2]) <= 5 < len(alone[2])
    firsts = frozenset(answer[0] for answer in alone)  # every answer stops at once: the batch ends early
    assert padded_answers(target.decoder, prompts, 12, firsts) == [answer[:1] for answer in alone]


def test_answers_step_as_padded_rows_off_the_cpu_and_as_the_engines_lanes_on_it(target, monkeypatch) -> None:
    import forerun.train.data as data_module

    groups: list[int] = []
    real = data_module.padded_answers

    def counting(decoder, group, max_tokens, stop_ids):
        groups.append(len(group))
        return real(decoder, group, max_tokens, stop_ids)

    monkeypatch.setattr(data_module, "padded_answers", counting)
    prompts = [[5 + i, 6] for i in range(5)]
    alone = [s.tokens for s in data_module.engine_answers(target, prompts, 6, 1)]
    assert not data_module.steps_padded(target.decoder)
    assert [s.tokens for s in data_module.answer_prompts(target, prompts, 6, batch_size=2)] == alone
    assert groups == []  # a CPU: the engine's lanes, each answer exact
    monkeypatch.setattr(data_module, "steps_padded", lambda decoder: True)  # as on a GPU
    assert [s.tokens for s in data_module.answer_prompts(target, prompts, 6, batch_size=2)] == alone
    assert groups == [2, 2, 1]


def test_an_empty_or_too_long_prompt_is_refused_before_any_answer(target, monkeypatch) -> None:
    import forerun.train.data as data_module

    monkeypatch.setattr(data_module, "steps_padded", lambda decoder: True)
    limit = target.decoder.cfg.max_position
    for prompts, words in (([[5, 6], []], "empty"), ([[5, 6], [7] * (limit - 3)], "context")):
        with pytest.raises(ForerunError, match=words):
            next(data_module.answer_prompts(target, prompts, 4, batch_size=2))


def test_train_mixes_a_corpus_with_answers(model_folder, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"abc{i} abc{i} abc"}) + "\n" for i in range(4)))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 20)
    out = tmp_path / "head"
    args = answer_args(model_folder, prompts, out, "--answers", "3", "--corpus", str(corpus), "--chunk-tokens", "48")
    assert main(args + ["--train-projection", "--unroll", "2"]) == 0
    config = json.loads((out / "config.json").read_text())["training"]
    assert config["chunks"] >= 2 and config["answers"] == 3 and config["projection"] == "trained"
    assert config["unroll"] == 2 and (out / "labels").is_dir() and (out / "answer-labels").is_dir()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--method", "medusa", "--unroll", "2"], "for eagle heads"),
        (["--eval-prompts", "-1"], "--eval-prompts must be at least 0"),
        (["--answers", "0"], "--answers must be at least 1"),
        (["--train-minutes", "0"], "--train-minutes must be a positive number of minutes"),
        (["--unroll", "0"], "--unroll must be at least 1"),
        (["--answer-batch", "0"], "--answer-batch must be at least 1"),
    ],
)
def test_flags_that_cannot_apply_are_refused(tmp_path, capsys, extra, message) -> None:
    args = answer_args(tmp_path / "model", tmp_path / "prompts.jsonl", tmp_path / "out", *extra)
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_a_saved_unrolled_head_loads(target, unrolled, tmp_path) -> None:
    from forerun.heads import load_head

    save_head(tmp_path, head_config(target, "eagle"), unrolled.head)
    _, head = load_head(tmp_path, target, "eagle")
    loaded, trained = head.state_dict(), unrolled.head.state_dict()
    assert list(loaded) == list(trained)  # the same tensors, then each one equal
    for name in loaded:
        torch.testing.assert_close(loaded[name], trained[name], msg=name)
