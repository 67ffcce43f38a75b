"""Requests from many clients, one engine: a waiting queue, a loop thread, events back per request.

This version runs one sequence at a time, first come first served: the loop takes the oldest
waiting request and steps it to the end, then the next. Requests join and leave between steps; a
cancelled request (its client went away) is dropped at its next step, waiting or running. Several
sequences in one target pass (continuous batching) is not built yet.

Events reach the caller through `on_event(request, event)`, called on the loop thread; the server
hands them to its asyncio loop. An exception inside the engine ends that request with an error
event and the loop goes on to the next; if the loop itself dies, every request still queued ends
with an error event, `alive` turns False and `submit` refuses new ones.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from forerun.config import SamplingParams
from forerun.engine import Engine, RequestOutput
from forerun.errors import ForerunError


@dataclass
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class Done:
    output: RequestOutput


@dataclass
class Failed:
    message: str


Event = Delta | Done | Failed


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[["Request", Event], None]
    id: int = field(default_factory=itertools.count().__next__)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class QueueFull(ForerunError):
    pass


class EngineStopped(ForerunError):
    pass


class Scheduler:
    def __init__(self, engine: Engine, max_waiting: int = 256,
                 on_start: Callable[[Request], None] | None = None) -> None:
        """`max_waiting`: requests allowed to wait beyond the running one; `on_start` is called on
        the loop thread when a request starts running (metrics)."""
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_start = on_start
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: Request | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="forerun-scheduler", daemon=True)
        self.died: str | None = None        # why the loop ended, if it did

    # --- the caller's side ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            for r in self._waiting:
                r.cancel()
            if self._running is not None:
                self._running.cancel()
            self._cond.notify_all()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.died is None

    def submit(self, request: Request) -> None:
        """Queue `request`; QueueFull when max_waiting requests already wait."""
        self.engine.check_fits(request.prompt_ids, request.params)     # a clear error before queueing
        with self._cond:
            if not self.alive:
                raise EngineStopped(f"the engine loop has stopped and takes no requests: {self.died or 'not started'}")
            self._drop_cancelled()
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting; try again later")
            self._waiting.append(request)
            self._cond.notify()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests, cancelled ones left out."""
        with self._cond:
            self._drop_cancelled()
            running = 1 if self._running is not None and not self._running.cancelled.is_set() else 0
            return running, len(self._waiting)

    # --- the loop thread -----------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        if any(r.cancelled.is_set() for r in self._waiting):
            self._waiting = collections.deque(r for r in self._waiting if not r.cancelled.is_set())

    def _next(self) -> Request | None:
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._stop:
                    return None
                if self._waiting:
                    self._running = self._waiting.popleft()
                    return self._running
                self._cond.wait(0.5)

    def _loop(self) -> None:
        try:
            while (request := self._next()) is not None:
                self._run(request)
                with self._cond:
                    self._running = None
        except BaseException:                           # noqa: BLE001 - recorded for /health
            self.died = traceback.format_exc(limit=5)
            with self._cond:
                ended = list(self._waiting) + ([self._running] if self._running is not None else [])
                self._waiting.clear()
                self._running = None
            for r in ended:
                _emit(r, Failed("the engine loop stopped; the server needs a restart"))

    def _run(self, request: Request) -> None:
        if self.on_start is not None:
            self.on_start(request)
        result: list[RequestOutput] = []
        try:
            steps = self.engine.stream(request.prompt_ids, request.params, result)
            for step in steps:
                if request.cancelled.is_set():
                    steps.close()
                    return
                _emit(request, Delta(step.text, step.token_ids))
        except Exception as exc:                        # noqa: BLE001 - one request fails, the loop goes on
            _emit(request, Failed(f"{type(exc).__name__}: {exc}"))
            return
        _emit(request, Done(result[0]))


def _emit(request: Request, event: Event) -> None:
    """Hand `event` on; a receiver that fails (its loop closed) cancels its own request only."""
    try:
        request.on_event(request, event)
    except Exception:                                   # noqa: BLE001
        request.cancel()
