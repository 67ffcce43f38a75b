"""The generation routes' work: a completions, chat, Responses, Messages or llama.cpp request, body to answer.

The body is read and checked, the prompts tokenized (off the event loop: a long prompt takes seconds,
and every other client would wait), every prompt checked against the context, the samples (`n` of
each prompt of a completions batch) queued as one group, all or none, and the answer given as
one JSON response or as a stream (forerun/serve/stream.py). Anything refused on the way is a 4xx
or 503 in OpenAI's shape, counted as rejected; a generation the engine fails or a shutdown cuts is
counted apart (`InFlight.failure`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from array import array

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from forerun.base.config import SamplingParams
from forerun.serve import llamacpp_api, messages_api, responses_api
from forerun.serve.inflight import InFlight, new_group
from forerun.serve.requests import (
    BadRequest,
    Checked,
    ClientGone,
    check,
    read_json,
    sampling,
    scores_prompt_only,
    tokenize,
)
from forerun.serve.responses import Reply, echo_texts, refused
from forerun.serve.scheduler import Failed
from forerun.serve.state import ServerState
from forerun.serve.stream import stream

POLL_SECONDS = 0.5  # how often a waiting non-streamed request checks its client is there
CLIENT_GONE = 499  # nginx's status for a client that closed the connection: nobody reads it
ROUTING_HEADER = "x-routing-key"  # a client's own key for where its requests run (replicas)
ROUTING_PREFIX = 256  # prompt tokens that place a request without one
REPLICA_HEADER = "x-forerun-replica"  # the replica that ran a request (replicas only)
REFUSALS = {"messages": messages_api.refused}  # another API's error shape (else OpenAI's)


async def generation(state: ServerState, http: HTTPRequest, chat: bool, api: str | None = None) -> Response:
    """Answer one completions (`chat` False) or chat request; with `api`, another API's request read
    as the one it amounts to and answered in its own shapes: "responses" (OpenAI's Responses API, as
    chat), "messages" (Anthropic's Messages API, as chat), "completion" and "infill" (llama.cpp's own
    routes, as completions)."""
    config = state.config
    reader = None
    refuse = REFUSALS.get(api, refused)
    try:
        state.check_access(http)
        body = await read_json(http, config.max_body_bytes, config.body_timeout)
        if api is not None:
            reader = await asyncio.to_thread(_reader, api, body, state)  # llama.cpp's routes tokenize
            body = reader.body
        checked = check(body, chat, config.model_names, state.limits)
        prompts = await asyncio.to_thread(tokenize, checked, state.tokenizer, state.limits)
        # Anthropic's max_tokens is a most (Claude Code asks 32,000 whatever the context): the room left
        params = sampling(checked, [len(ids) for ids in prompts], state.limits, fit=api == "messages")
        run = _in_flight(state, checked, prompts, params)
        replica = await state.backend.submit(run.requests, routing_key(http, prompts[0]), whole=not checked.stream)
        headers = {REPLICA_HEADER: replica} if replica is not None else None
        if checked.stream:
            events = reader.events(run) if reader is not None else stream(run)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return await _complete_response(http, run, headers, reader, refuse)
    except BadRequest as exc:
        state.metrics.rejected(exc.status)
        return refuse(reader.renamed(exc) if reader is not None else exc)
    except ClientGone:
        return Response(status_code=CLIENT_GONE)


def _reader(
    api: str, body: dict, state: ServerState
) -> responses_api.Translated | messages_api.Translated | llamacpp_api.Translated:
    """The reader of another API's body: its body in chat's or completions' terms, and its shapes."""
    if api == "responses":
        return responses_api.translate(body, state.responses)
    if api == "messages":
        return messages_api.translate(body)
    config = state.config
    return llamacpp_api.translate(
        body, api == "infill", config.served_model_name, state.tokenizer, config.max_model_len
    )


def routing_key(http: HTTPRequest, prompt_ids: list[int]) -> str:
    """What places a request among replicas: the client's X-Routing-Key (a session's requests kept
    together), else the (first) prompt's first ROUTING_PREFIX tokens (a question asked again goes
    where its answer is remembered)."""
    given = http.headers.get(ROUTING_HEADER)
    if given:
        return given[:256]
    head = array("q", prompt_ids[:ROUTING_PREFIX]).tobytes()
    return hashlib.blake2b(head, digest_size=8).hexdigest()


def _in_flight(
    state: ServerState, checked: Checked, prompts: list[list[int]], params: list[list[SamplingParams]]
) -> InFlight:
    """The request's samples (every prompt's) as one group, not yet submitted, with the reply that
    will answer them."""
    events: asyncio.Queue = asyncio.Queue()
    group = new_group(prompts, params, events, scores_prompt_only(checked))
    texts = echo_texts(checked, prompts, state.tokenizer)
    config = state.config
    model = checked.body["model"]  # the name the request gave (one of the served model's), as vLLM answers
    reply = Reply(checked, model, prompts, state.tokenizer, texts, config.reasoning_parser)
    return InFlight(group, events, reply, state.config.spec_stats, state.metrics)


async def _complete_response(http: HTTPRequest, run: InFlight, headers: dict | None, reader, refuse) -> Response:
    """Every sample's whole answer in one JSON response, once all have finished; 499 if the client left."""
    last_check = time.monotonic()
    try:
        while not run.done:
            try:
                index, event = await asyncio.wait_for(run.events.get(), POLL_SECONDS)
            except TimeoutError:
                index, event = -1, None
            # Every POLL_SECONDS, tokens flowing or not: is the client still there?
            if event is None or time.monotonic() - last_check >= POLL_SECONDS:
                last_check = time.monotonic()
                if await http.is_disconnected():
                    return Response(status_code=CLIENT_GONE)
            if event is None:
                continue
            if isinstance(event, Failed):
                return refuse(run.failure(event))
            run.take(index, event)
        try:
            body = run.reply.complete(run.choices, run.stats())
            if reader is not None:
                body = reader.shaped(body, run)
            return JSONResponse(body, headers=headers)  # renders here: a value JSON cannot hold fails here
        except Exception as exc:  # noqa: BLE001 - the API's error shape, as for any other failure
            return refuse(run.unshaped(exc))
    finally:
        run.cancel()  # a no-op once finished; frees the sequences if we left early
