"""Fill-in-the-middle: a prompt and a suffix make the code model's infill prompt (each family's
markers, BOS where the tokenizer opens with it), through the completions route (whole and streamed,
exact under speculation), LLM.generate's prompt dicts, `forerun generate --suffix` and a bench
prompts file; a model without the markers, a suffix that is no string, and echo beside it refused."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from test_server import NAME, Served
from test_server_api import AUTH, post, stream

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.base.prompts import load_prompts
from forerun.bench.runner import BenchConfig, _encode, _settings_lines
from forerun.cli import main
from forerun.engine.engine import Engine
from forerun.models.testing import TINY_INFILL_VOCAB, save_hf_folder, tiny_model, tiny_tokenizer
from forerun.models.tokenizer import INFILL_MARKERS, NO_INFILL, Tokenizer

PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def coder(tmp_path_factory) -> LLM:
    """The tiny target with a vocabulary that has Qwen2.5-Coder's infill markers."""
    tokenizer = tiny_tokenizer(tmp_path_factory.mktemp("infill-tok"), infill=True)
    return LLM(tiny_model(0, tokenizer, name="target"))


@pytest.fixture(scope="module")
def plain(coder):
    s = Served(coder)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def speculative(coder):
    s = Served(LLM(coder.target, speculative_method="suffix", num_speculative_tokens=4, speculative_k_policy="fixed"))
    yield s
    s.stop()


def marked(ids: list[int], tok: Tokenizer) -> str:
    return tok.decode(ids, skip_special_tokens=False)


# --- the prompt ----------------------------------------------------------------------------------


def test_the_infill_prompt_is_prefix_marker_prefix_suffix_marker_suffix_middle_marker(coder) -> None:
    tok = coder.tokenizer
    assert tok.infill_markers == (TINY_INFILL_VOCAB - 6, TINY_INFILL_VOCAB - 5, TINY_INFILL_VOCAB - 4)
    assert tok.repo_markers == (TINY_INFILL_VOCAB - 2, TINY_INFILL_VOCAB - 1)
    ids = tok.infill(PREFIX, SUFFIX)
    assert marked(ids, tok) == f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    assert ids == [tok.infill_markers[0], *tok.encode(PREFIX), tok.infill_markers[1], *tok.encode(SUFFIX), ids[-1]]
    # a prefix given as token ids is taken as they are
    assert tok.infill(tok.encode(PREFIX), SUFFIX) == ids
    # the padding a filled-in middle may end with stops it, as the end of text does
    assert tok.hf.convert_tokens_to_ids("<|fim_pad|>") in tok.stop_ids


def test_a_vocabulary_without_markers_cannot_fill_in(target_tok) -> None:
    assert target_tok.tokenizer.infill_markers is None
    with pytest.raises(ForerunError, match="no fill-in-the-middle tokens"):
        target_tok.tokenizer.infill(PREFIX, SUFFIX)


class FakeHF:
    """A tokenizer with the given added tokens (ids from 1000) and one id a character; `bos` opens
    every text encoded with special tokens."""

    def __init__(self, added: list[str], bos: int | None = None) -> None:
        self.added_tokens_decoder = {1000 + i: token for i, token in enumerate(added)}
        self.eos_token_id, self.bos_token_id = None, bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        opening = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        return opening + [ord(c) for c in text]


@pytest.mark.parametrize("markers", INFILL_MARKERS)
def test_each_familys_markers_are_found_in_the_order_the_prompt_writes_them(markers) -> None:
    # listed out of order, with other added tokens around them
    tok = Tokenizer(FakeHF(["<|endoftext|>", markers[2], "<x>", markers[0], markers[1]]))
    assert tok.infill_markers == (1003, 1004, 1001)
    assert tok.infill("a", "b") == [1003, ord("a"), 1004, ord("b"), 1001]
    # two of three are not enough
    assert Tokenizer(FakeHF([markers[0], markers[1]])).infill_markers is None


def test_a_tokenizer_that_opens_texts_with_bos_opens_the_infill_prompt_with_it() -> None:
    tok = Tokenizer(FakeHF(list(INFILL_MARKERS[0]), bos=7))
    assert tok.infill("a", "b") == [7, 1000, ord("a"), 1001, ord("b"), 1002]
    assert tok.infill([ord("a")], "b") == [7, 1000, ord("a"), 1001, ord("b"), 1002]


# --- the completions route -----------------------------------------------------------------------


def alone(llm: LLM, ids: list[int], **params) -> str:
    return Engine(llm.target).generate(ids, SamplingParams(**params)).text


@pytest.mark.parametrize("server", ["plain", "speculative"])
def test_a_completion_with_a_suffix_writes_what_the_engine_writes_for_the_infill_prompt(coder, server, request) -> None:
    served = request.getfixturevalue(server)
    ids = coder.tokenizer.infill(PREFIX, SUFFIX)
    want = alone(coder, ids, max_tokens=24)
    body = {"model": NAME, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 24, "temperature": 0}
    whole = post(served, body)
    assert whole["choices"][0]["text"] == want
    assert whole["usage"]["prompt_tokens"] == len(ids)
    assert "".join(c["choices"][0]["text"] for c in stream(served, body)) == want
    # without the suffix it is another prompt, and another answer
    assert post(served, {**body, "suffix": None})["usage"]["prompt_tokens"] == len(coder.tokenizer.encode(PREFIX))


def test_a_batch_of_token_id_prompts_each_fills_the_gap_before_the_one_suffix(coder, plain) -> None:
    tok = coder.tokenizer
    prompts = [tok.encode(PREFIX), tok.encode("x = ")]
    body = {"model": NAME, "prompt": prompts, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0}
    texts = [choice["text"] for choice in sorted(post(plain, body)["choices"], key=lambda c: c["index"])]
    assert texts == [alone(coder, tok.infill(p, SUFFIX), max_tokens=8) for p in prompts]


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"suffix": 3}, "suffix", "must be a string"),
        ({"suffix": ["a"]}, "suffix", "must be a string"),
        ({"suffix": "x", "echo": True}, "echo", "echo cannot be given with suffix"),
        ({"suffix": "\ud800"}, "suffix", "suffix"),
        ({"suffix": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "cannot go with suffix"),
    ],
)
def test_a_bad_suffix_is_a_400_naming_the_field(plain, fields, param, words) -> None:
    body = json.dumps({"model": NAME, "prompt": PREFIX, "max_tokens": 4, **fields})  # a lone surrogate escaped
    r = httpx.post(plain.url + "/v1/completions", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_chat_takes_no_suffix(plain) -> None:
    body = {"model": NAME, "messages": [{"role": "user", "content": "a"}], "suffix": "b", "max_tokens": 4}
    r = httpx.post(plain.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "belongs to /v1/completions" in r.json()["error"]["message"], r.text


@pytest.fixture(scope="module")
def no_markers(target_tok):
    s = Served(LLM(target_tok))
    yield s
    s.stop()


def test_a_model_without_markers_refuses_a_suffix_and_takes_an_empty_one_as_none(target_tok, no_markers) -> None:
    body = {"model": NAME, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4, "temperature": 0}
    r = httpx.post(no_markers.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {**r.json()["error"], "param": "suffix", "message": NO_INFILL}
    empty = post(no_markers, {**body, "suffix": ""})
    assert empty["choices"][0]["text"] == alone(LLM(target_tok), target_tok.tokenizer.encode(PREFIX), max_tokens=4)


def test_an_empty_suffix_on_a_model_with_markers_still_fills_in_before_the_end(coder, plain) -> None:
    body = {"model": NAME, "prompt": PREFIX, "suffix": "", "max_tokens": 4, "temperature": 0}
    assert post(plain, body)["usage"]["prompt_tokens"] == len(coder.tokenizer.infill(PREFIX, ""))


# --- LLM, the command line and the bench ---------------------------------------------------------


def test_llm_takes_a_suffix_in_a_prompt_dict(coder, target_tok) -> None:
    params = SamplingParams(max_tokens=8)
    ids = coder.tokenizer.infill(PREFIX, SUFFIX)
    want = alone(coder, ids, max_tokens=8)
    by_text, by_ids = coder.generate(
        [{"prompt": PREFIX, "suffix": SUFFIX}, {"prompt_token_ids": coder.tokenizer.encode(PREFIX), "suffix": SUFFIX}],
        params,
    )
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids and by_text.text == by_ids.text == want
    with pytest.raises(ForerunError, match='"suffix" is text'):
        coder.generate({"prompt": PREFIX, "suffix": 1}, params)
    with pytest.raises(ForerunError, match="no fill-in-the-middle tokens"):
        LLM(target_tok).generate({"prompt": PREFIX, "suffix": SUFFIX}, params)
    # an empty suffix on such a model is none, as the server takes it
    empty = LLM(target_tok).generate({"prompt": PREFIX, "suffix": ""}, params)[0]
    assert empty.prompt_token_ids == target_tok.tokenizer.encode(PREFIX)


@pytest.fixture(scope="module")
def coder_folder(coder, tmp_path_factory) -> Path:
    return save_hf_folder(coder.target, tmp_path_factory.mktemp("coder"), infill=True)


def test_generate_fills_the_gap_before_suffix_and_a_prompts_files_own(coder, coder_folder, tmp_path, capsys) -> None:
    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps({"prompt": "x = ", "suffix": "\n"}) + "\n" + json.dumps({"prompt": "y"}) + "\n")
    argv = [
        "generate",
        "--model",
        str(coder_folder),
        "--dtype",
        "float32",
        "--quantization",
        "none",
        "--max-tokens",
        "6",
        "--json",
    ]
    assert main([*argv, "--prompt", PREFIX, "--suffix", SUFFIX, "--prompts-file", str(file)]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tok = coder.tokenizer
    lengths = [len(tok.infill(PREFIX, SUFFIX)), len(tok.infill("x = ", "\n")), len(tok.encode("y"))]
    assert [r["num_prompt_tokens"] for r in records] == lengths
    assert records[0]["text"] == alone(coder, tok.infill(PREFIX, SUFFIX), max_tokens=6)
    assert main([*argv, "--chat", "--prompt", PREFIX, "--suffix", SUFFIX]) != 0
    assert "leave out --chat or the suffix" in capsys.readouterr().err


def test_a_bench_prompt_with_a_suffix_is_measured_on_the_infill_prompt(coder, tmp_path) -> None:
    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps({"prompt": PREFIX, "suffix": SUFFIX}) + "\n" + json.dumps({"prompt": "y"}) + "\n")
    prompts = load_prompts(str(file))
    cases = _encode(prompts, coder.target, BenchConfig("tiny", tmp_path, dataset=str(file)), [])
    assert [case.ids for case in cases] == [
        coder.tokenizer.infill(PREFIX, SUFFIX),
        coder.tokenizer.apply_chat([{"role": "user", "content": "y"}]),
    ]
    lines = dict(_settings_lines(BenchConfig("tiny", tmp_path, dataset=str(file)), cases, []))
    assert lines["chat template"] == "yes (the 1 prompts with a suffix: the model's fill-in-the-middle prompt)"
    assert "prediction" not in lines
    file.write_text(json.dumps({"prompt": PREFIX, "suffix": 5}) + "\n")
    with pytest.raises(ForerunError, match="'suffix' must be a string"):
        load_prompts(str(file))
    file.write_text(json.dumps({"prompt": PREFIX, "suffix": "\ud800"}) + "\n")
    with pytest.raises(ForerunError, match="the suffix"):
        load_prompts(str(file))
