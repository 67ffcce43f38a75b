"""Where a server's requests run: the engine in this process (LocalBackend), or replicas elsewhere.

The HTTP side (forerun/serve/app.py, generation.py) reads, checks and tokenizes a request, then hands
its samples to a backend and takes their events back; it does not know where they ran. `forerun
serve` runs them on its own scheduler; `forerun serve --ray` on Ray Serve replicas
(forerun/cluster/ingress.py). Both refuse a request in the same words (`refusal`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from forerun.base.errors import ForerunError
from forerun.serve.metrics import ServerMetrics
from forerun.serve.requests import BadRequest
from forerun.serve.scheduler import EngineStopped, QueueFull, Request, Scheduler, ShuttingDown, Slot, TooManySamples


class Backend(ABC):
    @abstractmethod
    async def submit(self, group: list[Request], routing_key: str, whole: bool) -> str | None:
        """Run `group` (one HTTP request's samples: `n` of each of its prompts, as
        forerun/serve/inflight.new_group orders them), all or none; each request's `on_event` gets
        its events.

        Returns once the group is under way (a remote backend: once its first event arrived), with
        the name of the replica running it (None: this process). BadRequest when refused.
        `routing_key`: requests with the same key go where earlier ones went, while that is not
        much busier; `whole`: the client reads the answer whole (nothing of it was sent yet when a
        remote replica fails, so it may run again elsewhere)."""

    @abstractmethod
    async def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of /health."""

    @abstractmethod
    async def metrics(self) -> tuple[bytes, str]:
        """/metrics' body and content type (Prometheus text)."""

    @abstractmethod
    async def slots(self) -> list[Slot] | None:
        """Every lane, numbered from 0, with the request running there (GET /slots); None when
        that cannot be known now."""


def refusal(exc: ForerunError) -> BadRequest:
    """The HTTP error for a request the scheduler would not take."""
    if isinstance(exc, QueueFull):
        return BadRequest(str(exc), None, 503, "server_error", "queue_full")
    if isinstance(exc, ShuttingDown):
        return BadRequest(str(exc), None, 503, "server_error", "shutting_down")
    if isinstance(exc, EngineStopped):
        return BadRequest(str(exc), None, 503, "server_error", "engine_stopped")
    if isinstance(exc, TooManySamples):
        return BadRequest(str(exc), "n")
    return BadRequest(str(exc), "max_tokens")  # Scheduler.submit_group's check: the request does not fit


class LocalBackend(Backend):
    """The scheduler of this process, started (it runs the engine)."""

    def __init__(self, scheduler: Scheduler, metrics: ServerMetrics) -> None:
        self.scheduler, self._metrics = scheduler, metrics

    async def submit(self, group: list[Request], routing_key: str, whole: bool) -> str | None:
        try:
            self.scheduler.submit_group(group)
        except ForerunError as exc:
            raise refusal(exc) from None
        return None

    async def health(self) -> tuple[int, dict]:
        scheduler = self.scheduler
        if scheduler.draining:
            return 503, {"status": "shutting down"}
        if not scheduler.alive:
            return 503, {"status": "engine loop stopped", "detail": scheduler.died}
        return 200, {"status": "ok"}

    async def metrics(self) -> tuple[bytes, str]:
        self._metrics.set_queue(*self.scheduler.counts())
        return self._metrics.render()

    async def slots(self) -> list[Slot] | None:
        return self.scheduler.slots()
