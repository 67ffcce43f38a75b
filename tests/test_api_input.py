"""The Python API against a careless caller: every wrong prompt, message, parameter or option is a
ForerunError that says what was wrong, before any model work, and the LLM works on afterwards."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from forerun.api import LLM
from forerun.base.config import SamplingParams, SpeculativeConfig
from forerun.base.errors import ForerunError
from forerun.models.testing import save_hf_folder, tiny_model

PARAMS = SamplingParams(max_tokens=3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tiny_model(seed=0), tmp_path_factory.mktemp("api") / "tiny")


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(str(folder), dtype="float32")


@pytest.mark.parametrize(
    "prompt,needle",
    [
        (b"Say hi", "not a bytes"),
        ([[1, 2]], "not a list of list"),
        ([1.7, 2.2], "not a list of float"),
        (["1", 2], "not a list of int and str"),
        ([1, True], "not a list of bool and int"),
        ([1, -1], "token id -1 is outside the vocabulary"),
        ([1, 10**6], "token id 1000000 is outside the vocabulary"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role 'wizard' is not one of"),
        ([{"content": "hi"}], "messages[0] must be an object with a 'role'"),
        ([{"role": "user", "content": None}], "messages[0].content must be a string"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text"),
    ],
)
def test_a_wrong_prompt_is_named_before_any_model_work(llm: LLM, prompt, needle: str) -> None:
    with pytest.raises(ForerunError) as err:
        llm.generate([prompt], PARAMS)  # a list of one prompt
    assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("prompts", [None, 5, {"text": "hi"}])  # ({"prompt": ...} is vLLM's form)
def test_prompts_that_are_no_prompt_at_all_are_named(llm: LLM, prompts) -> None:
    with pytest.raises(ForerunError, match=f"not a {type(prompts).__name__}"):
        llm.generate(prompts, PARAMS)


def test_chat_checks_its_messages_and_joins_text_parts(llm: LLM) -> None:
    for messages in ("hi", ["hi"], None, [{"role": "bot", "content": "hi"}]):
        with pytest.raises(ForerunError, match="messages"):
            llm.chat(messages, PARAMS)
    parts = [{"type": "text", "text": "say "}, {"type": "text", "text": "hi"}]
    joined = llm.chat([{"role": "user", "content": parts}], PARAMS)[0]
    plain = llm.chat([{"role": "user", "content": "say hi"}], PARAMS)[0]
    assert joined.token_ids == plain.token_ids and joined.prompt_token_ids == plain.prompt_token_ids


def test_chat_continues_the_assistants_last_message_as_vllm_does(llm: LLM) -> None:
    turns = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "xy"}]
    out = llm.chat(turns, PARAMS, add_generation_prompt=False, continue_final_message=True)[0]
    ids = llm.tokenizer.apply_chat(turns, False, True)
    assert out.prompt_token_ids == ids and llm.tokenizer.decode(ids).endswith("xy")
    assert out.token_ids == llm.generate(ids, PARAMS)[0].token_ids
    closed = llm.chat(turns, PARAMS, add_generation_prompt=False)[0]
    assert closed.prompt_token_ids == llm.tokenizer.apply_chat(turns, False) != ids
    with pytest.raises(ForerunError, match="pass add_generation_prompt=False"):
        llm.chat(turns, PARAMS, continue_final_message=True)
    with pytest.raises(ForerunError, match="needs the assistant's message last"):
        llm.chat(turns[:1], PARAMS, add_generation_prompt=False, continue_final_message=True)


def test_params_that_are_not_sampling_params_are_named(llm: LLM) -> None:
    for call in (lambda: llm.generate("hi", {"max_tokens": 3}), lambda: list(llm.stream("hi", 3))):
        with pytest.raises(ForerunError, match="params must be a SamplingParams"):
            call()
    assert llm.generate("hi", PARAMS)[0].token_ids  # still works after every error above


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": None}, "top_p must be a number"),
        ({"stop": 5}, "stop must be a string or a list"),
        ({"stop": {"a": 1}}, "stop must be a string or a list"),
        ({"max_tokens": True}, "max_tokens must be a whole number"),
        ({"seed": True}, "seed must be a whole number"),
        ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
    ],
)
def test_sampling_params_of_the_wrong_type_name_the_field(fields: dict, needle: str) -> None:
    with pytest.raises(ForerunError, match=needle):
        SamplingParams(**fields)


def test_speculative_settings_of_the_wrong_kind_are_named(folder: Path, llm: LLM) -> None:
    for k in (2.5, "3", None):
        with pytest.raises(ForerunError, match="num_speculative_tokens must be a whole number"):
            SpeculativeConfig("ngram", k)
    for method in ("draft", "auto"):
        with pytest.raises(ForerunError, match="give speculative_model"):
            LLM(llm.target, speculative_method=method)
    with pytest.raises(ForerunError, match=r"'ngram' takes no option 'bogus'; its options: .*ngram_max"):
        LLM(llm.target, speculative_method="ngram", speculative_options={"bogus": 1})
    # An option of the wrong kind, or below 0, is named before the drafter is built.
    for method, options, needle in [
        ("ngram", {"ngram_max": "3"}, "option ngram_max (--ngram-max) must be a whole number >= 0, got '3'"),
        ("ngram", {"ngram_max": True}, "option ngram_max (--ngram-max) must be a whole number >= 0, got True"),
        ("suffix", {"branch_ratio": -1.0}, "option branch_ratio (--suffix-branch-ratio) must be a finite number >= 0"),
        ("suffix", {"min_prob": float("nan")}, "option min_prob (--suffix-min-prob) must be a finite number >= 0"),
        ("lookahead", {"window": -2}, "option window (--lookahead-window) must be a whole number >= 0, got -2"),
    ]:
        with pytest.raises(ForerunError, match=re.escape(needle)):
            LLM(llm.target, speculative_method=method, speculative_options=options)


def test_an_llm_of_the_wrong_kind_of_thing_is_named(llm: LLM) -> None:
    with pytest.raises(ForerunError, match="model must be a name, a path or a LoadedModel, not NoneType"):
        LLM(None)
    with pytest.raises(ForerunError, match="prefix_cache_mb must be a number"):
        LLM(llm.target, prefix_cache_mb="10")
    for method in ("", 3):
        with pytest.raises(ForerunError, match="speculative_method must name a drafter"):
            LLM(llm.target, speculative_method=method)


def test_chat_messages_for_a_model_without_a_chat_template_are_refused_naming_both_ways(tmp_path) -> None:
    from forerun.models.testing import tiny_tokenizer

    tok = tiny_tokenizer(tmp_path)
    tok.hf.chat_template = None
    with pytest.raises(ForerunError, match=r"no chat template: pass a plain prompt .*leave out --chat"):
        tok.apply_chat([{"role": "user", "content": "hi"}])
