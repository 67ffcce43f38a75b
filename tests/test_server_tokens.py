"""vLLM's /tokenize and /detokenize over a running server: a prompt's and a chat's token ids are the
ones the generation routes run (their usage counts as many), each token's text on request, ids back
to text, and every bad field, model or key refused in OpenAI's error shape."""

from __future__ import annotations

import httpx
import pytest
from test_server import CONTEXT, NAME, Served
from test_server_api import AUTH, post

from forerun.api import LLM

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
    assert ask(plain, "/detokenize", {"model": NAME, "tokens": ids}) == {"prompt": tok.decode(ids, False)}
    assert ask(plain, "/detokenize", {"tokens": tok.encode("abc")})["prompt"] == "abc"
    assert ask(plain, "/detokenize", {"tokens": []})["prompt"] == ""


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


def test_a_model_without_a_tokenizer_says_so(target) -> None:
    served = Served(LLM(target))
    try:
        assert "no tokenizer" in ask(served, "/tokenize", {"prompt": "a"}, 400)["error"]["message"]
        assert "no tokenizer" in ask(served, "/detokenize", {"tokens": [1]}, 400)["error"]["message"]
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
