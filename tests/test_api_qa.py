"""Bad input to `LLM` and `forerun generate` beyond tests/test_api_input.py: vLLM's list of
SamplingParams, a bad prompt after good ones, arguments of the wrong kind, conflicting flags. Each is
a ForerunError (the CLI's exit 2) before any model work, never a traceback or half an output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.cli import main
from forerun.models.testing import save_hf_folder, tiny_model

PARAMS = SamplingParams(max_tokens=3)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tiny_model(seed=0), tmp_path_factory.mktemp("qa") / "tiny")


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(str(folder), dtype="float32")


@pytest.fixture
def no_generation(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any prompt that reaches the engine fails the test: the error must come first."""
    monkeypatch.setattr(llm.engine, "generate", lambda *a, **k: pytest.fail("a prompt was generated"))


def test_a_list_of_sampling_params_gives_each_prompt_its_own_as_in_vllm(llm: LLM) -> None:
    each = [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)]
    assert [len(r.token_ids) for r in llm.generate(["ab", [5, 6]], each)] == [2, 4]
    assert [len(r.token_ids) for r in llm.chat([CHAT, CHAT], each)] == [2, 4]
    assert len(llm.generate("ab", each[:1])[0].token_ids) == 2  # one prompt, a list of one


@pytest.mark.parametrize(
    "params,needle",
    [
        ([PARAMS], "a list of 1 SamplingParams for 2 prompts"),
        ([PARAMS, PARAMS, PARAMS], "a list of 3 SamplingParams for 2 prompts"),
        ([PARAMS, {"max_tokens": 3}], "params[1] must be a SamplingParams"),
        ([], "a list of 0 SamplingParams for 2 prompts"),
        ({}, "params must be a SamplingParams"),  # empty, so once taken for "no params given"
        (0, "params must be a SamplingParams"),
    ],
)
def test_params_of_the_wrong_length_or_kind_are_named(llm: LLM, no_generation, params, needle: str) -> None:
    with pytest.raises(ForerunError) as err:
        llm.generate(["ab", "cd"], params)
    assert needle in str(err.value), str(err.value)
    with pytest.raises(ForerunError) as err:
        llm.chat([CHAT, CHAT], params)
    assert needle.replace("prompts", "conversations") in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("", "the prompt is empty"),
        ("x" * 1100, "beyond the model's context of 1024"),
        (5, "not a int"),
        ([1, 10**6], "outside the vocabulary"),
    ],
)
def test_a_bad_later_prompt_is_named_before_any_prompt_runs(llm: LLM, no_generation, bad, needle: str) -> None:
    with pytest.raises(ForerunError, match=needle):
        llm.generate(["ab", bad], PARAMS)


def test_a_bad_later_conversation_is_named_before_any_conversation_runs(llm: LLM, no_generation) -> None:
    with pytest.raises(ForerunError, match="beyond the model's context"):
        llm.chat([CHAT, [{"role": "user", "content": "x" * 1100}]], PARAMS)
    with pytest.raises(ForerunError, match="logit_bias names token 1000"):
        llm.chat([CHAT], SamplingParams(max_tokens=3, logit_bias={1000: 1.0}))


def test_numpy_token_ids_are_one_prompt_as_ints_are(llm: LLM) -> None:
    ids = [5, 6, 7]
    as_numpy = llm.generate([np.int64(t) for t in ids], PARAMS)
    assert len(as_numpy) == 1 and as_numpy[0].token_ids == llm.generate(ids, PARAMS)[0].token_ids


def test_vllms_dict_prompts_run_as_their_text_or_ids(llm: LLM) -> None:
    ids, text = [5, 6, 7], "hi there"
    want_ids, want_text = llm.generate(ids, PARAMS)[0].token_ids, llm.generate(text, PARAMS)[0].token_ids
    assert llm.generate({"prompt_token_ids": ids}, PARAMS)[0].token_ids == want_ids
    both = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], PARAMS)
    assert [r.token_ids for r in both] == [want_text, want_ids]


@pytest.mark.parametrize(
    "prompt,needle",
    [
        ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one of prompt and prompt_token_ids: it has prompt and"),
        ({"prompt": "hi", "multi_modal_data": {}}, "it has multi_modal_data"),
        ({"prompt": [1, 2]}, '"prompt" is text, not a list'),
        ({"prompt_token_ids": "1 2"}, '"prompt_token_ids" is a list of token ids'),
        ({"prompt_token_ids": [[1, 2]]}, '"prompt_token_ids" is a list of token ids'),
        ({"prompt_token_ids": [1, 10_000]}, "outside the vocabulary"),
    ],
)
def test_a_vllm_prompt_dict_that_is_wrong_is_named(llm: LLM, no_generation, prompt: dict, needle: str) -> None:
    with pytest.raises(ForerunError) as err:
        llm.generate([prompt], PARAMS)
    assert needle in str(err.value), str(err.value)


def test_chat_switches_that_are_not_true_or_false_are_named(llm: LLM, no_generation) -> None:
    with pytest.raises(ForerunError, match="add_generation_prompt must be True or False, got 'no'"):
        llm.chat(CHAT, PARAMS, add_generation_prompt="no")
    with pytest.raises(ForerunError, match="continue_final_message must be True or False, got 1"):
        llm.chat(CHAT, PARAMS, add_generation_prompt=False, continue_final_message=1)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"speculative_method": "ngram", "speculative_options": [1]}, "speculative_options must be a dict"),
        ({"speculative_method": "ngram", "speculative_options": "ngram_max=3"}, "speculative_options must be a dict"),
        ({"speculative_model": 5}, "speculative_model must be a name, a path or a LoadedModel, not int"),
        ({"speculative_method": "draft", "speculative_options": {"model": 5}}, r'speculative_options\["model"\]'),
        ({"speculative_options": {"ngram_max": 3}}, "go to a drafter, but none is named"),
        ({"prefix_cache_mb": float("inf")}, "prefix_cache_mb must be a number"),
        ({"prefix_cache_mb": True}, "prefix_cache_mb must be a number"),
        ({"device": 5}, "device must be a string"),
    ],
)
def test_llm_arguments_of_the_wrong_kind_are_named_before_loading(folder: Path, kwargs: dict, needle: str) -> None:
    with pytest.raises(ForerunError, match=needle):
        LLM(str(folder), dtype="float32", **kwargs)


def run_generate(capsys: pytest.CaptureFixture, folder: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["generate", "--model", str(folder), "--dtype", "float32", "--max-tokens", "2", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "extra,needle",
    [
        (("--prompt", "ab", ""), "prompt 2 of 2: the prompt is empty"),
        (("--prompt", "ab", "x" * 1100, "--json"), "prompt 2 of 2: prompt (1100 tokens)"),
        (("--prompt", "ab", "--prompts-file", "{file}"), "prompt 3 of 3: the prompt is empty"),
    ],
)
def test_generate_with_a_bad_later_prompt_exits_2_before_any_output(
    capsys, folder: Path, tmp_path: Path, extra: tuple, needle: str
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "cd"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    code, out, err = run_generate(capsys, folder, *(str(prompts) if a == "{file}" else a for a in extra))
    assert (code, out) == (2, "") and f"error: {needle}" in err, err


def test_generate_with_a_draft_model_and_a_method_that_runs_none_exits_2_before_loading(
    capsys, folder: Path, monkeypatch
) -> None:
    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("a model was loaded"))
    code, out, err = run_generate(
        capsys, folder, "--prompt", "x", "--speculative-model", str(folder), "--speculative-method", "ngram"
    )
    assert (code, out) == (2, "") and "--speculative-model is a draft model, but --speculative-method ngram" in err


def test_generate_with_a_logit_bias_naming_a_token_twice_exits_2(capsys, folder: Path) -> None:
    code, out, err = run_generate(capsys, folder, "--prompt", "x", "--logit-bias", "5=100", "5=-100")
    assert (code, out) == (2, "") and "error: --logit-bias names token 5 twice" in err


def test_generate_with_an_infinite_prefix_cache_exits_2(capsys, folder: Path) -> None:
    code, out, err = run_generate(capsys, folder, "--prompt", "x", "--prefix-cache-mb", "inf")
    assert (code, out) == (2, "") and "error: prefix_cache_mb must be a number" in err


@pytest.mark.parametrize("value", ["nan", "2", "-0.5"])
def test_a_draft_min_confidence_outside_0_to_1_exits_2_through_argparse(capsys, folder: Path, value: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_generate(
            capsys, folder, "--prompt", "x", "--speculative-model", str(folder), "--draft-min-confidence", value
        )
    assert exit_info.value.code == 2
    assert f"--draft-min-confidence: must be a number from 0 to 1, got {value}" in capsys.readouterr().err


def test_a_draft_model_given_as_a_path_object_is_loaded_once_and_checked_first(folder: Path, tmp_path: Path) -> None:
    from forerun.models.load import LoadedModel

    llm = LLM(str(folder), dtype="float32", speculative_model=folder)  # a pathlib.Path, as a name would be
    assert isinstance(llm.spec.options["model"], LoadedModel)  # loaded here, shared by every engine
    assert llm.spec.method == "auto"
    with pytest.raises(ForerunError, match="missing"):
        LLM(str(folder), dtype="float32", speculative_model=tmp_path / "missing")
