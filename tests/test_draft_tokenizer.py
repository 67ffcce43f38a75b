"""A draft model of the target's family takes the target's tokenizer instead of loading its own
(`load_model(tokens_like=...)`): only where its tokenizer files make the same tokens and stop ids.
A draft whose files differ loads its own, and the vocabulary check still refuses one whose tokens
disagree with the target's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from forerun.api import LLM, SamplingParams
from forerun.base.errors import ForerunError
from forerun.models.load import load_model
from forerun.models.testing import save_hf_folder, tiny_model
from forerun.models.tokenizer_files import same_tokens


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A target and a smaller draft of the same tiny family, their tokenizer files the same bytes
    except the chat template (as the embedded pair's are)."""
    root = tmp_path_factory.mktemp("family")
    target = save_hf_folder(tiny_model(seed=1, num_layers=3), root / "target")
    draft = save_hf_folder(tiny_model(seed=2, num_layers=1), root / "draft")
    template = draft / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_start|>assistant", "<|im_start|>assistant "))
    return target, draft


def _copy(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _swap_two_tokens(vocab: dict) -> None:
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]


def test_tokenizer_folders_that_differ_only_in_the_chat_template_make_the_same_tokens(folders) -> None:
    target, draft = folders
    assert (target / "chat_template.jinja").read_bytes() != (draft / "chat_template.jinja").read_bytes()
    assert same_tokens(target, draft) and same_tokens(draft, target) and same_tokens(target, target)


@pytest.mark.parametrize("change", ["vocabulary", "eos", "added file", "missing file", "no class"])
def test_any_other_difference_in_the_token_files_means_not_the_same_tokens(folders, tmp_path, change) -> None:
    target, draft = folders
    other = _copy(draft, tmp_path / "other")
    if change == "vocabulary":
        _edit_json(other / "tokenizer.json", lambda t: _swap_two_tokens(t["model"]["vocab"]))
    elif change == "eos":
        _edit_json(other / "tokenizer_config.json", lambda c: c.update(eos_token="<|endoftext|>"))
    elif change == "added file":
        (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    elif change == "missing file":
        (other / "tokenizer_config.json").unlink()
    else:  # the class left to each model's config.json: the same files may make different tokenizers
        target = _copy(target, tmp_path / "target")
        for folder in (target, other):
            _edit_json(folder / "tokenizer_config.json", lambda c: c.pop("tokenizer_class"))
    assert not same_tokens(target, other)


def test_a_draft_with_the_targets_token_files_shares_its_tokenizer(folders) -> None:
    target_dir, draft_dir = folders
    target = load_model(str(target_dir), dtype="float32")
    draft = load_model(str(draft_dir), dtype="float32", draft=True, tokens_like=target)
    assert draft.tokenizer is target.tokenizer and draft.tokenizer_dir == draft_dir
    assert load_model(str(draft_dir), dtype="float32").tokenizer is not target.tokenizer  # none given: its own
    llm = LLM(str(target_dir), dtype="float32", speculative_model=str(draft_dir), num_speculative_tokens=3)
    assert llm.spec.options["model"].tokenizer is llm.target.tokenizer
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = LLM(str(target_dir), dtype="float32").generate("def f(x):", params)[0].outputs[0].token_ids
    assert llm.generate("def f(x):", params)[0].outputs[0].token_ids == plain and len(plain) == 12


def test_a_draft_with_other_token_files_loads_its_own_and_disagreeing_tokens_are_refused(folders, tmp_path) -> None:
    target_dir, draft_dir = folders
    target = load_model(str(target_dir), dtype="float32")
    eos = _copy(draft_dir, tmp_path / "eos")
    (eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 40]}))  # 40: a character
    assert load_model(str(eos), dtype="float32", draft=True, tokens_like=target).tokenizer is not target.tokenizer
    swapped = _copy(draft_dir, tmp_path / "swapped")
    _edit_json(swapped / "tokenizer.json", lambda t: _swap_two_tokens(t["model"]["vocab"]))
    with pytest.raises(ForerunError, match=r"draft and target tokenizers differ at id \d+"):
        LLM(str(target_dir), dtype="float32", speculative_model=str(swapped), num_speculative_tokens=3)
    with pytest.raises(ForerunError, match=r"draft and target stop tokens differ"):
        LLM(str(target_dir), dtype="float32", speculative_model=str(eos), num_speculative_tokens=3)
