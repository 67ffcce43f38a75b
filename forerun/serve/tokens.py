"""vLLM's /tokenize and /detokenize: a prompt's or a chat's token ids as the server would run them
(and each token's text), and the text of token ids, with the served model's tokenizer.

/tokenize takes `prompt` (text) or `messages` (with `add_generation_prompt`,
`continue_final_message`, `tools` and `chat_template_kwargs`, as chat takes them),
`add_special_tokens` (default true for a prompt, false for messages, as in vLLM) and
`return_token_strs`; it answers `count`, `max_model_len`, `tokens` and `token_strs` (null unless
asked). /detokenize takes `tokens` and answers `prompt`, special tokens' text included. `model` may
be left out; given, it must be the served one. The fields are checked as the generation routes
check them (`requests.check`), so a prompt that tokenizes here is the prompt a completion would
run, and tokenizing runs on a worker thread, off the event loop. Anthropic's
/v1/messages/count_tokens counts the prompt a Messages request would run the same way
(`count_tokens_route`), answering `input_tokens` and refusing in Anthropic's shape.
"""

from __future__ import annotations

import asyncio

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from forerun.base.errors import ForerunError
from forerun.base.prompts import in_vocabulary
from forerun.serve import messages_api
from forerun.serve.requests import BadRequest, check, flag, not_served, read_json, shown, tokenize
from forerun.serve.responses import refused
from forerun.serve.state import ServerState

CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs")  # messages' alone
FORWARDED = ("prompt", "messages", *CHAT_ONLY)  # handed on to the generation routes' checks
TOKENIZE_FIELDS = ("model", *FORWARDED, "add_special_tokens", "return_token_strs")
DETOKENIZE_FIELDS = ("model", "tokens")
NO_TOKENIZER = "this model has no tokenizer: its prompts and answers are token ids already"


async def tokenize_route(state: ServerState, http: HTTPRequest) -> Response:
    """/tokenize: the prompt's or the messages' token ids."""
    try:
        body = await _body(state, http, TOKENIZE_FIELDS)
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
        return JSONResponse({"prompt": text})
    except BadRequest as exc:
        state.metrics.rejected(exc.status)
        return refused(exc)


async def _body(state: ServerState, http: HTTPRequest, fields: tuple[str, ...]) -> dict:
    """The request's body, its key checked, no field but `fields`, the served model if one is named,
    and a model with a tokenizer."""
    state.check_access(http)
    body = await read_json(http, state.config.max_body_bytes, state.config.body_timeout)
    for name in body:
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
