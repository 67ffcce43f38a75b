"""`forerun serve`'s HTTP side: OpenAI's completions and chat routes over the scheduler.

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events ending in
`data: [DONE]`, or whole), GET /v1/models, /health and /metrics (Prometheus text). Request fields
are OpenAI's (`model, prompt | messages, max_tokens, temperature, top_p, seed, stop, n, stream,
stream_options.include_usage`) plus `top_k`; anything wrong gets HTTP 400 in OpenAI's error shape
naming the field, before the engine sees it. With an API key every route but /health wants
`Authorization: Bearer <key>`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from numbers import Integral, Real
from typing import AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from forerun.config import SamplingParams
from forerun.errors import ForerunError
from forerun.scheduler import Delta, Done, EngineStopped, Event, Failed, QueueFull, Request, Scheduler
from forerun.server_metrics import ServerMetrics

MAX_BODY_BYTES = 4 << 20          # a request body larger than this is refused (413)
POLL_SECONDS = 0.5                # how often a waiting non-streamed request checks its client is there


@dataclass
class ServerConfig:
    served_model_name: str
    max_model_len: int               # prompt plus max_tokens may not exceed it
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def response(self) -> JSONResponse:
        return error_response(self.message, self.param, self.status, self.kind, self.code)


def error_response(message: str, param: str | None = None, status: int = 400,
                   kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def create_app(llm, scheduler: Scheduler, config: ServerConfig, metrics: ServerMetrics) -> FastAPI:
    """The app over a started `scheduler` running `llm`'s engine (llm gives the tokenizer)."""
    app = FastAPI(title="forerun", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = llm.tokenizer
    created = int(time.time())

    def guard(request: HTTPRequest) -> None:
        """The API key and the body size, checked first on every route but /health. (In the route,
        not an HTTP middleware: a middleware hides a client's disconnect from the route.)"""
        if config.api_key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                raise BadRequest("missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 None, 401, "authentication_error", "invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise BadRequest(f"request body of {length} bytes is over the limit of "
                             f"{config.max_body_bytes} bytes", None, 413)

    def refusal(request: HTTPRequest) -> Response | None:
        """guard()'s error response, or None when the request may go on."""
        try:
            guard(request)
        except BadRequest as exc:
            return exc.response()
        return None

    @app.get("/health")
    async def health() -> Response:
        if not scheduler.alive:
            return JSONResponse({"status": "engine loop stopped", "detail": scheduler.died}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: HTTPRequest) -> Response:
        if (denied := refusal(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [
            {"id": config.served_model_name, "object": "model", "created": created, "owned_by": "forerun",
             "max_model_len": config.max_model_len}]})

    @app.get("/metrics")
    async def prometheus(request: HTTPRequest) -> Response:
        if (denied := refusal(request)) is not None:
            return denied
        metrics.set_queue(*scheduler.counts())
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Response:
        return await _generation(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest) -> Response:
        return await _generation(request, chat=True)

    async def _generation(request: HTTPRequest, chat: bool) -> Response:
        try:
            guard(request)
            body = await _read_json(request, config)
            _check_common(body, config)
            prompt_ids = (_chat_prompt if chat else _completion_prompt)(body, tokenizer)
            return await _serve(request, body, prompt_ids, chat=chat)
        except BadRequest as exc:
            return exc.response()

    async def _serve(http: HTTPRequest, body: dict, prompt_ids: list[int], chat: bool) -> Response:
        params = _sampling(body, len(prompt_ids), config)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def on_event(request: Request, event: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        request = Request(prompt_ids, params, on_event)
        try:
            scheduler.submit(request)
        except QueueFull as exc:
            raise BadRequest(str(exc), None, 503, "server_error", "queue_full") from None
        except EngineStopped as exc:
            raise BadRequest(str(exc), None, 503, "server_error", "engine_stopped") from None
        except ForerunError as exc:
            raise BadRequest(str(exc), "max_tokens") from None
        reply = _Reply(chat, config.served_model_name, len(prompt_ids))
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_stream(request, events, reply, include_usage),
                                     media_type="text/event-stream")
        return await _whole(http, request, events, reply)

    async def _whole(http: HTTPRequest, request: Request, events: asyncio.Queue, reply: "_Reply") -> Response:
        pieces: list[str] = []
        checked = time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), POLL_SECONDS)
                except asyncio.TimeoutError:
                    event = None
                # Every POLL_SECONDS, tokens flowing or not: is the client still there?
                if event is None or time.monotonic() - checked >= POLL_SECONDS:
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        request.cancel()
                        return Response(status_code=499)
                if event is None:
                    continue
                if isinstance(event, Delta):
                    pieces.append(event.text)
                elif isinstance(event, Failed):
                    metrics.failed()
                    return error_response(f"generation failed: {event.message}", None, 500, "server_error")
                else:
                    metrics.finished(request, event.output)
                    return JSONResponse(reply.whole("".join(pieces), event.output))
        finally:
            request.cancel()            # a no-op once finished; frees the sequence if we left early

    async def _stream(request: Request, events: asyncio.Queue, reply: "_Reply",
                      include_usage: bool) -> AsyncIterator[str]:
        try:
            if reply.chat:
                yield _sse(reply.chunk(role="assistant"))
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    if event.text:
                        yield _sse(reply.chunk(text=event.text))
                elif isinstance(event, Failed):
                    metrics.failed()
                    yield _sse({"error": {"message": f"generation failed: {event.message}",
                                          "type": "server_error", "param": None, "code": None}})
                    break
                else:
                    metrics.finished(request, event.output)
                    yield _sse(reply.chunk(finish_reason=event.output.finish_reason))
                    if include_usage:
                        yield _sse(reply.usage_chunk(event.output))
                    break
            yield "data: [DONE]\n\n"
        finally:
            request.cancel()            # the client went away mid-stream: free the sequence

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Reply:
    """OpenAI's response and chunk shapes for one request."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int) -> None:
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self, output) -> dict:
        n = len(output.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def whole(self, text: str, output) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": output.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": output.finish_reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(output)}

    def chunk(self, text: str | None = None, role: str | None = None, finish_reason: str | None = None) -> dict:
        if self.chat:
            delta = {}
            if role:
                delta["role"] = role
                delta["content"] = ""
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, output) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage(output)}


# --- reading and checking a request --------------------------------------------------------------


async def _read_json(request: HTTPRequest, config: ServerConfig) -> dict:
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > config.max_body_bytes:
            raise BadRequest(f"request body is over the limit of {config.max_body_bytes} bytes", None, 413)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _check_common(body: dict, config: ServerConfig) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required: the name /v1/models lists", "model")
    if model != config.served_model_name:
        raise BadRequest(f"model {model!r} is not served here; this server serves "
                         f"{config.served_model_name!r}", "model", code="model_not_found")
    n = body.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        raise BadRequest(f"n must be 1 (one completion per request), got {n!r}", "n")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise BadRequest("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object such as {\"include_usage\": true}", "stream_options")


def _completion_prompt(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                    # the client libraries' one-prompt batch
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty: give at least one character", "prompt")
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer: send prompt as a list of token ids", "prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]
    elif isinstance(prompt, list) and not prompt:
        raise BadRequest("prompt is empty: give at least one token", "prompt")
    else:
        raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    if not ids:
        raise BadRequest("prompt encodes to no tokens", "prompt")
    return ids


def _chat_prompt(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role' and a 'content'", "messages")
        content = m.get("content")
        if isinstance(content, list):         # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        turns.append({"role": m["role"], "content": content})
    if tokenizer is None:
        raise BadRequest("this model has no tokenizer, so no chat template: use /v1/completions", "messages")
    try:
        return tokenizer.apply_chat(turns)
    except ForerunError as exc:
        raise BadRequest(str(exc), "messages") from None
    except Exception as exc:                  # noqa: BLE001 - a template that rejects these turns
        raise BadRequest(f"the chat template rejected these messages: {exc}", "messages") from None


def _sampling(body: dict, prompt_tokens: int, config: ServerConfig) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise BadRequest(f"temperature must be >= 0 (0 is greedy), got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _whole(body, "top_k", 0)
    if top_k == -1:
        top_k = 0                             # vLLM's "off"
    if top_k < 0:
        raise BadRequest(f"top_k must be >= 0 (0 or -1 keep every token), got {top_k}", "top_k")
    room = config.max_model_len - prompt_tokens
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _whole(body, name, None)
    if max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise BadRequest(f"{name} must be >= 1, got {max_tokens}", name)
    if prompt_tokens + max_tokens > config.max_model_len:
        raise BadRequest(f"the prompt ({prompt_tokens} tokens) plus {name} ({max_tokens}) is "
                         f"{prompt_tokens + max_tokens} tokens, over this server's context of "
                         f"{config.max_model_len}; shorten the prompt or lower {name}", name)
    seed = _whole(body, "seed", None)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    if any(not s for s in stop):
        raise BadRequest("stop strings must not be empty", "stop")
    try:
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                              stop=tuple(stop), seed=seed)
    except ForerunError as exc:
        raise BadRequest(str(exc), None) from None


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, Real) or isinstance(value, bool) or value != value:
        raise BadRequest(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _whole(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise BadRequest(f"{name} must be a whole number, got {value!r}", name)
    return int(value)
