"""A streamed answer: a request's events as OpenAI's server-sent events, ending in `data: [DONE]`.

Apart from the route (forerun/serve/generation.py) because a stream outlives it: the route returns
at once and this generator runs while the client reads, so it is the one that frees the samples
when the client goes away mid-stream. A failure mid-stream cannot change the status already sent:
it arrives as an error event in OpenAI's shape, then `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from forerun.serve.inflight import InFlight
from forerun.serve.responses import error_body
from forerun.serve.scheduler import Failed

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def stream(run: InFlight) -> AsyncIterator[str]:
    """Chat's opening chunks, a chunk per event with something new, the usage chunk when asked, [DONE]."""
    reply = run.reply
    try:
        for chunk in reply.opening():
            yield sse(_with_usage(run, chunk))
        while not run.done:
            index, event = await run.events.get()
            if isinstance(event, Failed):
                yield sse(error_body(run.failure(event)))
                break
            choice = run.take(index, event)
            try:
                chunk = reply.chunk(choice, run.stats_of(choice))
            except Exception as exc:  # noqa: BLE001 - told to the client as an error event, not a cut stream
                yield sse(error_body(run.unshaped(exc)))
                break
            if chunk is not None:
                yield sse(_with_usage(run, chunk))
        else:
            if run.checked.include_usage:
                yield sse(reply.usage_chunk(run.choices, run.stats()))
        yield DONE
    finally:
        run.cancel()  # the client went away mid-stream: free the sequences


def _with_usage(run: InFlight, chunk: dict) -> dict:
    """`chunk`, with the request's usage so far where it asked for it in every chunk (vLLM's
    continuous_usage_stats): every prompt's tokens and the tokens each choice has streamed."""
    if run.checked.continuous_usage:
        chunk["usage"] = run.reply.usage(run.choices)
    return chunk
