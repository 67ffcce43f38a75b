"""vLLM's /tokenize and /detokenize over a running server: a prompt's and a chat's token ids are the
ones the generation routes run (their usage counts as many), each token's text on request, ids back
to text, and every bad field, model or key refused in OpenAI's error shape. llama.cpp's bodies on the
same routes (`content`, its pieces), its GET /props and /apply-template, and its names for the
OpenAI routes (without /v1)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from test_server import CONTEXT, NAME, Served
from test_server_api import AUTH, post

import forerun
from forerun.api import LLM
from forerun.models.card import ModelCard
from forerun.models.source import ModelSource
from forerun.serve.responses import model_list

CHAT = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def plain(target_tok):
    s = Served(LLM(target_tok))
    yield s
    s.stop()


def ask(served, path: str, body: dict, status: int = 200, headers: dict | None = None) -> dict:
    r = httpx.post(served.url + path, json=body, headers=AUTH if headers is None else headers, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def test_a_prompts_tokens_are_the_ones_a_completion_runs(plain) -> None:
    tok = plain.llm.tokenizer
    out = ask(plain, "/tokenize", {"model": NAME, "prompt": "abc def"})
    assert out == {"count": 7, "max_model_len": CONTEXT, "tokens": tok.encode("abc def"), "token_strs": None}
    usage = post(plain, {"model": NAME, "prompt": "abc def", "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == out["count"]
    named = ask(plain, "/tokenize", {"prompt": "ab", "return_token_strs": True})  # model may be left out
    assert named["token_strs"] == ["a", "b"] and ask(plain, "/tokenize", {"prompt": "ab", "add_special_tokens": False})[
        "tokens"
    ] == tok.hf.encode("ab", add_special_tokens=False)


def test_a_chats_tokens_are_the_ones_chat_runs(plain) -> None:
    tok = plain.llm.tokenizer
    out = ask(plain, "/tokenize", {"model": NAME, "messages": CHAT, "return_token_strs": True})
    assert out["tokens"] == tok.apply_chat(CHAT) and "".join(out["token_strs"]).endswith("<|im_start|>assistant\n")
    usage = post(plain, {"model": NAME, "messages": CHAT, "max_tokens": 1}, "/v1/chat/completions")["usage"]
    assert usage["prompt_tokens"] == out["count"]
    closed = ask(plain, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert closed["tokens"] == tok.apply_chat(CHAT, add_generation_prompt=False)
    turns = [*CHAT, {"role": "assistant", "content": "hel"}]
    left_open = ask(
        plain, "/tokenize", {"messages": turns, "add_generation_prompt": False, "continue_final_message": True}
    )
    assert tok.decode(left_open["tokens"], skip_special_tokens=False).endswith("assistant\nhel")


def test_detokenize_gives_the_text_special_tokens_and_all(plain) -> None:
    tok = plain.llm.tokenizer
    ids = tok.apply_chat(CHAT)
    text = tok.decode(ids, False)
    assert ask(plain, "/detokenize", {"model": NAME, "tokens": ids}) == {"prompt": text, "content": text}
    assert ask(plain, "/detokenize", {"tokens": tok.encode("abc")})["prompt"] == "abc"
    assert ask(plain, "/detokenize", {"tokens": []})["content"] == ""


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"prompt": "a", "stream": True}, 400, "stream"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "nobody", "content": "a"}]}, 400, "messages"),
        ("/tokenize", {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True}, 400, None),
        ("/tokenize", {"prompt": "x" * (CONTEXT * 16 + 1)}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "tools": []}, 400, "tools"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, True]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "prompt": "a"}, 400, "prompt"),
        ("/tokenize", {"content": 5}, 400, "content"),
        ("/tokenize", {"content": "x" * (CONTEXT * 16 + 1)}, 400, "content"),
        ("/tokenize", {"content": ["a", 1.5]}, 400, "content"),
        ("/tokenize", {"content": [10**6]}, 400, "content"),
        ("/tokenize", {"content": "a", "prompt": "b"}, 400, "prompt"),
        ("/tokenize", {"content": "a", "return_token_strs": True}, 400, "return_token_strs"),
        ("/tokenize", {"content": "a", "with_pieces": "yes"}, 400, "with_pieces"),
        ("/tokenize", {"content": "a", "parse_special": 1}, 400, "parse_special"),
        ("/tokenize", {"prompt": "a", "with_pieces": True}, 400, "with_pieces"),
        ("/tokenize", {"content": "a", "model": "other"}, 404, "model"),
    ],
)
def test_a_bad_token_request_is_refused_naming_the_field(plain, path, body, status, param) -> None:
    error = ask(plain, path, body, status)["error"]
    if param is not None:
        assert error["param"] == param, error
    assert error["message"]


def test_the_token_routes_want_the_key_and_are_in_the_schema(plain) -> None:
    assert ask(plain, "/tokenize", {"prompt": "a"}, 401, headers={})["error"]["code"] == "invalid_api_key"
    assert ask(plain, "/detokenize", {"tokens": [1]}, 401, headers={})["error"]["code"] == "invalid_api_key"
    schema = httpx.get(plain.url + "/openapi.json").json()
    assert {"/tokenize", "/detokenize"} <= set(schema["paths"])
    assert {"prompt", "messages", "return_token_strs"} <= set(
        schema["components"]["schemas"]["TokenizeRequest"]["properties"]
    )


def test_content_is_tokenized_as_llamacpp_tokenizes_it(plain) -> None:
    tok = plain.llm.tokenizer
    own = tok.hf.encode("abc def", add_special_tokens=False)
    assert ask(plain, "/tokenize", {"content": "abc def"}) == {"tokens": own}
    pieces = ask(plain, "/tokenize", {"model": NAME, "content": "abc def", "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == own and "".join(p["piece"] for p in pieces) == "abc def"
    # special tokens' text is read as them unless parse_special is false (then it is text)
    special = tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert ask(plain, "/tokenize", {"content": "<|im_start|>ab"})["tokens"][0] == special
    as_text = ask(plain, "/tokenize", {"content": "<|im_start|>ab", "parse_special": False})["tokens"]
    assert special not in as_text and tok.decode(as_text, False) == "<|im_start|>ab"
    assert ask(plain, "/tokenize", {"content": "<|im_start|>", "with_pieces": True})["tokens"] == [
        {"id": special, "piece": "<|im_start|>"}
    ]
    # texts and ids joined in order; the tokenizer adds no BOS here, asked or not
    mixed = ask(plain, "/tokenize", {"content": ["ab", 5, "c"], "add_special": True})["tokens"]
    assert mixed == [*tok.hf.encode("ab", add_special_tokens=False), 5, *tok.hf.encode("c", add_special_tokens=False)]
    assert ask(plain, "/tokenize", {"content": []}) == {"tokens": []}
    # the other shape's fields left null are fields left out
    assert ask(plain, "/tokenize", {"prompt": "ab", "with_pieces": None})["count"] == 2
    assert ask(plain, "/tokenize", {"content": "ab", "return_token_strs": None})["tokens"] == mixed[:-2]


def test_reading_special_tokens_as_text_leaves_the_shared_tokenizer_alone(plain) -> None:
    """transformers' split_special_tokens is a switch on the backend every thread shares; flipping
    it per call changed other requests' encodings meanwhile (/infill's files, parse_special)."""
    tok = plain.llm.tokenizer
    special = tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert special not in tok.encode_as_text("<|im_start|>ab")
    assert tok.hf.backend_tokenizer.encode_special_tokens is False
    assert tok.hf.encode("<|im_start|>ab", add_special_tokens=False)[0] == special


def test_a_lone_surrogate_in_content_is_refused(plain) -> None:
    for body in ({"content": "a\ud800"}, {"content": ["b", "a\ud800"]}):
        raw = json.dumps(body)  # the lone surrogate as JSON's escape
        r = httpx.post(plain.url + "/tokenize", content=raw, headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "content", r.text


def test_a_piece_that_is_not_whole_utf8_is_its_bytes() -> None:
    from test_token_bytes import _byte_level

    from forerun.serve.requests import Limits
    from forerun.serve.tokens import _llamacpp_tokens

    tok = _byte_level()
    answer = _llamacpp_tokens(tok, {"content": "a🐍", "with_pieces": True}, Limits(64, tok.vocab_size, 1 << 20))
    pieces = json.loads(answer)["tokens"]
    assert pieces[0]["piece"] == "a" and all(isinstance(p["piece"], list) for p in pieces[1:])
    assert bytes(b for p in pieces[1:] for b in p["piece"]) == "🐍".encode()


def test_serve_takes_its_slots_and_model_path_for_props() -> None:
    from forerun.cli import build_parser
    from forerun.commands.serve import server_config

    args = build_parser().parse_args(["serve", "--model", "some/model.gguf", "--max-num-seqs", "3"])
    config = server_config(args, 1024)
    assert (config.max_num_seqs, config.model_path) == (3, "some/model.gguf")


def test_props_answers_as_llamacpp_does(plain) -> None:
    tok = plain.llm.tokenizer
    r = httpx.get(plain.url + "/props", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    props = r.json()
    assert props["default_generation_settings"]["n_ctx"] == CONTEXT
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8  # /completion's default
    assert props["total_slots"] == plain.scheduler.batch.max_seqs and props["model_alias"] == NAME
    assert props["chat_template"] == tok.template_text and props["chat_template"].startswith("{%")
    assert props["eos_token"] == tok.hf.eos_token and props["modalities"]["vision"] is False
    assert props["build_info"] == f"forerun {forerun.__version__}"
    assert props["chat_template_caps"] == tok.template_caps and props["chat_template_caps"]["supports_tools"]
    assert props["model_ftype"] == "" and props["ui"] is False  # a model built in memory has no file type
    assert httpx.get(plain.url + "/props", timeout=30).status_code == 401
    assert "/props" in httpx.get(plain.url + "/openapi.json").json()["paths"]


def test_apply_template_answers_the_text_a_chat_with_that_body_runs(plain) -> None:
    tok = plain.llm.tokenizer
    body = {"messages": CHAT, "temperature": 0.5, "max_tokens": 3}  # a chat body, sampling fields and all
    text = ask(plain, "/apply-template", body)["prompt"]
    assert text == tok.chat_text(CHAT) and text.endswith("<|im_start|>assistant\n")
    assert tok.hf.encode(text, add_special_tokens=False) == ask(plain, "/tokenize", {"messages": CHAT})["tokens"]
    turns = [*CHAT, {"role": "assistant", "content": "hel"}]
    left_open = {"model": NAME, "messages": turns, "add_generation_prompt": False, "continue_final_message": True}
    assert ask(plain, "/apply-template", left_open)["prompt"].endswith("assistant\nhel")
    assert ask(plain, "/apply-template", {"messages": CHAT, "model": "other"}, 404)["error"]["param"] == "model"
    assert ask(plain, "/apply-template", {"prompt": "a"}, 400)["error"]["message"]
    assert ask(plain, "/apply-template", {"messages": CHAT, "tempreature": 1}, 400)["error"]["param"] == "tempreature"
    assert ask(plain, "/apply-template", {"messages": CHAT}, 401, headers={})["error"]["code"] == "invalid_api_key"
    assert ask(plain, "/apply-template", {"messages": CHAT, "model": ""}, 404)["error"]["param"] == "model"
    unfollowable = {"messages": CHAT, "structured_outputs": {"regex": "("}}  # refused as a chat refuses it
    assert (
        ask(plain, "/apply-template", unfollowable, 400)["error"]["message"]
        == ask(plain, "/v1/chat/completions", {**unfollowable, "model": NAME}, 400)["error"]["message"]
    )
    cut = {"messages": CHAT, "truncate_prompt_tokens": 4}
    assert ask(plain, "/apply-template", cut, 400)["error"]["param"] == "truncate_prompt_tokens"
    schema = httpx.get(plain.url + "/openapi.json").json()
    assert "/apply-template" in schema["paths"]
    assert "model" not in schema["components"]["schemas"]["ApplyTemplateRequest"].get("required", [])


def test_apply_template_shows_the_tools_a_chat_sends(plain) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = ask(plain, "/apply-template", {"messages": CHAT, "tools": tools})["prompt"]
    assert "tools: get_weather" in text
    ids = ask(plain, "/tokenize", {"messages": CHAT, "tools": tools})["tokens"]
    assert plain.llm.tokenizer.hf.encode(text, add_special_tokens=False) == ids


def test_the_model_list_carries_llama_servers_ollama_style_entries(plain) -> None:
    listed = httpx.get(plain.url + "/v1/models", headers=AUTH, timeout=30).json()
    assert [m["name"] for m in listed["models"]] == [m["model"] for m in listed["models"]] == [NAME]
    (entry,) = listed["models"]
    assert entry["type"] == "model" and entry["capabilities"] == ["completion"]
    assert entry["details"]["format"] == "" == plain.llm.target.source.file_format  # a model built in memory
    cfg = plain.llm.target.decoder.cfg
    assert listed["data"][0]["meta"] == {
        "vocab_type": 0,
        "n_vocab": cfg.vocab_size,
        "n_ctx": CONTEXT,
        "n_ctx_train": cfg.max_position,
        "n_embd": cfg.hidden_size,
        "n_params": 0,
        "size": 0,
        "ftype": "",
    }
    card = ModelCard("gguf", "Q4_K - Medium", 10, 20, 2, 99, 512, 64)
    both = model_list((NAME, "alias"), 7, 64, None, card)
    assert [m["name"] for m in both["models"]] == [m["id"] for m in both["data"]] == [NAME, "alias"]
    assert {m["details"]["format"] for m in both["models"]} == {"gguf"}
    assert [m["meta"] for m in both["data"]] == [card.meta(64)] * 2 and card.meta(64)["n_params"] == 10
    formats = [ModelSource(kind, Path("."), "m").file_format for kind in ("gguf", "hf", "memory")]
    assert formats == ["gguf", "safetensors", ""]


def test_llamacpps_names_for_the_routes_answer_as_they_do_there(plain) -> None:
    chat = {"model": NAME, "messages": CHAT, "max_tokens": 2, "temperature": 0}
    assert post(plain, chat, "/chat/completions")["choices"] == post(plain, chat, "/v1/chat/completions")["choices"]
    native = {"prompt": "abc", "n_predict": 2, "temperature": 0}  # /completions is its own /completion
    assert post(plain, native, "/completions")["content"] == post(plain, native, "/completion")["content"]
    listed = httpx.get(plain.url + "/models", headers=AUTH, timeout=30)
    assert listed.status_code == 200 and listed.json() == httpx.get(plain.url + "/v1/models", headers=AUTH).json()
    assert httpx.get(plain.url + "/models", timeout=30).status_code == 401
    health = httpx.get(plain.url + "/v1/health", timeout=30)
    assert health.status_code == 200 and health.json() == httpx.get(plain.url + "/health").json()
    assert httpx.head(plain.url + "/v1/health", timeout=30).status_code == 200
    assert not {"/chat/completions", "/completions", "/models"} & set(
        httpx.get(plain.url + "/openapi.json").json()["paths"]
    )


@pytest.mark.parametrize("path", ["/tokenize", "/apply-template", "/v1/responses/input_tokens"])
def test_a_client_that_hangs_up_mid_body_gets_499_and_no_error(plain, path, caplog) -> None:
    # The app itself, called with a body that stops half way and then the client's disconnect.
    app = plain.server.config.app
    events = [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return events.pop(0) if events else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"authorization", AUTH["Authorization"].encode()), (b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}
    scope.update({"http_version": "1.1", "scheme": "http", "root_path": "", "server": ("x", 80)})
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_model_without_a_tokenizer_says_so(target) -> None:
    served = Served(LLM(target))
    try:
        assert "no tokenizer" in ask(served, "/tokenize", {"prompt": "a"}, 400)["error"]["message"]
        assert "no tokenizer" in ask(served, "/detokenize", {"tokens": [1]}, 400)["error"]["message"]
        assert "no tokenizer" in ask(served, "/tokenize", {"content": "a"}, 400)["error"]["message"]
        assert "no tokenizer" in ask(served, "/apply-template", {"messages": CHAT}, 400)["error"]["message"]
        props = httpx.get(served.url + "/props", headers=AUTH, timeout=30).json()
        assert props["chat_template"] == "" and props["bos_token"] == ""
    finally:
        served.stop()


@pytest.fixture(scope="module")
def opens_with_bos(tmp_path_factory):
    """The tiny model with a tokenizer that opens every text with BOS (<|endoftext|>, id 0)."""
    from tokenizers import processors

    from forerun.models.testing import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer(tmp_path_factory.mktemp("bos"))
    tok.hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tok.hf.bos_token = "<|endoftext|>"
    served = Served(LLM(tiny_model(0, tok, name="bos")))
    yield served
    served.stop()


def test_add_special_tokens_puts_bos_before_a_prompt_by_default_and_before_a_chat_when_asked(opens_with_bos) -> None:
    tok = opens_with_bos.llm.tokenizer
    assert tok.opening == [0]
    assert ask(opens_with_bos, "/tokenize", {"prompt": "ab"})["tokens"] == [
        0,
        *tok.hf.encode("ab", add_special_tokens=False),
    ]
    assert ask(opens_with_bos, "/tokenize", {"prompt": "ab", "add_special_tokens": False})["tokens"][0] != 0
    chat = tok.apply_chat(CHAT)
    assert ask(opens_with_bos, "/tokenize", {"messages": CHAT})["tokens"] == chat
    assert ask(opens_with_bos, "/tokenize", {"messages": CHAT, "add_special_tokens": True})["tokens"] == [0, *chat]
    # llama.cpp's body: no BOS unless add_special asks for it, and then only before a text
    bare = tok.hf.encode("ab", add_special_tokens=False)
    assert ask(opens_with_bos, "/tokenize", {"content": "ab"})["tokens"] == bare
    assert ask(opens_with_bos, "/tokenize", {"content": "ab", "add_special": True})["tokens"] == [0, *bare]
    assert ask(opens_with_bos, "/tokenize", {"content": ["ab", 5], "add_special": True})["tokens"] == [0, *bare, 5]
    assert ask(opens_with_bos, "/tokenize", {"content": [5, "ab"], "add_special": True})["tokens"] == [5, *bare]
