"""One forerun engine as a Ray Serve replica: `forerun serve`'s scheduler, fed jobs by the ingress.

The engine (model, lanes, drafters, scheduler) is built and run on a thread of its own, the one that
loaded the model (see Scheduler.run); Ray's calls arrive on the replica's event loop. A job
(forerun/cluster/jobs.py) becomes a group of scheduler requests, and `generate` yields Started,
then each (sample index, event) as the engine sends it, to the ingress. Finished requests are
counted here, in `forerun serve`'s metrics, which the replica pushes to the hub every
METRICS_PERIOD seconds.

The shared suffix memory: an answer this replica finishes is published to the hub; a few times a
second the replica takes the answers the other replicas published and queues them, and the
scheduler's loop thread adds them to the drafters' memory before its next round (`chores`), where
no drafter is reading it. Methods without a suffix memory skip both.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator

import torch
from prometheus_client import Counter
from ray import serve

from forerun.cluster.jobs import Facts, Job, Refused, Started
from forerun.commands.serve import ServedEngine, start_engine
from forerun.drafters.suffix import SuffixMemory
from forerun.models.card import model_card
from forerun.serve.backend import refusal
from forerun.serve.inflight import new_group
from forerun.serve.scheduler import Done, Failed

log = logging.getLogger("forerun.cluster.replica")

METRICS_PERIOD = 1.0  # seconds between metrics reports to the hub
DRAINING_PERIOD = 0.25  # the same while draining: the command waits on them to stop, a second signal to cut
ANSWERS_PERIOD = 0.25  # seconds between looks for other replicas' answers


class EngineReplica:
    async def __init__(self, options: dict, hub) -> None:
        """`options`: `forerun serve`'s flags (vars of its arguments); `hub`: the Hub's handle."""
        self.args = argparse.Namespace(**options)
        self.hub = hub
        self.inbox: collections.deque[list[int]] = collections.deque()  # others' answers, not yet remembered
        self._built = threading.Event()
        self._failure: BaseException | None = None
        self.engine: ServedEngine | None = None
        self.grace: float | None = None  # the grace this replica drains with, once the app is stopping
        thread = threading.Thread(target=self._run_engine, name="forerun-engine", daemon=True)
        thread.start()
        await asyncio.to_thread(self._built.wait)
        if self._failure is not None:
            raise self._failure
        while not self.engine.scheduler.alive:  # its loop starting on the engine thread
            if not thread.is_alive():
                raise RuntimeError(f"the engine loop stopped as it started: {self.engine.scheduler.died}")
            await asyncio.sleep(0.005)
        self.name = serve.get_replica_context().replica_id.unique_id
        memory = self.engine.llm.drafter_memory
        shared = isinstance(memory, SuffixMemory) and self.args.shared_answers_tokens > 0
        self.memory = memory if shared else None  # None: nothing shared (no suffix memory, or sharing off)
        self.received = Counter(
            "forerun:shared_answers_received",
            "Answers other replicas gave, taken for this replica's suffix memory (added as its next request starts)",
            registry=self.engine.metrics.registry,
        )
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._report_metrics())]
        if self.memory is not None:
            self._tasks.append(loop.create_task(self._take_answers()))

    def _run_engine(self) -> None:
        """The engine thread: build the engine, then run the scheduler's loop until stopped."""
        try:
            torch.set_num_threads(max(1, round(self.args.replica_cpus)))
            self.engine = start_engine(self.args, chores=self._remember_shared)
        except BaseException as exc:  # noqa: BLE001 - raised again by the constructor
            self._failure = exc
            return
        finally:
            self._built.set()
        self.engine.scheduler.run()

    async def facts(self) -> Facts:
        llm = self.engine.llm
        cfg = llm.target.decoder.cfg
        card = model_card(llm.target.source, cfg)
        return Facts(llm.tokenizer, cfg.vocab_size, cfg.max_position, llm.spec.method, card)

    async def generate(self, job: Job) -> AsyncIterator:
        """Started(this replica), then (sample index, Delta | Done | Failed) as the engine sends them,
        until every sample is done or one failed; Refused instead when the scheduler will not take
        the job. Cancelled (the client left): the samples are freed."""
        events: asyncio.Queue = asyncio.Queue()
        group = new_group(job.prompts, job.params, events, job.prompt_only)
        try:
            self.engine.scheduler.submit_group(group)
        except Exception as exc:  # noqa: BLE001 - ForerunError from the scheduler's checks
            yield Refused.of(refusal(exc))
            return
        yield Started(self.name)
        done = 0
        try:
            while done < len(group):
                index, event = await events.get()
                if isinstance(event, Done):
                    done += 1
                    self._count_done(group[index], event)
                elif isinstance(event, Failed):
                    self.engine.metrics.failed(event.reason)
                yield index, event
                if isinstance(event, Failed):
                    return
        finally:
            for request in group:
                request.cancel()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop died is restarted."""
        scheduler = self.engine.scheduler
        if not scheduler.alive and not scheduler.draining:
            raise RuntimeError(f"the engine loop stopped: {scheduler.died}")

    def __del__(self) -> None:
        if self.engine is not None:
            self.engine.scheduler.stop()

    # --- counting and sharing ----------------------------------------------------------------------

    def _count_done(self, request, event: Done) -> None:
        self.engine.metrics.finished(request, event.output)
        if self.memory is not None and event.output.token_ids:
            self.hub.publish.remote(self.name, list(event.output.token_ids))

    def _remember_shared(self) -> None:
        """On the scheduler's loop thread: the other replicas' answers join the drafters' memory."""
        while self.inbox:
            self.memory.remember(self.inbox.popleft())

    async def _take_answers(self) -> None:
        cursor = None  # the hub's (life, last answer seen): all that is kept at first
        while True:
            try:
                cursor, fresh = await self.hub.since.remote(self.name, cursor)
                self.inbox.extend(fresh)
                self.received.inc(len(fresh))
            except Exception as exc:  # noqa: BLE001 - the hub restarting: try again later
                log.warning("forerun: could not take shared answers from the hub: %s", exc)
            await asyncio.sleep(ANSWERS_PERIOD)

    async def _report_metrics(self) -> None:
        """Every METRICS_PERIOD: this replica's metrics, state and lanes to the hub; once the app is
        stopping (the hub says with what grace), the scheduler drains as `forerun serve`'s does."""
        metrics, scheduler = self.engine.metrics, self.engine.scheduler
        while True:
            running, waiting = scheduler.counts()
            metrics.set_queue(running, waiting)
            try:
                text = metrics.render()[0].decode()
                busy, slots = running + waiting, [slot.light() for slot in scheduler.slots()]
                self.hear(await self.hub.report.remote(self.name, text, busy, scheduler.draining, slots))
            except Exception as exc:  # noqa: BLE001 - the hub restarting: report again later
                log.warning("forerun: could not report metrics to the hub: %s", exc)
            await asyncio.sleep(DRAINING_PERIOD if scheduler.draining else METRICS_PERIOD)

    def hear(self, grace: float | None) -> None:
        """The hub's word on stopping: drain with `grace` seconds; a shorter grace heard later (a
        second signal's 0) moves the deadline sooner, the same grace heard again leaves it."""
        if grace is None or (self.grace is not None and grace >= self.grace):
            return
        self.grace = grace
        self.engine.scheduler.drain(grace)
