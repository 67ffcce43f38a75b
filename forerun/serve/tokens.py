"""/tokenize and /detokenize, vLLM's and llama.cpp's: a prompt's or a chat's token ids as the server
would run them (and each token's text), and the text of token ids, with the served model's tokenizer;
llama.cpp's /apply-template, a chat's prompt as text.

/tokenize takes `prompt` (text) or `messages` (with `add_generation_prompt`,
`continue_final_message`, `tools` and `chat_template_kwargs`, as chat takes them),
`add_special_tokens` (default true for a prompt, false for messages, as in vLLM) and
`return_token_strs`; it answers `count`, `max_model_len`, `tokens` and `token_strs` (null unless
asked). /detokenize takes `tokens` and answers `prompt`, special tokens' text included. `model` may
be left out; given, it must be the served one. The fields are checked as the generation routes
check them (`requests.check`), so a prompt that tokenizes here is the prompt a completion would
run, and tokenizing runs on a worker thread, off the event loop. Anthropic's
/v1/messages/count_tokens counts the prompt a Messages request would run the same way
(`count_tokens_route`), answering `input_tokens` and refusing in Anthropic's shape; OpenAI's
/v1/responses/input_tokens and llama.cpp's /v1/chat/completions/input_tokens count the prompt a
Responses or chat request with that body would run (`input_tokens_route`: `model` may be left out,
the rest checked as the request's), answering `{"object": "response.input_tokens", "input_tokens": n}`.

A /tokenize body with `content` is llama.cpp's: `content` (text, or a list of texts and token ids,
joined in order), `add_special` (BOS where the model has one, before a content that starts with
text; default false), `parse_special` (special tokens' text read as those tokens; default true) and
`with_pieces`; it answers `tokens`, the ids or, with pieces, `{"id", "piece"}` each, a piece that
is not whole UTF-8 given as its byte values, as llama.cpp's server does. The two shapes' fields do
not mix (a null one is left out). /detokenize answers llama.cpp's `content` beside vLLM's `prompt`.

llama.cpp's /apply-template takes a chat request's body (its sampling fields checked and left
unused; `model` may be left out; no `truncate_prompt_tokens`) and answers `prompt`: the text of the
messages in the chat template, the text a chat request with that body would template, after the
checks its tokenizing makes (tools, structured outputs).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from forerun.base.config import is_whole
from forerun.base.errors import ForerunError
from forerun.base.prompts import in_vocabulary
from forerun.models.tokenizer import Tokenizer
from forerun.serve import messages_api, responses_api
from forerun.serve.requests import (
    BadRequest,
    Limits,
    chat_text,
    check,
    flag,
    not_served,
    read_json,
    shown,
    text,
    tokenize,
)
from forerun.serve.responses import refused
from forerun.serve.state import ServerState

CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs")  # messages' alone
FORWARDED = ("prompt", "messages", *CHAT_ONLY)  # handed on to the generation routes' checks
TOKENIZE_FIELDS = ("model", *FORWARDED, "add_special_tokens", "return_token_strs")
LLAMACPP_FIELDS = ("model", "content", "add_special", "parse_special", "with_pieces")  # llama.cpp's /tokenize
LLAMACPP_NAMES = {  # what a vLLM body says instead of each llama.cpp field
    "content": "send prompt or messages, not both",
    "add_special": "with prompt or messages it is add_special_tokens",
    "parse_special": "prompt and messages read special tokens' text as those tokens",
    "with_pieces": "with prompt or messages it is return_token_strs",
}
DETOKENIZE_FIELDS = ("model", "tokens")
NO_TOKENIZER = "this model has no tokenizer: its prompts and answers are token ids already"


async def tokenize_route(state: ServerState, http: HTTPRequest) -> Response:
    """/tokenize: the prompt's or the messages' token ids (vLLM's), or llama.cpp's content's."""
    try:
        body = await _body(state, http, tuple(dict.fromkeys(TOKENIZE_FIELDS + LLAMACPP_FIELDS)))
        if body.get("content") is not None:
            answer = await asyncio.to_thread(_llamacpp_tokens, state.tokenizer, body, state.limits)
            return Response(answer, media_type="application/json")  # made on the worker thread: it may be long
        if stray := _stray(body, TOKENIZE_FIELDS):
            raise BadRequest(f"{stray} is llama.cpp's, for a body with content; {LLAMACPP_NAMES[stray]}", stray)
        ids = await _token_ids(state, body)
        pieces = state.tokenizer.piece
        strs = await asyncio.to_thread(lambda: [pieces(t) for t in ids]) if flag(body, "return_token_strs") else None
        return JSONResponse(
            {"count": len(ids), "max_model_len": state.config.max_model_len, "tokens": ids, "token_strs": strs}
        )
    except BadRequest as exc:
        state.metrics.rejected(exc.status)
        return refused(exc)


async def count_tokens_route(state: ServerState, http: HTTPRequest) -> Response:
    """Anthropic's /v1/messages/count_tokens: the tokens of the prompt a Messages request runs."""
    try:
        body = await _body(state, http, tuple(messages_api.COUNT_FIELDS))
        chat = messages_api.count_body(body)
        named = state.config.served_model_name
        check({**chat, "model": named}, True, (named,), state.limits)  # tool_choice, output_config: as a request's
        ids = await _token_ids(state, {name: value for name, value in chat.items() if name in FORWARDED})
        return JSONResponse({"input_tokens": len(ids)})
    except BadRequest as exc:
        state.metrics.rejected(exc.status)
        return messages_api.refused(messages_api.renamed(exc))


async def input_tokens_route(state: ServerState, http: HTTPRequest, responses: bool) -> Response:
    """The tokens of the prompt a chat request (`responses`: a Responses request) with this body runs."""
    reader = None
    try:
        body = {**await _body(state, http, None), "model": state.config.served_model_name}  # a given one checked
        if responses:
            reader = responses_api.translate(body, state.responses)
            body = reader.body
        checked = check(body, True, state.config.model_names, state.limits)
        ids = (await asyncio.to_thread(tokenize, checked, state.tokenizer, state.limits))[0]
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})
    except BadRequest as exc:
        state.metrics.rejected(exc.status)
        return refused(reader.renamed(exc) if reader is not None else exc)


async def detokenize_route(state: ServerState, http: HTTPRequest) -> Response:
    """/detokenize: the text of token ids."""
    try:
        body = await _body(state, http, DETOKENIZE_FIELDS)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise BadRequest(f"tokens must be a list of token ids, got {shown(tokens)}", "tokens")
        try:
            tokens = in_vocabulary(tokens, state.limits.vocab_size)
        except ForerunError as exc:
            raise BadRequest(str(exc), "tokens") from None
        text = await asyncio.to_thread(state.tokenizer.decode, tokens, False)
        return JSONResponse({"prompt": text, "content": text})  # vLLM's name and llama.cpp's
    except BadRequest as exc:
        state.metrics.rejected(exc.status)
        return refused(exc)


async def apply_template_route(state: ServerState, http: HTTPRequest) -> Response:
    """llama.cpp's /apply-template: the text a chat request with this body would run."""
    try:
        body = await _body(state, http, None)  # a chat body: `check` knows its fields
        config = state.config
        checked = check({**body, "model": config.served_model_name}, True, config.model_names, state.limits)
        return JSONResponse({"prompt": await asyncio.to_thread(chat_text, checked, state.tokenizer, state.limits)})
    except BadRequest as exc:
        state.metrics.rejected(exc.status)
        return refused(exc)


async def _body(state: ServerState, http: HTTPRequest, fields: tuple[str, ...] | None) -> dict:
    """The request's body, its key checked, no field but `fields` (None: the route's own checks know
    them), the served model if one is named, and a model with a tokenizer."""
    state.check_access(http)
    body = await read_json(http, state.config.max_body_bytes, state.config.body_timeout)
    for name in body if fields is not None else ():
        if name not in fields:
            raise BadRequest(f"unknown field {shown(name)}: this route takes {', '.join(fields)}", name)
    model = body.get("model")
    if model is not None and model not in state.config.model_names:
        raise not_served(model, state.config.model_names)
    if state.tokenizer is None:
        raise BadRequest(NO_TOKENIZER, None)
    return body


async def _token_ids(state: ServerState, body: dict) -> list[int]:
    """The ids the generation routes would run for this prompt or these messages."""
    chat = body.get("messages") is not None
    if chat and body.get("prompt") is not None:
        raise BadRequest("give prompt or messages, not both", "prompt")
    if not chat and not isinstance(body.get("prompt"), str):
        raise BadRequest(f"prompt must be text (or send messages), got {shown(body.get('prompt'))}", "prompt")
    stray = next((name for name in CHAT_ONLY if not chat and body.get(name) is not None), None)
    if stray is not None:
        raise BadRequest(f"{stray} goes with messages, not a prompt", stray)
    named = state.config.served_model_name
    given = {name: body[name] for name in FORWARDED if body.get(name) is not None}
    checked = check({**given, "model": named}, chat, (named,), state.limits)
    special = flag(body, "add_special_tokens") if body.get("add_special_tokens") is not None else not chat
    tokenizer = state.tokenizer
    if not chat and not special:
        return await asyncio.to_thread(tokenizer.hf.encode, body["prompt"], add_special_tokens=False)
    ids = (await asyncio.to_thread(tokenize, checked, tokenizer, state.limits))[0]
    return [*tokenizer.opening, *ids] if chat and special else ids


def _llamacpp_tokens(tokenizer: Tokenizer, body: dict, limits: Limits) -> bytes:
    """llama.cpp's /tokenize answer for `body` (its `content`, `add_special`, `parse_special`,
    `with_pieces`), as JSON: the ids, or each id with its piece. BOS (where the model has one) only
    before a content that starts with text, as llama.cpp's `tokenize_mixed` puts it."""
    if stray := _stray(body, LLAMACPP_FIELDS):
        raise BadRequest(
            f"{stray} is vLLM's: send content (llama.cpp's) or prompt or messages (vLLM's), not both", stray
        )
    content = body["content"]
    parts = content if isinstance(content, list) else [content]
    if not isinstance(content, (str, list)) or not all(isinstance(part, str) or is_whole(part) for part in parts):
        raise BadRequest(f"content must be text or a list of texts and token ids, got {shown(content)}", "content")
    if sum(len(part) for part in parts if isinstance(part, str)) > limits.max_prompt_chars:
        raise BadRequest(f"content is longer than {limits.max_prompt_chars} characters", "content")
    split = body.get("parse_special") is not None and not flag(body, "parse_special")
    ids = list(tokenizer.opening) if flag(body, "add_special") and parts and isinstance(parts[0], str) else []
    for part in parts:
        if not isinstance(part, str):
            ids.append(int(part))
        elif split:
            ids += tokenizer.encode_as_text(text(part, "content", limits.max_prompt_chars))
        else:
            ids += tokenizer.hf.encode(text(part, "content", limits.max_prompt_chars), add_special_tokens=False)
    try:
        ids = in_vocabulary(ids, limits.vocab_size)
    except ForerunError as exc:
        raise BadRequest(str(exc), "content") from None
    if flag(body, "with_pieces"):
        return json.dumps({"tokens": [{"id": t, "piece": _piece(tokenizer.token_bytes(t))} for t in ids]}).encode()
    return json.dumps({"tokens": ids}).encode()


def _piece(raw: bytes) -> str | list[int]:
    """A token's piece as llama.cpp gives it: its text where its bytes are whole UTF-8, else the bytes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _stray(body: dict, fields: tuple[str, ...]) -> str | None:
    """The first field of `body` given (not null) that is not one of `fields`."""
    return next((name for name in body if name not in fields and body[name] is not None), None)
