"""`forerun serve`'s HTTP app: OpenAI's completions, chat and Responses routes, Anthropic's Messages route and
llama.cpp's, wired.

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events ending in
`data: [DONE]`, or whole), POST /v1/responses (OpenAI's Responses API read as a chat request:
forerun/serve/responses_api.py; GET and DELETE /v1/responses/{id} for the stored ones), POST
/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API read as a chat request, its
errors in Anthropic's shape: forerun/serve/messages_api.py), POST /v1/responses/input_tokens and
/v1/chat/completions/input_tokens (the prompt's tokens counted), POST /completion and /infill
(llama.cpp's own, read as completions: forerun/serve/llamacpp_api.py), GET /props and /slots (llama.cpp's),
POST /tokenize and /detokenize (vLLM's, and llama.cpp's shape), POST /apply-template (llama.cpp's),
GET /v1/models and /v1/models/{id}, /health, /metrics (Prometheus text), /version (vLLM's),
/openapi.json and /docs; llama.cpp's and vLLM's names for some of them, out of the schema (POST
/chat/completions, /responses, both routes' /input_tokens, /completions as its /completion, GET
/models, /v1/health, GET and POST /ping). Fields are OpenAI's (checked in forerun/serve/requests.py)
plus vLLM's (`top_k`, `ignore_eos`, ...); `n` samples share the prompt's prefill; `logprobs` are the
target's own; with speculation each choice can carry its speculation figures in vLLM's per-request
shape. Anything wrong gets an HTTP 4xx in OpenAI's error shape naming the field, before the engine
sees it, and is counted apart from engine failures. With an API key every route but /health (and
/v1/health, /ping), /openapi.json and /docs wants `Authorization: Bearer <key>` or `x-api-key: <key>`
(unknown routes too, so they reveal nothing without it).

This module only wires: the handlers here are thin, the generation routes' work is in
forerun/serve/generation.py, the token routes' in forerun/serve/tokens.py, the state they share in
forerun/serve/state.py.
"""

from __future__ import annotations

import logging
from functools import partial

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from forerun.models.card import model_card
from forerun.serve import llamacpp_api, messages_api
from forerun.serve.backend import LocalBackend
from forerun.serve.generation import CLIENT_GONE, generation
from forerun.serve.metrics import ServerMetrics
from forerun.serve.requests import BadRequest, ClientGone, not_served
from forerun.serve.responses import model_list, refused
from forerun.serve.scheduler import Scheduler
from forerun.serve.schemas import (
    ApplyTemplateRequest,
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    DetokenizeRequest,
    LlamaCompletionRequest,
    LlamaInfillRequest,
    MessagesRequest,
    ResponsesRequest,
    TokenizeRequest,
    openapi_schema,
    request_body,
)
from forerun.serve.state import ServerConfig, ServerState
from forerun.serve.tokens import (
    apply_template_route,
    count_tokens_route,
    detokenize_route,
    input_tokens_route,
    tokenize_route,
)

log = logging.getLogger("forerun.serve.app")


def create_app(llm, scheduler: Scheduler, config: ServerConfig, metrics: ServerMetrics) -> FastAPI:
    """The app over a started `scheduler` running `llm`'s engine (llm gives the tokenizer)."""
    backend = LocalBackend(scheduler, metrics)
    cfg = llm.target.decoder.cfg
    card = model_card(llm.target.source, cfg)
    return app_for(ServerState.build(llm.tokenizer, cfg.vocab_size, backend, config, metrics, card))


def app_for(state: ServerState) -> FastAPI:
    """The app over `state`, whichever backend runs its requests."""
    routes = _Routes(state)
    app = FastAPI(
        title="forerun",
        version="1",
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
        description="OpenAI-compatible completions and chat over forerun's speculative engine.",
    )
    app.add_exception_handler(StarletteHTTPException, routes.unknown_route)
    app.add_exception_handler(Exception, routes.server_error)
    app.add_exception_handler(ClientGone, routes.client_gone)
    summary = "200 while the engine runs; 503 once it stopped or is shutting down"
    app.add_api_route("/health", routes.health, methods=["GET"], summary=summary)
    app.add_api_route("/health", routes.health, methods=["HEAD"], include_in_schema=False)  # load balancers' probes
    app.add_api_route("/version", routes.version, methods=["GET"], summary="vLLM's: forerun's version")
    app.add_api_route("/v1/models", routes.models, methods=["GET"], summary="the served model (and its speculator)")
    app.add_api_route("/v1/models/{model:path}", routes.model, methods=["GET"], summary="one served model, by id")
    app.add_api_route("/metrics", routes.prometheus, methods=["GET"], summary="Prometheus metrics")
    props = "llama.cpp's: the server's context, slots, defaults, model and chat template"
    app.add_api_route("/props", routes.props, methods=["GET"], summary=props)
    slots = "llama.cpp's: each slot (a lane of the batch) and the request it runs"
    app.add_api_route("/slots", routes.slots, methods=["GET"], summary=slots)
    app.add_api_route("/slots/{slot_id}", routes.slot_action, methods=["POST"], include_in_schema=False)
    stored = "a stored Responses API response"
    app.add_api_route("/v1/responses/{response_id}", routes.stored_response, methods=["GET"], summary=stored)
    app.add_api_route("/v1/responses/{response_id}", routes.forget_response, methods=["DELETE"], summary=stored)
    for path, handler, said, body in _posted(routes):
        app.add_api_route(path, handler, methods=["POST"], summary=said, openapi_extra=request_body(body))
    _llamacpp_names(app, routes)
    app.openapi = partial(openapi_schema, app)
    return app


def _posted(routes: _Routes) -> tuple:
    """The POST routes in the schema: (path, handler, summary, request body model) each."""
    return (
        ("/v1/completions", routes.completions, "OpenAI's completions", CompletionRequest),
        ("/v1/chat/completions", routes.chat, "OpenAI's chat completions", ChatCompletionRequest),
        (
            "/v1/responses",
            routes.responses,
            "OpenAI's Responses API: text, function tools, structured outputs",
            ResponsesRequest,
        ),
        (
            "/v1/responses/input_tokens",
            routes.responses_input_tokens,
            "OpenAI's: the tokens of the prompt a Responses request runs",
            ResponsesRequest,
        ),
        (
            "/v1/chat/completions/input_tokens",
            routes.chat_input_tokens,
            "llama.cpp's: the tokens of the prompt a chat request runs",
            ChatCompletionRequest,
        ),
        ("/v1/messages", routes.messages, "Anthropic's Messages API: text, tools, thinking", MessagesRequest),
        (
            "/v1/messages/count_tokens",
            routes.count_tokens,
            "Anthropic's: the tokens of the prompt a Messages request runs",
            CountTokensRequest,
        ),
        ("/completion", routes.llamacpp_completion, "llama.cpp's own completion route", LlamaCompletionRequest),
        ("/infill", routes.llamacpp_infill, "llama.cpp's code infilling (fill in the middle)", LlamaInfillRequest),
        ("/tokenize", routes.tokenize, "vLLM's: a prompt's or a chat's token ids", TokenizeRequest),
        ("/detokenize", routes.detokenize, "vLLM's: the text of token ids", DetokenizeRequest),
        ("/apply-template", routes.apply_template, "llama.cpp's: a chat request's prompt text", ApplyTemplateRequest),
    )


def _llamacpp_names(app: FastAPI, routes: _Routes) -> None:
    """llama.cpp's and vLLM's names for routes served above, out of the schema: /chat/completions,
    /responses, their /input_tokens and /models (what an OpenAI client whose base URL leaves out /v1
    calls), /completions (llama.cpp's own /completion, as there), /v1/health and vLLM's /ping (the
    health probe SageMaker calls, GET or POST)."""
    for path, handler, method in (
        ("/chat/completions", routes.chat, "POST"),
        ("/responses", routes.responses, "POST"),
        ("/chat/completions/input_tokens", routes.chat_input_tokens, "POST"),
        ("/responses/input_tokens", routes.responses_input_tokens, "POST"),
        ("/completions", routes.llamacpp_completion, "POST"),
        ("/models", routes.models, "GET"),
        ("/v1/health", routes.health, "GET"),
        ("/v1/health", routes.health, "HEAD"),
        ("/ping", routes.health, "GET"),
        ("/ping", routes.health, "POST"),
    ):
        app.add_api_route(path, handler, methods=[method], include_in_schema=False)


ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # their errors in Anthropic's shape


def _refusal_for(request: HTTPRequest):
    """The error response maker for a request's route: Anthropic's shape on its routes, else OpenAI's."""
    return messages_api.refused if request.url.path in ANTHROPIC_PATHS else refused


class _Routes:
    """The handlers over one app's state. Their names are the routes' OpenAPI operation names."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def health(self) -> Response:
        status, body = await self.state.backend.health()
        return JSONResponse(body, status_code=status)

    async def version(self, request: HTTPRequest) -> Response:
        if (denied := self.state.refusal(request)) is not None:
            return denied
        return JSONResponse({"version": llamacpp_api.version()})

    async def models(self, request: HTTPRequest) -> Response:
        if (denied := self.state.refusal(request)) is not None:
            return denied
        return JSONResponse(self._listed())

    async def model(self, request: HTTPRequest, model: str) -> Response:
        """/v1/models/{id}: the served model's entry of /v1/models; 404 for any other id."""
        if (denied := self.state.refusal(request)) is not None:
            return denied
        config = self.state.config
        if model not in config.model_names:
            self.state.metrics.rejected(404)
            return refused(not_served(model, config.model_names))
        return JSONResponse(next(entry for entry in self._listed()["data"] if entry["id"] == model))

    async def stored_response(self, request: HTTPRequest, response_id: str) -> Response:
        """GET /v1/responses/{id}: a response kept with `store`, as it was answered; 404 for another id."""
        if (denied := self.state.refusal(request)) is not None:
            return denied
        stored = self.state.responses.get(response_id)
        if stored is None:
            return self._unknown_response(response_id)
        return JSONResponse(stored.response)

    async def forget_response(self, request: HTTPRequest, response_id: str) -> Response:
        """DELETE /v1/responses/{id}: the response forgotten, as OpenAI answers it."""
        if (denied := self.state.refusal(request)) is not None:
            return denied
        if not self.state.responses.delete(response_id):
            return self._unknown_response(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def _unknown_response(self, response_id: str) -> Response:
        self.state.metrics.rejected(404)
        return refused(
            BadRequest(f"no stored response {response_id[:80]!r}", "response_id", 404, code="response_not_found")
        )

    def _listed(self) -> dict:
        config = self.state.config
        return model_list(
            config.model_names,
            self.state.created,
            config.max_model_len,
            config.speculative_model,
            self.state.card,
        )

    async def props(self, request: HTTPRequest) -> Response:
        if (denied := self.state.refusal(request)) is not None:
            return denied
        slots = await self.state.backend.slots()  # under Ray Serve, every replica's lanes
        total = len(slots) if slots else self.state.config.max_num_seqs
        return JSONResponse(llamacpp_api.props(self.state.config, self.state.tokenizer, total, self.state.card))

    async def slots(self, request: HTTPRequest) -> Response:
        """GET /slots: every lane and the request it runs, as llama.cpp gives them; with a non-empty
        `fail_on_no_slot`, 503 while no lane is idle (llama.cpp's)."""
        if (denied := self.state.refusal(request)) is not None:
            return denied
        # Neither 503 counts as a rejected request: a balancer may poll fail_on_no_slot many times a second.
        slots = await self.state.backend.slots()
        if slots is None:
            why = "the replicas' slots are unknown now: the hub did not answer; try again in a few seconds"
            return refused(BadRequest(why, None, 503, "server_error", "hub_unavailable"))
        if request.query_params.get("fail_on_no_slot") and all(slot.task is not None for slot in slots):
            return refused(BadRequest("no slot available", None, 503, "unavailable_error", "no_slot_available"))
        return JSONResponse([llamacpp_api.slot_entry(slot, self.state.config) for slot in slots])

    async def slot_action(self, request: HTTPRequest, slot_id: str) -> Response:
        """POST /slots/{id} (llama.cpp's save, restore and erase of a slot's cache): not done here."""
        if (denied := self.state.refusal(request)) is not None:
            return denied
        self.state.metrics.rejected(501)
        why = (
            "forerun does not save, restore or erase a slot's cache: its prefix cache keeps and reuses "
            "prompts by itself; send the request again and its cached prefix is reused"
        )
        return refused(BadRequest(why, None, 501, "not_supported_error", "not_supported"))

    async def prometheus(self, request: HTTPRequest) -> Response:
        if (denied := self.state.refusal(request)) is not None:
            return denied
        body, content_type = await self.state.backend.metrics()
        return Response(body, media_type=content_type)

    async def completions(self, request: HTTPRequest) -> Response:
        return await generation(self.state, request, chat=False)

    async def chat(self, request: HTTPRequest) -> Response:
        return await generation(self.state, request, chat=True)

    async def responses(self, request: HTTPRequest) -> Response:
        return await generation(self.state, request, chat=True, api="responses")

    async def messages(self, request: HTTPRequest) -> Response:
        return await generation(self.state, request, chat=True, api="messages")

    async def count_tokens(self, request: HTTPRequest) -> Response:
        return await count_tokens_route(self.state, request)

    async def chat_input_tokens(self, request: HTTPRequest) -> Response:
        return await input_tokens_route(self.state, request, responses=False)

    async def responses_input_tokens(self, request: HTTPRequest) -> Response:
        return await input_tokens_route(self.state, request, responses=True)

    async def llamacpp_completion(self, request: HTTPRequest) -> Response:
        return await generation(self.state, request, chat=False, api="completion")

    async def llamacpp_infill(self, request: HTTPRequest) -> Response:
        return await generation(self.state, request, chat=False, api="infill")

    async def tokenize(self, request: HTTPRequest) -> Response:
        return await tokenize_route(self.state, request)

    async def detokenize(self, request: HTTPRequest) -> Response:
        return await detokenize_route(self.state, request)

    async def apply_template(self, request: HTTPRequest) -> Response:
        return await apply_template_route(self.state, request)

    async def unknown_route(self, request: HTTPRequest, exc: StarletteHTTPException) -> Response:
        """404 and 405 in OpenAI's shape (Anthropic's on its routes), after the key (so an unknown route
        reveals nothing without it)."""
        if (denied := self.state.refusal(request)) is not None:
            return denied
        self.state.metrics.rejected(exc.status_code)
        what = {
            404: f"no route {request.url.path}: see /docs",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return _refusal_for(request)(BadRequest(what, None, exc.status_code))

    async def client_gone(self, request: HTTPRequest, exc: ClientGone) -> Response:
        """A client that hung up mid-body (a route that reads its own body): nobody reads the answer,
        and nothing failed."""
        return Response(status_code=CLIENT_GONE)

    async def server_error(self, request: HTTPRequest, exc: Exception) -> Response:
        """A 500 in OpenAI's shape naming the exception's type; the details go to the log, not the client."""
        log.error("forerun: %s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        failure = BadRequest(f"the server failed on this request: {type(exc).__name__}", None, 500, "server_error")
        return _refusal_for(request)(failure)
