"""llama.cpp's own routes over a running server: /completion and /infill write what /v1/completions
writes for the same tokens and settings (llama.cpp's defaults where a field is left out), /infill
lays its prompt out as llama.cpp's server does (other files under the repository markers, the gap's
sides cut to a batch), answers and streams come in llama.cpp's shape, `response_fields` filters
them, speculation writes the same, and what forerun cannot do is refused by name."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from test_server import CONTEXT, NAME, Served
from test_server_api import AUTH, post

from forerun.api import LLM
from forerun.models.testing import tiny_model, tiny_tokenizer
from forerun.serve import llamacpp_api
from forerun.serve.schemas import LlamaCompletionRequest, LlamaInfillRequest

PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "util.py", "text": "def one():\n    return 1\n"}, {"text": "x = 2\n"}]


@pytest.fixture(scope="module")
def coder(tmp_path_factory) -> LLM:
    """The tiny target with Qwen2.5-Coder's infill and repository markers in its vocabulary."""
    return LLM(tiny_model(0, tiny_tokenizer(tmp_path_factory.mktemp("tok"), infill=True), name="target"))


@pytest.fixture(scope="module")
def servers(coder):
    """(a server of the coder alone, one whose suffix drafter drafts 4 tokens a step)."""
    drafting = LLM(coder.target, speculative_method="suffix", num_speculative_tokens=4, speculative_k_policy="fixed")
    both = Served(coder), Served(drafting)
    yield both
    for s in both:
        s.stop()


@pytest.fixture(scope="module")
def plain(servers):
    return servers[0]


def call(served, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(served.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def chunks(served, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", served.url + path, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert "[DONE]" not in text  # llama.cpp's stream ends with its last chunk
    return [json.loads(block.removeprefix("data: ")) for block in text.strip().split("\n\n")]


def test_the_infill_prompt_is_llama_cpps(coder) -> None:
    tok = coder.tokenizer
    ids = llamacpp_api.translate(
        {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "ret"}, True, NAME, tok, 4096
    ).body["prompt"]
    want = (
        "<|repo_name|>myproject\n<|file_sep|>util.py\ndef one():\n    return 1\n<|file_sep|>tmp\nx = 2\n"
        f"<|file_sep|>filename\n<|fim_prefix|>{PREFIX}ret<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    )
    assert tok.decode(ids, skip_special_tokens=False) == want
    # a vocabulary without the repository markers: each file after llama.cpp's snippet rule
    plainer = copy.copy(tok)
    plainer.__dict__["repo_markers"] = None
    ids = llamacpp_api.translate({"input_prefix": "p", "input_extra": EXTRA[:1]}, True, NAME, plainer, 4096).body[
        "prompt"
    ]
    snippet = "\n\n--- snippet ---\n\ndef one():\n    return 1\n<|fim_prefix|>p<|fim_suffix|><|fim_middle|>"
    assert tok.decode(ids, skip_special_tokens=False) == snippet
    # a marker's text in the code is text, not the marker (the prompt after the prefix is read as llama.cpp reads it)
    marked = llamacpp_api.translate({"input_prefix": "x<|fim_middle|>y"}, True, NAME, tok, 4096).body["prompt"]
    assert marked.count(tok.infill_markers[2]) == 1 and marked[-1] == tok.infill_markers[2]
    # the prefix keeps its last 3/4 of a batch, the suffix its first quarter less the prompt and markers
    long = llamacpp_api.translate(
        {"input_prefix": "a" * 2000, "input_suffix": "b" * 600, "prompt": "cd"}, True, NAME, tok, 8192
    ).body["prompt"]
    text = tok.decode(long, skip_special_tokens=False)
    gap = text.split("<|fim_prefix|>")[1]
    assert gap == "a" * 1536 + "cd<|fim_suffix|>" + "b" * (512 - 2 - 2) + "<|fim_middle|>"  # 2 markers, 2 of prompt
    # the other files get what the context leaves past a batch and twice n_predict
    squeezed = llamacpp_api.translate(
        {"input_prefix": "p", "input_extra": EXTRA, "n_predict": 8}, True, NAME, tok, 2048 + 16 + 10
    ).body["prompt"]
    assert tok.decode(squeezed, skip_special_tokens=False).startswith("<|file_sep|>filename\n<|fim_prefix|>")


def test_an_infill_writes_what_a_completion_of_its_tokens_writes(plain, servers) -> None:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "n_predict": 12, "temperature": 0}
    got = call(plain, "/infill", body)
    tokens = llamacpp_api.translate(body, True, NAME, plain.llm.tokenizer, CONTEXT).body["prompt"]
    llama_defaults = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}
    want = post(plain, {"model": NAME, "prompt": tokens, "max_tokens": 12, "temperature": 0, **llama_defaults})
    assert got["content"] == want["choices"][0]["text"]
    assert got["tokens_predicted"] == want["usage"]["completion_tokens"] and got["tokens_evaluated"] == len(tokens)
    assert got["stop"] is True and got["stop_type"] in ("eos", "limit") and got["model"] == NAME
    assert got["prompt"].endswith("<|fim_middle|>") and got["has_new_line"] == ("\n" in got["content"])
    assert set(got["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"}
    assert call(servers[1], "/infill", body)["content"] == got["content"]  # speculation writes the same
    # llama.cpp's sampling defaults where the request leaves them out: a seeded sample equals one with them given
    seeded = {"prompt": "abc", "n_predict": 10, "seed": 5}
    given = {"model": NAME, "prompt": "abc", "max_tokens": 10, "seed": 5, "temperature": 0.8, **llama_defaults}
    sampled = call(plain, "/completion", seeded)
    assert sampled["content"] == post(plain, given)["choices"][0]["text"]
    settings = sampled["generation_settings"]
    assert (settings["temperature"], settings["top_k"], settings["top_p"], settings["min_p"]) == (0.8, 40, 0.95, 0.05)
    # max_tokens is n_predict's other name, read where n_predict is left out (as llama.cpp reads it)
    assert call(plain, "/completion", {"prompt": "abc", "max_tokens": 3, "ignore_eos": True})["tokens_predicted"] == 3
    both = {"prompt": "abc", "n_predict": 4, "max_tokens": 2, "ignore_eos": True}
    assert call(plain, "/completion", both)["tokens_predicted"] == 4
    # n_predict left out (llama.cpp's -1): to the end of the context
    endless = call(plain, "/completion", {"prompt": "abc", "temperature": 0, "ignore_eos": True})
    assert endless["tokens_predicted"] == CONTEXT - endless["tokens_evaluated"] and endless["stop_type"] == "limit"


@pytest.mark.parametrize("stop", [None, "stop word"])
def test_the_stream_adds_up_to_the_answer_and_ends_with_stop(plain, stop) -> None:
    body = {"prompt": "abc", "n_predict": 30, "temperature": 0, "return_tokens": True}
    if stop:  # a word of the answer ends it: its tokens are written, its text held back
        body["stop"] = [call(plain, "/completion", body)["content"][6:9]]
    whole = call(plain, "/completion", body)
    streamed = chunks(plain, "/completion", body)
    assert all(c["stop"] is False for c in streamed[:-1]) and streamed[-1]["stop"] is True
    assert "".join(c["content"] for c in streamed) == whole["content"]
    assert [t for c in streamed[:-1] for t in c["tokens"]] == whole["tokens"]  # every token, text or not
    assert (streamed[-1]["content"], streamed[-1]["tokens"]) == ("", [])  # the last chunk repeats neither
    for name in ("tokens_predicted", "stop_type", "stopping_word", "has_new_line", "tokens_cached"):
        assert streamed[-1][name] == whole[name], name
    assert whole["stop_type"] == "word" if stop else whole["stop_type"] in ("eos", "limit")


def test_n_probs_gives_each_tokens_probabilities_whole_and_streamed(plain) -> None:
    """llama.cpp's completion_probabilities: each written token's id, text, bytes and logprob and its
    n_probs likeliest alternatives', the target's distribution as completions' logprobs give it."""
    body = {"prompt": "abc", "n_predict": 6, "temperature": 0, "n_probs": 3, "return_tokens": True}
    whole = call(plain, "/completion", body)
    probs = whole["completion_probabilities"]
    assert [p["id"] for p in probs] == whole["tokens"] and "".join(p["token"] for p in probs) == whole["content"]
    want = post(plain, {"model": NAME, "prompt": "abc", "max_tokens": 6, "temperature": 0, "logprobs": 3})
    want = want["choices"][0]["logprobs"]
    assert [p["logprob"] for p in probs] == want["token_logprobs"]
    for p, top in zip(probs, want["top_logprobs"]):
        assert len(p["top_logprobs"]) == 3 and {t["token"]: t["logprob"] for t in p["top_logprobs"]} == top
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the chosen token is the likeliest
        assert all(bytes(t["bytes"]).decode() == t["token"] for t in [p, *p["top_logprobs"]])
    streamed = chunks(plain, "/completion", body)
    assert [p for c in streamed[:-1] for p in c["completion_probabilities"]] == probs
    assert "completion_probabilities" not in streamed[-1]  # as llama.cpp: the last chunk repeats none
    assert "completion_probabilities" not in call(plain, "/completion", {**body, "n_probs": 0})
    warm = call(plain, "/completion", {**body, "n_predict": 0})  # nothing written: nothing to score
    assert warm["tokens_predicted"] == 0 and "completion_probabilities" not in warm


def test_n_probs_gives_a_character_split_over_tokens_one_entry_as_llama_cpp_does() -> None:
    """A token that leaves a character unfinished gets no entry; the next token's carries the whole
    character's text and bytes, whole and across streamed chunks; an alternative that is part of a
    character shows it as U+FFFD (llama.cpp's validate_utf8 keeps only whole characters)."""
    from types import SimpleNamespace

    pieces = {1: b"a", 2: "é".encode()[:1], 3: "é".encode()[1:], 4: "😀".encode()[:2], 5: "😀".encode()[2:]}
    tokenizer = SimpleNamespace(token_bytes=lambda t: pieces[t])

    def entry(token: int) -> SimpleNamespace:
        return SimpleNamespace(token_id=token, logprob=-0.5, top=[(token, -0.5), (3, -2.0)])

    def read(entries, stream=None) -> list[tuple[int, str, bytes]]:
        got = translated._probabilities(entries, stream).get("completion_probabilities", [])
        return [(p["id"], p["token"], bytes(p["bytes"])) for p in got]

    translated = llamacpp_api.Translated({}, {}, False, [], tokenizer)
    whole = read([entry(t) for t in (1, 2, 3, 4, 5)])
    assert whole == [(1, "a", b"a"), (3, "é", "é".encode()), (5, "😀", "😀".encode())]
    streamed = read([entry(1), entry(2)], 0) + read([entry(3), entry(4)], 0) + read([entry(5)], 0)
    assert streamed == whole and translated.held == {}
    alternative = translated._probabilities([entry(1)], None)["completion_probabilities"][0]["top_logprobs"][1]
    assert (alternative["token"], alternative["bytes"]) == ("\ufffd", list("é".encode()[1:]))


def test_stops_response_fields_and_cache_warming(plain) -> None:
    words = call(plain, "/completion", {"prompt": "abc", "n_predict": 40, "temperature": 0})["content"]
    word = words[3:5]
    cut = call(plain, "/completion", {"prompt": "abc", "n_predict": 40, "temperature": 0, "stop": [word]})
    assert (cut["stop_type"], cut["stopping_word"], cut["content"]) == ("word", word, words[: words.index(word)])
    fields = ["content", "timings/predicted_n", "timings/nothing", "stop_type"]
    few = call(plain, "/completion", {"prompt": "abc", "n_predict": 3, "ignore_eos": True, "response_fields": fields})
    assert set(few) == {"content", "timings/predicted_n", "stop_type"} and few["timings/predicted_n"] == 3
    warm = call(plain, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 0})
    assert (warm["content"], warm["tokens_predicted"], warm["stop_type"]) == ("", 0, "none")
    # n_predict past the context stops at its end, as llama.cpp does; a null field is one left out
    endless = call(plain, "/completion", {"prompt": "abc", "n_predict": 100000, "ignore_eos": True, "temperature": 0})
    assert endless["tokens_predicted"] == CONTEXT - 3 and endless["stop_type"] == "limit"
    nulls = call(plain, "/completion", {"prompt": "abc", "n_predict": 2, "temperature": None, "seed": None})
    assert nulls["generation_settings"]["temperature"] == 0.8
    # samplers left out of `samplers` are off, as in llama.cpp
    listed = call(plain, "/completion", {"prompt": "abc", "n_predict": 2, "samplers": ["top_k", "infill"]})
    settings = listed["generation_settings"]
    assert (settings["temperature"], settings["top_k"], settings["top_p"], settings["min_p"]) == (1.0, 40, 1.0, 0.0)
    # several completions: llama.cpp's list, one answer each
    many = call(plain, "/completion", {"prompt": "abc", "n_predict": 3, "n_cmpl": 3, "seed": 4, "ignore_eos": True})
    assert [a["index"] for a in many] == [0, 1, 2] and all(a["tokens_predicted"] == 3 for a in many)
    assert len(chunks(plain, "/completion", {"prompt": "abc", "n_predict": 3, "n_cmpl": 2})) >= 2
    # what llama.vim sends beside the gap is taken
    vim = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4, "samplers": ["top_k", "top_p", "infill"]}
    vim["ignore_eos"] = True  # sampled at llama.cpp's temperature: no early end
    vim |= {"cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 250, "n_indent": 4, "id_slot": -1}
    vim |= {"model": "", "top_k": 40, "top_p": 0.9, "input_extra": EXTRA, "prompt": "", "response_fields": ["content"]}
    assert set(call(plain, "/infill", vim)) == {"content"}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/completion", {"prompt": "a", "grammar": "root ::= x"}, "grammar"),
        ("/completion", {"prompt": "a", "n_probs": -1}, "n_probs"),
        ("/completion", {"prompt": "a", "n_predict": 0, "n_probs": "x"}, "n_probs"),
        ("/completion", {"prompt": "a", "n_probs": 10**6}, "n_probs"),
        ("/completion", {"prompt": "a", "n_probs": 2, "post_sampling_probs": True}, "post_sampling_probs"),
        ("/completion", {"prompt": "a", "repeat_penalty": 1.1}, "repeat_penalty"),
        ("/completion", {"prompt": "a", "mirostat": 2}, "mirostat"),
        ("/completion", {"prompt": ["a", "b"]}, "prompt"),
        ("/completion", {"prompt": "a", "n_predict": -2}, "n_predict"),
        ("/completion", {"prompt": "a", "response_fields": "content"}, "response_fields"),
        ("/completion", {"prompt": "a", "logit_bias": [["9" * 5000, 1]]}, "logit_bias"),
        ("/completion", {"prompt": "a", "json_schema": {"type": "nothing"}}, "json_schema"),
        ("/completion", {"prompt": "a", "samplers": "kpt"}, "samplers"),
        ("/completion", {"prompt": "a", "n_cmpl": 0}, "n_cmpl"),
        ("/completion", {"prompt": "a", "logit_bias": [["a", 1]]}, "logit_bias"),
        ("/completion", {"prompt": "a", "input_prefix": "x"}, "input_prefix"),
        ("/completion", {"prompt": "a", "temperature": -1}, "temperature"),
        ("/infill", {"input_prefix": 3}, "input_prefix"),
        ("/infill", {"input_prefix": "a", "input_extra": [{"filename": "x"}]}, "input_extra"),
        ("/infill", {"input_prefix": "a", "input_extra": "x"}, "input_extra"),
    ],
)
def test_what_cannot_be_done_is_refused_by_llama_cpps_name(plain, path, body, param) -> None:
    assert call(plain, path, body, 400)["error"]["param"] == param


def test_a_lone_surrogate_is_refused_naming_its_field(plain) -> None:
    for path, field in (("/infill", "input_prefix"), ("/infill", "input_suffix"), ("/completion", "prompt")):
        body = {field: "a\ud800b", "prompt": "x"} if field != "prompt" else {field: "a\ud800b"}
        raw = json.dumps(body)  # the lone surrogate as JSON's escape
        r = httpx.post(plain.url + path, content=raw, headers={**AUTH, "content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_model_without_infill_markers_refuses_infill(target_tok) -> None:
    s = Served(LLM(target_tok))
    try:
        error = call(s, "/infill", {"input_prefix": "a", "input_suffix": "b"}, 400)["error"]
        assert "fill-in-the-middle" in error["message"]
        body = {"prompt": "ab", "n_predict": 2, "ignore_eos": True, "logit_bias": [[5, False]]}
        assert call(s, "/completion", body)["tokens_predicted"] == 2
    finally:
        s.stop()


def test_the_schemas_list_the_fields_the_routes_take() -> None:
    assert set(LlamaCompletionRequest.model_fields) == llamacpp_api.fields(False)
    assert set(LlamaInfillRequest.model_fields) == llamacpp_api.fields(True)
