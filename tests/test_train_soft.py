"""Heads trained on soft labels (the target's top-k distribution over corpus text): the KL to the
target falls and the heads agree with its top-1 on held-out text, an interrupted run resumes to the
same weights, a soft-trained head keeps greedy and sampled output exact, and `forerun train
--corpus` makes a head that loads (and refuses a missing corpus before loading the model)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from forerun import drafters
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.cli import main
from forerun.engine.engine import Engine
from forerun.heads import build_head, float_weight, load_head, save_head
from forerun.models.load import LoadedModel
from forerun.models.testing import save_hf_folder, tiny_model, tiny_tokenizer
from forerun.train.corpus import Document, token_chunks
from forerun.train.soft_labels import make_label_shards, soft_targets
from forerun.train.soft_losses import draft_labels, kl_loss, read_soft_examples
from forerun.train.trainer import TrainConfig, Trainer
from tests.test_drafters_common import (
    CONTROL_RUNS,
    RUNS,
    SAMPLING,
    exact_marginals,
    keep_every_draft_always,
    speculative_samples,
    total_variation,
)
from tests.test_heads import head_config, whole_and_resumed

TEXT = "def run(x):\n"  # the corpus: a short text repeated; each character has one successor in it
CHUNK = 64  # not a multiple of the text's length: chunks start at every phase of it
TOP_K = 8


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def target(tokenizer) -> LoadedModel:
    """A tiny target with a preference a head can learn: after each character of TEXT it favours the
    next one (a boost on its random LM head, its layers damped), so its top-1 mostly follows the
    text while its top-k keeps a spread (at temperature 1 it often, not always, follows). A purely
    random tiny model's top-1 flips with the context between near-tied tokens at many positions,
    which no head learns in a few steps."""
    model = tiny_model(0, tokenizer=tokenizer, name="soft-target")
    decoder = model.decoder
    ids = tokenizer.encode(TEXT)
    with torch.no_grad():
        emb = decoder.embed_tokens.weight
        emb.mul_(6.0)
        for a, b in zip(ids, ids[1:] + ids[:1]):
            decoder.lm_head.weight[b] += emb[a] / emb[a].norm() * 1.5  # the feature of a lines up with b's row
        for layer in decoder.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
    return model


def chunks_of(tokenizer, repeats: int, offset: int = 0) -> list[list[int]]:
    """The repeated text from character `offset` on, cut into CHUNK-token chunks."""
    return list(token_chunks([Document(Path("corpus"), (TEXT * repeats)[offset:])], tokenizer.encode, CHUNK))


@pytest.fixture(scope="module")
def labels(target, tokenizer, tmp_path_factory) -> dict[str, Path]:
    """Label folders: "train" (several shards) and "held_out" (the same text cut at another phase)."""
    root = tmp_path_factory.mktemp("labels")
    make_label_shards(target, chunks_of(tokenizer, 200), root / "train", top_k=TOP_K, shard_tokens=256, progress=False)
    make_label_shards(target, chunks_of(tokenizer, 45, offset=5), root / "held_out", top_k=TOP_K, progress=False)
    return {"train": root / "train", "held_out": root / "held_out"}


def new_trainer(
    target: LoadedModel, method: str, data: Path, out: Path, lr: float, epochs: int = 50, bf16: bool = False
) -> Trainer:
    torch.manual_seed(0)
    head = build_head(head_config(target, method), target)
    head.vocab.copy_(torch.arange(target.decoder.cfg.vocab_size))
    head.init_projection(float_weight(target.decoder.lm_head))
    config = TrainConfig(method, epochs=epochs, lr=lr, batch_rows=CHUNK, checkpoint_every_s=1e9, soft=True, bf16=bf16)
    return Trainer(head, config, data, out, target.decoder.embed_tokens if method == "eagle" else None)


@torch.no_grad()
def held_out_scores(target: LoadedModel, head: torch.nn.Module, method: str, folder: Path) -> tuple[float, float]:
    """(mean KL from the target's renormalised top-k to the head, top-1 agreement with the target),
    for Medusa's first head or EAGLE's token, computed densely over the whole vocabulary (not with
    the trainer's own loss): position t's head output against the label at t+1."""
    head.eval()
    kls, hits, rows = [], 0, 0
    for e in read_soft_examples(folder):
        if method == "medusa":
            logits = head(e.hidden[:-1])[0]  # [T-1, V]: head 1 at t guesses token t+2
        else:
            embeds = target.decoder.embed_tokens(e.tokens[1:]).float()
            logits = head.logits(head.forward_train(embeds[None], e.hidden[:-1][None])[0])  # [T-1, V]
        p = soft_targets(e.top_ids[1:], e.top_probs[1:], logits.shape[-1])  # [T-1, V]: token t+2's
        kls.append((torch.xlogy(p, p) - p * logits.log_softmax(-1)).sum(-1))
        hits += int((logits.argmax(-1) == e.top_ids[1:, 0]).sum())
        rows += len(logits)
    return float(torch.cat(kls).mean()), hits / rows


@pytest.fixture(scope="module")
def trained(target, labels, tmp_path_factory) -> dict[str, tuple[Path, Trainer, tuple[float, float]]]:
    """Per method: (the saved head's folder, its trainer, held-out scores before training)."""
    out = {}
    for method, lr, steps in (("medusa", 3e-2, 60), ("eagle", 1e-2, 100)):
        folder = tmp_path_factory.mktemp(method)
        trainer = new_trainer(target, method, labels["train"], folder / "run", lr)
        before = held_out_scores(target, trainer.head, method, labels["held_out"])
        trainer.run(progress=False, max_steps=steps)
        save_head(folder / "head", head_config(target, method), trainer.head)
        out[method] = (folder / "head", trainer, before)
    return out


# --- the losses -----------------------------------------------------------------------------------


def test_labels_outside_the_draft_vocabulary_are_dropped_and_the_rest_renormalised() -> None:
    vocab = torch.tensor([2, 5, 7])  # the draft vocabulary: token ids of columns 0, 1, 2
    column = torch.full((8,), -100, dtype=torch.long)
    column[vocab] = torch.arange(3)
    top_ids = torch.tensor([[5, 3, 7], [3, 2, 9], [4, 3, 6]])  # 9 is beyond every id the vocabulary holds
    top_probs = torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1], [0.7, 0.2, 0.1]])
    labels = draft_labels(top_ids, top_probs, column)
    torch.testing.assert_close(labels.probs[0], torch.tensor([0.5, 0.0, 0.1]) / 0.6)
    torch.testing.assert_close(labels.probs[1], torch.tensor([0.0, 1.0, 0.0]))
    assert labels.valid.tolist() == [True, True, False]  # nothing of row 2's top-k can be drafted
    assert labels.top1.tolist() == [1, -100, -100]  # the target's top-1 as a column, -100 outside
    assert labels.columns[0].tolist() == [1, 0, 2]
    # The KL is zero where the head's distribution is the renormalised target, positive elsewhere.
    exact = torch.log(torch.tensor([[1e-9, 5 / 6, 1 / 6], [1.0, 1e-9, 1e-9], [1.0, 1.0, 1.0]]))
    assert float(kl_loss(exact, labels.columns, labels.probs, labels.valid)) < 1e-6
    assert float(kl_loss(torch.zeros(3, 3), labels.columns, labels.probs, labels.valid)) > 0.1


# --- training -------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_soft_training_drives_the_kl_down_and_top1_agreement_above_0_9_on_held_out_text(
    target, labels, trained, method
) -> None:
    _, trainer, (kl_before, agreement_before) = trained[method]
    kl_after, agreement_after = held_out_scores(target, trainer.head, method, labels["held_out"])
    assert kl_after < 0.5 * kl_before, (kl_before, kl_after)
    assert agreement_after > 0.9, (agreement_before, agreement_after)
    assert trainer.history.loss[-1] < trainer.history.loss[0]
    # The progress bar's numbers: the training batches' agreement with the target's top-1, one per
    # head (EAGLE: one), rising as the KL falls (one chunk per step, EAGLE's inputs noised: noisy).
    assert len(trainer.history.accuracy[-1]) == (3 if method == "medusa" else 1)
    first, last = (
        sum(a[0] for a in part) / len(part) for part in (trainer.history.accuracy[:5], trainer.history.accuracy[-10:])
    )
    assert last > 0.85 and last > first + 0.3, (first, last)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_training_in_bfloat16_learns_as_in_float32_and_keeps_float32_weights(target, labels, tmp_path, method) -> None:
    lr, steps = {"medusa": (3e-2, 60), "eagle": (1e-2, 100)}[method]
    plain = new_trainer(target, method, labels["train"], tmp_path / "float32", lr)
    plain.run(progress=False, max_steps=3)
    trainer = new_trainer(target, method, labels["train"], tmp_path / "bfloat16", lr, bf16=True)
    kl_before, _ = held_out_scores(target, trainer.head, method, labels["held_out"])
    trainer.run(progress=False, max_steps=steps)
    assert trainer.history.loss[:3] != plain.history.loss  # the same steps, its products in bfloat16
    assert all(p.dtype == torch.float32 for p in trainer.head.parameters())
    kl_after, agreement_after = held_out_scores(target, trainer.head, method, labels["held_out"])
    assert kl_after < 0.5 * kl_before and agreement_after > 0.9, (kl_before, kl_after, agreement_after)


def test_the_training_dtype_is_bfloat16_where_the_cpu_multiplies_it_natively(monkeypatch) -> None:
    from forerun.commands.train import train_bf16
    from forerun.models import linear

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert train_bf16("bfloat16", cpu) and train_bf16("bfloat16", gpu)
    assert not train_bf16("float32", cpu) and not train_bf16("auto", gpu)
    for native in (True, False):
        monkeypatch.setattr(linear, "cpu_has_native_bf16", lambda native=native: native)
        assert train_bf16("auto", cpu) == native


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_soft_resume_continues_from_the_checkpoint_as_if_never_stopped(target, labels, tmp_path, method) -> None:
    def fresh(out: Path) -> Trainer:
        return new_trainer(target, method, labels["train"], out, lr=1e-2, epochs=3)

    whole, second = whole_and_resumed(fresh, tmp_path)
    assert second.progress.sequence == whole.progress.sequence > 4  # mid-epoch, in chunks
    a, b = whole.head.state_dict(), second.head.state_dict()
    assert list(a) == list(b)  # the same tensors, then each one equal
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


def test_a_soft_checkpoint_is_not_resumed_on_hard_labels(target, labels, tmp_path) -> None:
    trainer = new_trainer(target, "medusa", labels["train"], tmp_path, lr=1e-2)
    trainer.run(progress=False, max_steps=1)
    trainer.save_checkpoint()
    hard = new_trainer(target, "medusa", labels["train"], tmp_path, lr=1e-2)
    hard.config.soft = False
    with pytest.raises(ForerunError, match="soft labels"):
        hard.load_checkpoint()


# --- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["medusa", "eagle"])
def test_a_soft_trained_head_gives_the_plain_greedy_output(target, tokenizer, trained, which) -> None:
    folder = trained[which][0]
    for offset in (0, 7, 20):
        prompt = tokenizer.encode((TEXT * 3)[offset:])
        plain = Engine(target).generate(prompt, SamplingParams(max_tokens=30)).token_ids
        out = Engine(target, drafters.create(which, target, {"head": str(folder)}), 3).generate(
            prompt, SamplingParams(max_tokens=30)
        )
        assert out.token_ids == plain
        assert out.metrics.num_accepted_tokens > 0  # the head's drafts were kept, not only made


@pytest.fixture(scope="module")
def sampling_case(target, tokenizer) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    prompt = tokenizer.encode(TEXT * 2)
    return (prompt, *exact_marginals(target, prompt, SAMPLING))


@pytest.mark.parametrize("which", ["medusa", "eagle"])
def test_sampled_tokens_of_a_soft_trained_head_follow_the_targets_distribution(
    target, trained, sampling_case, which
) -> None:
    prompt, second, third = sampling_case
    drafter = drafters.create(which, target, {"head": str(trained[which][0])})
    samples, metrics = speculative_samples(target, drafter, 2, prompt, RUNS)
    for position, exact in ((0, second), (1, third)):
        tv, tolerance = total_variation([s[position] for s in samples], exact)
        assert tv < tolerance, f"token {position + 2}: TV {tv:.4f} >= {tolerance:.4f}"
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens


@pytest.mark.parametrize("which", ["medusa", "eagle"])
def test_negative_control_an_always_accepting_rule_fails_with_a_soft_trained_head(
    target, trained, sampling_case, monkeypatch, which
) -> None:
    prompt, second, third = sampling_case
    keep_every_draft_always(monkeypatch)
    drafter = drafters.create(which, target, {"head": str(trained[which][0])})
    samples, _ = speculative_samples(target, drafter, 2, prompt, CONTROL_RUNS)
    failures = [total_variation([s[i] for s in samples], exact) for i, exact in ((0, second), (1, third))]
    assert any(tv >= tolerance for tv, tolerance in failures)


# --- the command ----------------------------------------------------------------------------------


def train_args(folder: Path, corpus: list[Path], out: Path) -> list[str]:
    return [
        "train",
        "--method",
        "medusa",
        "--model",
        str(folder),
        "--dtype",
        "float32",
        "--corpus",
        *map(str, corpus),
        "--out",
        str(out),
        "--epochs",
        "1",
        "--heads",
        "2",
        "--draft-vocab",
        "64",
        "--chunk-tokens",
        "48",
        "--top-k",
        "5",
        "--no-progress",
    ]


def test_train_command_with_a_corpus_makes_a_head_that_loads(tmp_path, monkeypatch, capsys) -> None:
    from forerun.models.load import load_model

    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    folder = save_hf_folder(copy.deepcopy(tiny_model(seed=0)), tmp_path / "tiny")
    corpus = tmp_path / "corpus"
    (corpus / "src").mkdir(parents=True)
    (corpus / "src" / "add.py").write_text(TEXT * 6)
    (corpus / "notes.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 4)
    (corpus / "blob.bin").write_bytes(bytes(range(256)))
    out = tmp_path / "head"
    assert main(train_args(folder, [corpus], out)) == 0
    err = capsys.readouterr().err
    assert "corpus: read 2 files" in err and "skipped 1 binary" in err  # the report's line
    config = json.loads((out / "config.json").read_text())
    assert config["method"] == "medusa" and config["draft_vocab"] == 64
    assert config["training"]["chunks"] >= 4 and config["training"]["top_k"] == 5
    assert (out / "labels" / "labels.json").is_file() and (out / "curves.png").is_file()
    _, head = load_head(out, load_model(str(folder), "float32"), "medusa")
    assert head.num_heads == 2
    assert main(train_args(folder, [corpus], out) + ["--resume"]) == 0  # the labels are kept, training resumes
    # A token budget stops labelling after the chunk that reaches it.
    small = tmp_path / "small"
    assert main(train_args(folder, [corpus], small) + ["--budget-tokens", "60"]) == 0
    assert json.loads((small / "config.json").read_text())["training"]["chunks"] == 2  # 2 x 48 >= 60


def test_a_missing_corpus_path_is_an_error_before_the_model_loads(tmp_path, monkeypatch, capsys) -> None:
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the corpus was checked")

    monkeypatch.setattr("forerun.models.load.load_model", no_loading)
    missing = tmp_path / "no" / "such" / "corpus"
    assert main(train_args(tmp_path / "model", [tmp_path, missing], tmp_path / "out")) == 2
    assert f"corpus path {missing} does not exist" in capsys.readouterr().err
