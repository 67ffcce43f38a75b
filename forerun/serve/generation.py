"""The two generation routes' work: a completions or chat request from its body to its answer.

The body is read and checked, the prompt tokenized (off the event loop: a long prompt takes seconds,
and every other client would wait), the `n` samples queued as one group, and the answer given as
one JSON response or as a stream (forerun/serve/stream.py). Anything refused on the way is a 4xx
or 503 in OpenAI's shape, counted as rejected; a generation the engine fails or a shutdown cuts is
counted apart (`InFlight.failure`).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
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
from forerun.serve.responses import Reply, echo_text, refused
from forerun.serve.scheduler import EngineStopped, Failed, QueueFull, ShuttingDown
from forerun.serve.state import ServerState
from forerun.serve.stream import stream

POLL_SECONDS = 0.5  # how often a waiting non-streamed request checks its client is there
CLIENT_GONE = 499  # nginx's status for a client that closed the connection: nobody reads it


async def generation(state: ServerState, http: HTTPRequest, chat: bool) -> Response:
    """Answer one completions (`chat` False) or chat request."""
    config = state.config
    try:
        state.check_access(http)
        body = await read_json(http, config.max_body_bytes, config.body_timeout)
        checked = check(body, chat, config.served_model_name, state.limits)
        prompt_ids = await asyncio.to_thread(tokenize, checked, state.tokenizer)
        params = sampling(checked, len(prompt_ids), state.limits)
        run = _submit(state, checked, prompt_ids, params)
        if checked.stream:
            return StreamingResponse(stream(run), media_type="text/event-stream")
        return await _complete_response(http, run)
    except BadRequest as exc:
        state.metrics.rejected(exc.status)
        return refused(exc)
    except ClientGone:
        return Response(status_code=CLIENT_GONE)


def _submit(state: ServerState, checked: Checked, prompt_ids: list[int], params: list[SamplingParams]) -> InFlight:
    """Queue the request's samples as one group; a scheduler that refuses them is a BadRequest."""
    events: asyncio.Queue = asyncio.Queue()
    group = new_group(prompt_ids, params, events)
    try:
        state.scheduler.submit_group(group)
    except QueueFull as exc:
        raise BadRequest(str(exc), None, 503, "server_error", "queue_full") from None
    except ShuttingDown as exc:
        raise BadRequest(str(exc), None, 503, "server_error", "shutting_down") from None
    except EngineStopped as exc:
        raise BadRequest(str(exc), None, 503, "server_error", "engine_stopped") from None
    except ForerunError as exc:
        raise BadRequest(str(exc), "max_tokens") from None
    prompt_text = echo_text(checked, prompt_ids, state.tokenizer)
    reply = Reply(checked, state.config.served_model_name, prompt_ids, state.tokenizer, prompt_text=prompt_text)
    return InFlight(group, events, reply, state.config.spec_stats, scores_prompt_only(checked), state.metrics)


async def _complete_response(http: HTTPRequest, run: InFlight) -> Response:
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
                return refused(run.failure(event))
            run.take(index, event)
        return JSONResponse(run.reply.complete(run.choices, run.stats()))
    finally:
        run.cancel()  # a no-op once finished; frees the sequences if we left early
