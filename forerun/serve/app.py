"""`forerun serve`'s HTTP side: OpenAI's completions and chat routes over the scheduler.

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events ending in
`data: [DONE]`, or whole), GET /v1/models, /health, /metrics (Prometheus text), /openapi.json and
/docs. Fields are OpenAI's (checked in forerun/server_requests.py) plus `top_k` and `ignore_eos`;
`n` samples share the prompt's prefill; `logprobs` are the target's own; with speculation each
choice can carry its speculation figures in vLLM's per-request shape. Anything wrong gets an HTTP
4xx in OpenAI's error shape naming the field, before the engine sees it, and is counted apart from
engine failures. With an API key every route but /health, /openapi.json and /docs wants
`Authorization: Bearer <key>` (unknown routes too, so they reveal nothing without it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.serve.metrics import ServerMetrics
from forerun.serve.requests import (
    BadRequest,
    ChatCompletionRequest,
    Checked,
    ClientGone,
    CompletionRequest,
    Limits,
    check,
    read_json,
    sampling,
    scores_prompt_only,
)
from forerun.serve.responses import Choice, Reply, spec_stats
from forerun.serve.scheduler import (
    Delta,
    EngineStopped,
    Event,
    Failed,
    QueueFull,
    Request,
    Scheduler,
    ShuttingDown,
)

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413)
BODY_TIMEOUT = 30.0  # seconds a request's body may take to arrive (408)
POLL_SECONDS = 0.5  # how often a waiting non-streamed request checks its client is there
SPEC_STATS = ("none", "summary", "detailed")

log = logging.getLogger("forerun.serve.app")


@dataclass
class ServerConfig:
    served_model_name: str
    max_model_len: int  # prompt plus max_tokens may not exceed it
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout: float = BODY_TIMEOUT
    speculative_model: str | None = None  # /v1/models lists it as the served model's speculator
    spec_stats: str = "none"  # per-request speculation figures: none, summary or detailed


def _error_body(exc: BadRequest) -> dict:
    """OpenAI's error shape: a response's body, or a stream's last event."""
    return {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}}


def _refused(exc: BadRequest) -> JSONResponse:
    return JSONResponse(_error_body(exc), status_code=exc.status)


def _schema(model) -> dict:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


def create_app(llm, scheduler: Scheduler, config: ServerConfig, metrics: ServerMetrics) -> FastAPI:
    """The app over a started `scheduler` running `llm`'s engine (llm gives the tokenizer)."""
    if config.spec_stats not in SPEC_STATS:
        raise ForerunError(
            f"per-request speculation figures must be one of {', '.join(SPEC_STATS)}, got {config.spec_stats!r}"
        )
    app = FastAPI(
        title="forerun",
        version="1",
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
        description="OpenAI-compatible completions and chat over forerun's speculative engine.",
    )
    tokenizer = llm.tokenizer
    limits = Limits(config.max_model_len, llm.target.decoder.cfg.vocab_size, config.max_body_bytes)
    created = int(time.time())

    def guard(request: HTTPRequest) -> None:
        """The API key and the body size, checked first on every guarded route. (In the route,
        not an HTTP middleware: a middleware hides a client's disconnect from the route.)"""
        if config.api_key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                raise BadRequest(
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    None,
                    401,
                    "authentication_error",
                    "invalid_api_key",
                )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise BadRequest(
                f"request body of {length} bytes is over the limit of {config.max_body_bytes} bytes", None, 413
            )

    def refusal(request: HTTPRequest) -> Response | None:
        """guard()'s error response, or None when the request may go on."""
        try:
            guard(request)
        except BadRequest as exc:
            metrics.rejected(exc.status)
            return _refused(exc)
        return None

    @app.exception_handler(StarletteHTTPException)
    async def unknown_route(request: HTTPRequest, exc: StarletteHTTPException) -> Response:
        if (denied := refusal(request)) is not None:
            return denied
        metrics.rejected(exc.status_code)
        what = {
            404: f"no route {request.url.path}: see /docs",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return _refused(BadRequest(what, None, exc.status_code))

    @app.exception_handler(Exception)
    async def server_error(request: HTTPRequest, exc: Exception) -> Response:
        log.error("forerun: %s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return _refused(
            BadRequest(f"the server failed on this request: {type(exc).__name__}", None, 500, "server_error")
        )

    @app.get("/health", summary="200 while the engine runs; 503 once it stopped or is shutting down")
    async def health() -> Response:
        if scheduler.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not scheduler.alive:
            return JSONResponse({"status": "engine loop stopped", "detail": scheduler.died}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", summary="the served model (and its speculator)")
    async def models(request: HTTPRequest) -> Response:
        if (denied := refusal(request)) is not None:
            return denied
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": config.served_model_name,
                        "object": "model",
                        "created": created,
                        "owned_by": "forerun",
                        "max_model_len": config.max_model_len,
                        "speculative_model": config.speculative_model,
                    }
                ],
            }
        )

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus(request: HTTPRequest) -> Response:
        if (denied := refusal(request)) is not None:
            return denied
        metrics.set_queue(*scheduler.counts())
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions", summary="OpenAI's completions", openapi_extra=_schema(CompletionRequest))
    async def completions(request: HTTPRequest) -> Response:
        return await _generation(request, chat=False)

    @app.post("/v1/chat/completions", summary="OpenAI's chat completions", openapi_extra=_schema(ChatCompletionRequest))
    async def chat(request: HTTPRequest) -> Response:
        return await _generation(request, chat=True)

    def openapi() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(spec.pop("$defs", {}))
                components[model.__name__] = spec
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    async def _generation(request: HTTPRequest, chat: bool) -> Response:
        try:
            guard(request)
            body = await read_json(request, config.max_body_bytes, config.body_timeout)
            checked = check(body, chat, config.served_model_name, limits)
            # Off the event loop: a long prompt takes seconds to tokenize, and every other client waits.
            prompt_ids = await asyncio.to_thread(_tokenize, checked, tokenizer)
            params = sampling(checked, len(prompt_ids), limits)
            return await _serve(request, checked, prompt_ids, params)
        except BadRequest as exc:
            metrics.rejected(exc.status)
            return _refused(exc)
        except ClientGone:
            return Response(status_code=499)

    async def _serve(
        http: HTTPRequest, checked: Checked, prompt_ids: list[int], params: list[SamplingParams]
    ) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def receiver(index: int):
            def on_event(request: Request, event: Event) -> None:
                loop.call_soon_threadsafe(events.put_nowait, (index, event))

            return on_event

        first = Request(prompt_ids, params[0], receiver(0))
        group = [first] + [Request(prompt_ids, p, receiver(i), like=first) for i, p in enumerate(params[1:], 1)]
        try:
            scheduler.submit_group(group)
        except QueueFull as exc:
            raise BadRequest(str(exc), None, 503, "server_error", "queue_full") from None
        except ShuttingDown as exc:
            raise BadRequest(str(exc), None, 503, "server_error", "shutting_down") from None
        except EngineStopped as exc:
            raise BadRequest(str(exc), None, 503, "server_error", "engine_stopped") from None
        except ForerunError as exc:
            raise BadRequest(str(exc), "max_tokens") from None
        reply = Reply(
            checked,
            config.served_model_name,
            prompt_ids,
            tokenizer,
            prompt_text=_prompt_text(checked, prompt_ids, tokenizer),
        )
        run = _Run(group, events, reply, config.spec_stats, scores_prompt_only(checked))
        if checked.stream:
            return StreamingResponse(_stream(run), media_type="text/event-stream")
        return await _whole(http, run)

    async def _whole(http: HTTPRequest, run: _Run) -> Response:
        checked = time.monotonic()
        try:
            while not run.done:
                try:
                    index, event = await asyncio.wait_for(run.events.get(), POLL_SECONDS)
                except TimeoutError:
                    index, event = -1, None
                # Every POLL_SECONDS, tokens flowing or not: is the client still there?
                if event is None or time.monotonic() - checked >= POLL_SECONDS:
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        return Response(status_code=499)
                if event is None:
                    continue
                if isinstance(event, Failed):
                    return _refused(_failure(event))
                run.take(index, event, metrics)
            return JSONResponse(run.reply.whole(run.choices, run.stats()))
        finally:
            run.cancel()  # a no-op once finished; frees the sequences if we left early

    def _failure(event: Failed) -> BadRequest:
        """The error a failed generation ends with (counted): an engine failure, or a shutdown's cut."""
        if event.reason == "shutdown":
            metrics.aborted()
            return BadRequest(event.message, None, 503, "server_error", "shutting_down")
        metrics.failed()
        return BadRequest(f"generation failed: {event.message}", None, 500, "server_error")

    async def _stream(run: _Run) -> AsyncIterator[str]:
        reply = run.reply
        try:
            for chunk in reply.opening():
                yield _sse(chunk)
            while not run.done:
                index, event = await run.events.get()
                if isinstance(event, Failed):
                    yield _sse(_error_body(_failure(event)))
                    break
                choice = run.take(index, event, metrics)
                chunk = reply.chunk(choice, run.stats_of(choice))
                if chunk is not None:
                    yield _sse(chunk)
            else:
                if run.checked.include_usage:
                    yield _sse(reply.usage_chunk(run.choices, run.stats()))
            yield "data: [DONE]\n\n"
        finally:
            run.cancel()  # the client went away mid-stream: free the sequences

    return app


def _tokenize(checked: Checked, tokenizer) -> list[int]:
    """The prompt's token ids (on a worker thread)."""
    prompt = checked.prompt
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        return list(prompt)
    if tokenizer is None:
        raise BadRequest(
            "this model has no tokenizer: send prompt as a list of token ids to /v1/completions",
            "messages" if checked.chat else "prompt",
        )
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        try:
            ids = tokenizer.apply_chat(prompt)
        except ForerunError as exc:
            raise BadRequest(str(exc), "messages") from None
        except Exception as exc:  # noqa: BLE001 - a template that rejects these turns
            raise BadRequest(f"the chat template rejected these messages: {exc}", "messages") from None
    if not ids:
        raise BadRequest("the prompt encodes to no tokens", "prompt")
    return ids


def _prompt_text(checked: Checked, prompt_ids: list[int], tokenizer) -> str:
    """What `echo` puts before the completion: the prompt as sent (token ids decoded)."""
    if not checked.echo:
        return ""
    if isinstance(checked.prompt, str):
        return checked.prompt
    return tokenizer.decode(prompt_ids) if tokenizer is not None else ""


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class _Run:
    """One HTTP request's samples in flight: their events and what each choice has so far."""

    requests: list[Request]
    events: asyncio.Queue
    reply: Reply
    spec_stats: str
    prompt_only: bool  # echo with max_tokens 0: the generated token is dropped
    choices: list[Choice] = field(init=False)

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(len(self.requests))]

    @property
    def checked(self) -> Checked:
        return self.reply.checked

    @property
    def done(self) -> bool:
        return all(c.output is not None for c in self.choices)

    def take(self, index: int, event: Event, metrics: ServerMetrics) -> Choice:
        """Add `event` (Delta or Done) to its choice."""
        choice = self.choices[index]
        if isinstance(event, Delta):
            if not self.prompt_only:
                choice.add(event)
            if event.prompt_logprobs is not None:
                choice.prompt_logprobs = event.prompt_logprobs
        else:
            metrics.finished(self.requests[index], event.output)
            choice.output = event.output
            if choice.prompt_logprobs is None:
                choice.prompt_logprobs = event.output.prompt_logprobs
            if self.prompt_only:
                choice.finish_reason = "length"
        return choice

    def stats_of(self, choice: Choice) -> dict | None:
        if self.spec_stats == "none" or choice.output is None:
            return None
        return spec_stats(choice.output.metrics, self.spec_stats == "detailed")

    def stats(self) -> list[dict | None]:
        return [self.stats_of(c) for c in self.choices]

    def cancel(self) -> None:
        for r in self.requests:
            r.cancel()
