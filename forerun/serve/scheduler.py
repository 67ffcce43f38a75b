"""Requests from many clients, one engine: a waiting queue, a loop thread, events back per request.

The loop runs a BatchEngine (forerun/engine/batch.py): between steps it admits waiting requests, first
come first served, while fewer than its max_seqs run, drops the cancelled ones (a client went
away), prefills, then steps every running request in one target pass. With max_seqs 1 requests
run one after another.

Prefills run a chunk of the prompt at a time (chunked prefill, `BatchEngine.prefill`), the waiting
prompts a chunk each in turn. While no request is decoding, a burst of requests is prefilled, those
that arrive during these prefills too (started at the next chunk), and then steps as one batch
rather than the first stepping alone while the rest wait; but once a request of the burst has its
first token out, the rest of the burst goes on only while that request has waited less than the
prefill share of a step (of a chunk before the first step), so a client never waits for a whole
queue of long prompts between its first and second tokens, nor a short prompt for a long one's
whole prefill. A client gone, a stop or a drain's deadline takes effect at the next chunk. While
requests decode, a step's pass carries the waiting prompts' next rows, as many
as add PREFILL_SHARE one-row passes' time (where the target's prefill is a chain of exact rows:
`BatchEngine.step`); elsewhere prefill gets PREFILL_SHARE seconds per second of steps as chunks
alone (a chunk at least, a step's worth saved up at most). Either way a long prompt slows the
running requests instead of stopping them for its whole prefill.

Events reach the caller through `on_event(request, event)`, called on the loop thread; the server
hands them to its asyncio loop. An exception inside the engine for one request ends that request
with an error event and the others go on; if the loop itself dies, every request still queued or
running ends with an error event, `alive` turns False and `submit` refuses new ones.

Shutting down (`drain`, safe to call from a signal handler): new requests are refused, those still
waiting end at once with a "shutdown" failure (a client may send them elsewhere), the running ones
go on until they finish or the grace period ends, when each left is cut with a "shutdown" failure
(named in `cut`); then the loop returns.

A group is one HTTP request's samples: `n` of each of its prompts (a completions request may batch
several), queued all or none. A sample after its prompt's first names that one in `like`: started
while that one still prefills, it copies its prefill once done instead of running its own.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.engine.batch import BatchEngine
from forerun.engine.engine import RequestOutput


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list | None = None  # the target's TokenLogprob of each token, when the request asked
    prompt_logprobs: list | None = None  # the first Delta: the prompt's, when the request asked


@dataclass
class Done:
    output: RequestOutput


@dataclass
class Failed:
    message: str
    # "engine": the engine failed; "shutdown": the server is stopping; "replica": the replica running
    # it was lost; "relay": the ingress's call to the replicas failed (both forerun/cluster)
    reason: str = "engine"


Event = Delta | Done | Failed


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[Request, Event], None]
    id: int = field(default_factory=itertools.count().__next__)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    like: Request | None = None  # the group's first request, whose prefill this one may share
    prompt_only: bool = False  # echo with max_tokens 0: its one token scores the prompt; the answer leaves it out
    slot: int | None = None  # its lane's number while it runs: the lowest free when it started (GET /slots)
    decoded: int = 0  # tokens sent so far
    new_line: bool = False  # whether the text sent so far has a line break

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass(frozen=True)
class Slot:
    """A lane as llama.cpp's GET /slots shows it: the request running there, if any."""

    id: int
    task: int | None = None  # the running request's id; None: the lane is idle
    params: SamplingParams | None = None  # the running request's
    decoded: int = 0  # tokens it has sent
    new_line: bool = False  # whether its text so far has a line break
    prompt_tokens: int = 0  # its prompt's length

    def light(self) -> Slot:
        """This lane with its request's bulky settings left out (a prediction's text, a schema, logit
        biases): what a replica sends the hub every second."""
        if self.params is None:
            return self
        params = dataclasses.replace(self.params, prediction=None, structured_outputs=None, logit_bias=())
        return dataclasses.replace(self, params=params)


# While requests decode, a step's pass carries prompt rows costing this many one-row passes (the
# running requests' time per token grows by at most 1.5 times its one-request figure, well within
# 3 times under noise), or, where rows cannot be carried, prompts are prefilled for this many
# seconds per second of steps (at least a chunk at a time).
PREFILL_SHARE = 1.5
ONE_CHUNK = 1e-9  # a prefill budget that runs one chunk (BatchEngine.prefill runs one at least)


class QueueFull(ForerunError):
    pass


class TooManySamples(ForerunError):
    """A group larger than the lanes and the queue together: it could never be taken."""


class EngineStopped(ForerunError):
    pass


class ShuttingDown(EngineStopped):
    pass


class Scheduler:
    def __init__(
        self,
        batch: BatchEngine,
        max_waiting: int = 256,
        on_start: Callable[[Request], None] | None = None,
        prefill_share: float = PREFILL_SHARE,
        chores: Callable[[], None] | None = None,
    ) -> None:
        """`max_waiting`: requests allowed to wait beyond the running ones; `on_start` is called on
        the loop thread when a request starts running (metrics); `prefill_share`: while requests
        decode, one-row passes of prompt rows a step carries, or seconds of prefill alone per second
        of steps where rows cannot be carried; `chores`: called on the loop
        thread before each round's admissions start (a replica adds other replicas' answers to its
        drafters' memory there, where nothing else touches it)."""
        self.batch = batch
        self.chores = chores
        self.max_waiting = max_waiting
        self.on_start = on_start
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="forerun-scheduler", daemon=True)
        self._looping = threading.Event()  # the loop runs, on whichever thread
        self._keep_going: Callable[[], bool] = lambda: True
        self.died: str | None = None  # why the loop ended, if it did
        # When the running requests are cut (perf_counter), once `drain` was called; set by a plain
        # assignment so a signal handler may call it while the loop holds the lock.
        self._drain_deadline: float | None = None
        self.cut: list[int] = []  # ids of the requests cut at the end of a drain
        self.prefill_share = prefill_share
        self._credit = 0.0  # seconds of prefill the steps have paid for (chunked prefill)
        self._fresh: set[int] = set()  # prefilled since the last step
        self._fresh_since: float | None = None  # when the first of them had its first token out
        self._step_s: float | None = None  # the last step's seconds
        self._chunk_s: float | None = None  # the last burst chunk's seconds (a step's stand-in before the first)

    # --- the caller's side ---------------------------------------------------------------------

    def start(self) -> None:
        """Run the engine loop on a thread of its own (tests, an embedding application)."""
        self._looping.set()
        self._thread.start()

    def run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Run the engine loop on the calling thread until `stop()` or `keep_going()` is False.

        `forerun serve` runs it on the main thread, the one that loaded the model, and the HTTP
        server beside it: PyTorch's OpenMP workers belong to the thread that first ran an op, and
        the same forward run from a second thread measured ~45 % slower here (small element-wise
        ops four to five times slower)."""
        self._keep_going = keep_going
        self._looping.set()
        self._loop()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            for r in [*self._waiting, *self._running.values()]:
                r.cancel()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def drain(self, grace: float) -> None:
        """Stop: refuse new requests, end the waiting ones, give the running ones `grace` seconds
        to finish, then cut them. Only assigns, so a signal handler may call it at any moment; a
        second call moves the deadline (0: cut now)."""
        self._drain_deadline = time.perf_counter() + max(grace, 0.0)

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    @property
    def alive(self) -> bool:
        return self._looping.is_set() and self.died is None

    def submit(self, request: Request) -> None:
        """Queue `request`; QueueFull when max_waiting requests already wait."""
        self.submit_group([request])

    def submit_group(self, requests: list[Request]) -> None:
        """Queue `requests` side by side (one HTTP request's samples, of each of its prompts,
        admitted together where lanes are open); all or none: QueueFull when more than max_waiting
        would wait beyond the open lanes, TooManySamples when they outnumber the lanes and
        max_waiting together."""
        for request in requests:
            self.batch.check_fits(request.prompt_ids, request.params)  # a clear error before queueing
        if len(requests) > self.batch.max_seqs + self.max_waiting:
            raise TooManySamples(
                f"{len(requests)} samples (n of each prompt) could never be taken: this server runs "
                f"{self.batch.max_seqs} requests at once and lets {self.max_waiting} wait; ask for fewer"
            )
        with self._cond:
            if self.draining:
                raise ShuttingDown(
                    "the server is shutting down and takes no new requests; send it to another "
                    "replica, or again once the server is back"
                )
            if not self.alive:
                raise EngineStopped(f"the engine loop has stopped and takes no requests: {self.died or 'not started'}")
            self._drop_cancelled()
            # Waiting requests take the open lanes first; max_waiting counts those beyond them.
            open_lanes = max(self.batch.max_seqs - len(self._running), 0)
            if len(self._waiting) + len(requests) > self.max_waiting + open_lanes:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting; try again later")
            self._waiting.extend(requests)
            self._cond.notify()

    def slots(self) -> list[Slot]:
        """Every lane by number, with the request running there (a cancelled one left out)."""
        with self._cond:
            taken = {r.slot: r for r in self._running.values() if r.slot is not None and not r.cancelled.is_set()}
        return [
            Slot(i, r.id, r.params, r.decoded, r.new_line, len(r.prompt_ids))
            if (r := taken.get(i)) is not None
            else Slot(i)
            for i in range(self.batch.max_seqs)
        ]

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests, cancelled ones left out."""
        with self._cond:
            self._drop_cancelled()
            running = sum(1 for r in self._running.values() if not r.cancelled.is_set())
            return running, len(self._waiting)

    # --- the loop thread -----------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        if any(r.cancelled.is_set() for r in self._waiting):
            self._waiting = collections.deque(r for r in self._waiting if not r.cancelled.is_set())

    def _admit(self, wait: bool = True) -> list[Request] | None:
        """Waiting requests to start now, as many as there are open lanes; with `wait`, waits while
        there is nothing to do; None once stopped."""
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._stop or not self._keep_going():
                    return None
                if self.draining:
                    return self._drained()
                open_lanes = self.batch.max_seqs - len(self._running)
                admitted = [self._waiting.popleft() for _ in range(min(open_lanes, len(self._waiting)))]
                used = {running.slot for running in self._running.values()}
                for r in admitted:
                    r.slot = next(i for i in itertools.count() if i not in used)
                    used.add(r.slot)
                    self._running[r.id] = r
                if admitted or self._running or not wait:
                    return admitted
                self._cond.wait(0.5)

    def _drained(self) -> list[Request] | None:
        """While draining (under the lock): end the waiting requests; past the deadline, cut the
        running ones. None once nothing runs; else no request to admit."""
        waiting, self._waiting = list(self._waiting), collections.deque()
        for r in waiting:
            r.cancel()
            _emit(r, Failed("the server is shutting down and did not start this request; send it again", "shutdown"))
        if self._running and time.perf_counter() >= self._drain_deadline:
            for r in list(self._running.values()):
                del self._running[r.id]
                self.batch.remove(r.id)
                self.cut.append(r.id)
                _emit(
                    r,
                    Failed(
                        "the server is shutting down: this request was cut at the end of its grace "
                        "period; send it again",
                        "shutdown",
                    ),
                )
        return None if not self._running else []

    def _loop(self) -> None:
        try:
            while (admitted := self._admit()) is not None:
                if self.chores is not None:
                    self.chores()
                self._start(admitted)
                self._step()
        except BaseException as exc:  # noqa: BLE001 - recorded for /health
            self._die()
            if isinstance(exc, KeyboardInterrupt):  # Ctrl-C on the main thread: the caller stops
                raise
        finally:
            self._looping.clear()

    def _start(self, admitted: list[Request]) -> None:
        """Start `admitted` and prefill within the budget (chunks left from earlier rounds too, so this
        runs with nothing admitted as well); again for those that came meanwhile."""
        while True:
            for request in admitted:
                self._begin(request)
            self._leave_cancelled()
            self._prefill()
            admitted = self._admit(wait=False)
            if not admitted:
                return

    def _step(self) -> None:
        """One step of every running request; each gets its Delta, and Done or Failed when it ends."""
        started = time.perf_counter()
        # Where the target allows, the step's pass carries the waiting prompts' next rows itself, as
        # many as cost the prefill share in one-row passes; the chunks run alone then wait.
        results = self.batch.step(self.prefill_share)
        if results:
            # Chunks alone may take the prefill share of the steps' time, a step's worth at most saved
            # up (none after a step that carried prompt rows itself).
            step = time.perf_counter() - started
            share = 0.0 if self.batch.carried_rows else self.prefill_share
            self._credit = min(self._credit + share * step, share * step)
            self._step_s = step
        self._fresh.clear()
        self._fresh_since = None
        for rid, result in results.items():
            request = self._running.get(rid)
            if request is None:  # a carried prompt's request cancelled meanwhile
                continue
            if result.error is not None:
                self._end(request, Failed(f"{type(result.error).__name__}: {result.error}"))
                continue
            out = result.output
            _emit(request, Delta(out.text, out.token_ids, out.logprobs, out.prompt_logprobs))
            if result.output.finished:
                self._end(request, None)

    def _die(self) -> None:
        """The loop itself failed (called in its `except`): every queued or running request ends with
        an error event, and `alive` turns False with the reason kept for /health."""
        self.died = traceback.format_exc(limit=5)
        self._looping.clear()
        with self._cond:
            ended = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._running.clear()
        for r in ended:
            _emit(r, Failed("the engine loop stopped; the server needs a restart"))

    def _begin(self, request: Request) -> None:
        """Start `request`'s prefill (run by `_prefill`, a chunk at a time)."""
        if request.cancelled.is_set():  # gone while it waited: no prefill for nobody
            with self._cond:
                self._running.pop(request.id, None)
            return
        if self.on_start is not None:
            self.on_start(request)
        like = request.like.id if request.like is not None else None
        try:
            self.batch.start(request.id, request.prompt_ids, request.params, like=like)
        except Exception as exc:  # noqa: BLE001 - one request fails, the loop goes on
            with self._cond:
                self._running.pop(request.id, None)
            _emit(request, Failed(f"{type(exc).__name__}: {exc}"))

    def _prefill(self) -> None:
        """Prefill chunks within the budget: while no request has decoded since these were admitted,
        a burst (`_burst`: then steps as one batch), else the time saved up from the steps (chunked
        prefill: a long prompt never stalls the running requests for long)."""
        decoding = any(rid not in self._fresh for rid in self.batch.lanes)
        started = time.perf_counter()
        if decoding:
            results = self.batch.prefill(self._credit)
            self._credit -= time.perf_counter() - started
        else:
            results = self._burst()
        for rid, result in results.items():
            request = self._running.get(rid)
            if request is None:
                continue
            if result.error is not None:
                with self._cond:
                    self._running.pop(rid, None)
                _emit(request, Failed(f"{type(result.error).__name__}: {result.error}"))
                continue
            first = result.output
            self._fresh.add(rid)
            _emit(request, Delta(first.text, first.token_ids, first.logprobs, first.prompt_logprobs))
            if first.finished:
                self._end(request, None)

    def _burst(self) -> dict:
        """Prefill a chunk at a time while no request decodes, until every prompt is in or a request
        with its first token out has waited the prefill share of the last step (a chunk's time at
        least: a chunk is not cut). Between chunks, a request whose client left stops, those that
        came meanwhile start (their chunks in turn with the others': a short prompt does not wait
        for a long one's whole prefill), and the burst ends once the server stops or its drain's
        grace is over."""
        results = {}
        while self.batch.prefilling and not self._burst_waited() and not self._ending():
            started = time.perf_counter()
            done = self.batch.prefill(ONE_CHUNK)
            self._chunk_s = time.perf_counter() - started
            if self._fresh_since is None and any(r.error is None for r in done.values()):
                self._fresh_since = time.perf_counter()
            results.update(done)
            self._leave_cancelled()
            for request in self._admit(wait=False) or []:
                self._begin(request)
        return results

    def _ending(self) -> bool:
        """Whether the loop must stop working on prompts: stopped, or past a drain's deadline."""
        deadline = self._drain_deadline
        return self._stop or not self._keep_going() or (deadline is not None and time.perf_counter() >= deadline)

    def _burst_waited(self) -> bool:
        """Whether a request with its first token out has waited the prefill share of the last step
        (before the first step, of the last chunk: a server's first long prompt does not hold up
        a short one that came during its prefill; never while none has its first token out)."""
        step = self._step_s if self._step_s is not None else self._chunk_s
        if self._fresh_since is None or step is None:
            return False
        return time.perf_counter() - self._fresh_since >= self.prefill_share * step

    def _leave_cancelled(self) -> None:
        with self._cond:
            gone = [r for r in self._running.values() if r.cancelled.is_set()]
            for r in gone:
                del self._running[r.id]
        for r in gone:
            self.batch.remove(r.id)

    def _end(self, request: Request, failure: Failed | None) -> None:
        """The request leaves its lane: Done with its output, or the failure."""
        output = self.batch.remove(request.id)
        with self._cond:
            self._running.pop(request.id, None)
        _emit(request, failure if failure is not None else Done(output))


def _emit(request: Request, event: Event) -> None:
    """Hand `event` on (a Delta's tokens counted for GET /slots); a receiver that fails (its loop
    closed) cancels its own request only."""
    if isinstance(event, Delta):
        request.decoded += len(event.token_ids)
        request.new_line = request.new_line or "\n" in event.text
    try:
        request.on_event(request, event)
    except Exception:  # noqa: BLE001
        request.cancel()
