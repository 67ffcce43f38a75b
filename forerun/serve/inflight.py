"""One generation request's samples in flight: the engine's events gathered into a choice per sample.

A request's samples are one group: `n` of each of its prompts (a completions request may batch
several), prompt-major, so sample i of prompt p is index p * n + i, its choice's index. The
scheduler calls back on its loop thread; each sample's receiver hands its events to the request's
asyncio queue, tagged with the sample's index, for the route (a complete response) or the stream to
take in order. Taking an event counts a finished sample in the metrics, so the /metrics totals
agree with what the answers said.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from forerun.base.config import SamplingParams
from forerun.serve.metrics import ServerMetrics
from forerun.serve.requests import BadRequest, Checked
from forerun.serve.responses import Choice, Reply, spec_stats
from forerun.serve.scheduler import Delta, Event, Failed, Request


def new_group(
    prompts: list[list[int]], params: list[list[SamplingParams]], events: asyncio.Queue, prompt_only: bool = False
) -> list[Request]:
    """One Request per sample of each prompt (`params[p]`: prompt p's samples), prompt-major, each
    putting `(index, event)` on `events` through the running loop; a prompt's samples after its
    first may share that one's prefill. `prompt_only`: echo with max_tokens 0 (Request.prompt_only)."""
    loop = asyncio.get_running_loop()

    def receiver(index: int):
        def on_event(request: Request, event: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (index, event))

        return on_event

    group: list[Request] = []
    for prompt_ids, samples in zip(prompts, params, strict=True):
        first = None
        for p in samples:
            request = Request(prompt_ids, p, receiver(len(group)), like=first, prompt_only=prompt_only)
            group.append(request)
            first = first or request
    return group


@dataclass
class InFlight:
    """One HTTP request's samples in flight (every prompt's): their events and what each choice has
    so far."""

    requests: list[Request]
    events: asyncio.Queue  # (sample index, Event), in the order the engine sent them
    reply: Reply
    spec_stats: str  # per-choice speculation figures: none, summary or detailed
    metrics: ServerMetrics
    choices: list[Choice] = field(init=False)

    def __post_init__(self) -> None:
        n = self.checked.n
        self.choices = [Choice(i, i // n) for i in range(len(self.requests))]

    @property
    def checked(self) -> Checked:
        return self.reply.checked

    @property
    def prompt_only(self) -> bool:
        """Echo with max_tokens 0: the generated token is dropped."""
        return self.requests[0].prompt_only

    @property
    def done(self) -> bool:
        return all(c.output is not None for c in self.choices)

    def take(self, index: int, event: Event) -> Choice:
        """Add `event` (Delta or Done) to its choice."""
        choice = self.choices[index]
        if isinstance(event, Delta):
            if not self.prompt_only:
                choice.add(event)
            if event.prompt_logprobs is not None:
                choice.prompt_logprobs = event.prompt_logprobs
        else:
            self.metrics.finished(self.requests[index], event.output)
            choice.output = event.output
            if choice.prompt_logprobs is None:
                choice.prompt_logprobs = event.output.prompt_logprobs
            if self.prompt_only:
                choice.finish_reason = "length"
        return choice

    def failure(self, event: Failed) -> BadRequest:
        """The error a failed generation ends with (counted): an engine failure, a shutdown's cut, or
        the replica running it lost (a client may send it again)."""
        self.metrics.failed(event.reason)
        if event.reason == "shutdown":
            return BadRequest(event.message, None, 503, "server_error", "shutting_down")
        if event.reason == "replica":
            return BadRequest(event.message, None, 503, "server_error", "replica_lost")
        return BadRequest(f"generation failed: {event.message}", None, 500, "server_error")

    def unshaped(self, exc: Exception) -> BadRequest:
        """The error for an answer generated but not put in OpenAI's shape (a fault of the server's
        own, counted as a failure): the client is told, never left with a cut connection."""
        self.metrics.failed("engine")
        return BadRequest(
            f"the server failed to shape the answer: {type(exc).__name__}: {exc}", None, 500, "server_error"
        )

    def stats_of(self, choice: Choice) -> dict | None:
        if self.spec_stats == "none" or choice.output is None:
            return None
        return spec_stats(choice.output.metrics, self.spec_stats == "detailed")

    def stats(self) -> list[dict | None]:
        return [self.stats_of(c) for c in self.choices]

    def cancel(self) -> None:
        """Free the samples' sequences (a no-op for those already finished)."""
        for r in self.requests:
            r.cancel()
