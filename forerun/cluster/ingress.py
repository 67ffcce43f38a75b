"""The Ray Serve ingress: `forerun serve`'s HTTP app, its requests run on the engine replicas.

The same app as `forerun serve` (forerun/serve/app.py: routes, checks, API key, error shapes,
streaming), over a ReplicaBackend instead of a local scheduler. The ingress loads no model: it asks
a replica for the tokenizer and the model's limits (`Facts`) as it starts.

A request's samples (`n` of each of its prompts) go to a replica as one job through the engine
deployment's handle, routed by forerun/cluster/router.py; the replica's events are handed to the
request as the local scheduler's would be. When the replica is lost (killed, its node gone) before
any token reached the client, the job runs again on another (ATTEMPTS in all; a non-streamed answer
is held until complete, so it may always run again); a stream that had sent tokens ends with an
error event and `[DONE]`, and a complete response with a 503 `replica_lost`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

from fastapi import FastAPI
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import RequestCancelledError

from forerun.cluster.jobs import Job, Refused, Started
from forerun.cluster.metrics import IngressMetrics
from forerun.commands.serve import server_config
from forerun.serve.app import app_for
from forerun.serve.backend import Backend
from forerun.serve.scheduler import Delta, Event, Failed, Request, Slot
from forerun.serve.state import ServerState

log = logging.getLogger("forerun.cluster.ingress")

ATTEMPTS = 3  # replicas a job may be tried on before it fails
CANCEL_POLL = 0.25  # seconds between checks that a job's client is still there
LOST = (RayActorError, ActorUnavailableError)  # the replica running a job is gone
LIVE_S = 10.0  # /health: a replica counts as running while its last metrics report is this recent
HUB_WAIT_S = 2.0  # /health and /metrics: how long the hub may take to answer (it may be restarting)


class Ingress:
    async def __init__(self, options: dict, engine, hub) -> None:
        """`options`: `forerun serve`'s flags; `engine`, `hub`: the deployments' handles."""
        args = argparse.Namespace(**options)
        facts = await engine.facts.remote()
        metrics = IngressMetrics()
        backend = ReplicaBackend(engine, metrics, hub)
        config = server_config(args, facts.context)
        self.state = ServerState.build(facts.tokenizer, facts.vocab_size, backend, config, metrics, facts.card)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return app_for(self.state)


class ReplicaBackend(Backend):
    def __init__(self, engine, metrics: IngressMetrics, hub) -> None:
        """`engine`, `hub`: the deployments' handles; `metrics`: the ingress's own counts."""
        self.engine, self.hub, self._metrics = engine, hub, metrics
        self._relays: set[asyncio.Task] = set()

    async def submit(self, group: list[Request], routing_key: str, whole: bool) -> str | None:
        job = Job.of(group, routing_key)
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        relay = asyncio.create_task(self._relay(job, group, started, whole))
        self._relays.add(relay)
        relay.add_done_callback(self._relays.discard)
        try:
            return await started
        except asyncio.CancelledError:  # the client left while the job was being placed
            for request in group:
                request.cancel()
            raise

    async def health(self) -> tuple[int, dict]:
        """200 while some replica reported within LIVE_S seconds (a balancer in front of several
        ingresses skips one whose replicas are all gone), with how many did; 503 once stopping, or
        when the hub does not answer within HUB_WAIT_S (it is restarting: the replicas' state is
        unknown a while)."""
        try:
            live, stopping = await asyncio.wait_for(self._hub_state(), HUB_WAIT_S)
        except TimeoutError:
            detail = f"the hub did not answer within {HUB_WAIT_S:g} s; it may be restarting"
            return 503, {"status": "replica state unknown", "detail": detail}
        except Exception as exc:  # noqa: BLE001 - the hub restarting: say so rather than guess
            return 503, {"status": "replica state unknown", "detail": f"the hub did not answer: {exc}"}
        if stopping:
            return 503, {"status": "shutting down"}
        if not live:
            return 503, {"status": "no replica running", "detail": f"none reported in the last {LIVE_S:g} s"}
        return 200, {"status": "ok", "replicas": len(live)}

    async def _hub_state(self) -> tuple[list[str], bool]:
        return await self.hub.live.remote(LIVE_S), await self.hub.stopping.remote()

    async def metrics(self) -> tuple[bytes, str]:
        reports: dict[str, str] = {}
        try:
            reports = await asyncio.wait_for(self.hub.collected.remote(), HUB_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - the hub restarting: the ingress's own series only
            log.warning("forerun: the hub did not answer for /metrics: %s: %s", type(exc).__name__, exc)
        return self._metrics.merged(reports)

    async def slots(self) -> list[Slot] | None:
        """Every replica's lanes as each last reported them (every second; a replica silent for the
        hub's GAUGE_TTL seconds left out), numbered on from one replica to the next in the replicas'
        name order; None when the hub does not answer."""
        try:
            reported = await asyncio.wait_for(self.hub.slots.remote(), HUB_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - the hub restarting: unknown now
            log.warning("forerun: the hub did not answer for /slots: %s: %s", type(exc).__name__, exc)
            return None
        lanes = [slot for replica in sorted(reported) for slot in reported[replica]]
        return [dataclasses.replace(slot, id=number) for number, slot in enumerate(lanes)]

    async def _relay(self, job: Job, group: list[Request], started: asyncio.Future, whole: bool) -> None:
        """Run `job` on a replica, again on another while nothing of it reached the client."""
        relayed = _Relayed(group, started, whole)
        for attempt in range(1, ATTEMPTS + 1):
            try:
                await self._attempt(job, relayed)
                return
            except RequestCancelledError:
                return  # the client left
            except LOST as exc:
                if relayed.sent or attempt == ATTEMPTS:
                    relayed.fail(f"the replica running this request was lost ({type(exc).__name__}); send it again")
                    return
                log.warning("forerun: a replica was lost before request's first token; trying another (%s)", exc)
            except Exception as exc:  # noqa: BLE001 - a failure of the call itself: the request ends with it
                log.error("forerun: a request to the replicas failed: %s: %s", type(exc).__name__, exc)
                relayed.fail(f"{type(exc).__name__}: {exc}", "relay")  # no replica counted it
                return

    async def _attempt(self, job: Job, relayed: _Relayed) -> None:
        relayed.held = []  # a lost attempt's held events are dropped: this one starts over
        stream = self.engine.options(stream=True).generate.remote(job)
        watcher = asyncio.create_task(_cancel_when_gone(stream, relayed.group))
        try:
            async for item in stream:
                relayed.take(item)
            relayed.flush()
        finally:
            watcher.cancel()


class _Relayed:
    """What a job's attempts have passed on to its requests so far."""

    def __init__(self, group: list[Request], started: asyncio.Future, whole: bool) -> None:
        self.group, self.started, self.whole = group, started, whole
        self.sent = False  # a token reached the client (a stream): the job may not run again
        self.held: list[tuple[int, Event]] = []  # a whole answer's events, held until it is complete

    def take(self, item) -> None:
        if isinstance(item, Started):
            self._start(item.replica)
        elif isinstance(item, Refused):
            if not self.started.done():
                self.started.set_exception(item.error())
            else:  # the first replica was lost, and the next would not take the job (queue full, ...)
                message = f"the replica running this request was lost and another refused it ({item.message})"
                self._hand(0, Failed(f"{message}; send it again", "replica"))
        else:
            index, event = item
            if self.whole:
                self.held.append((index, event))
            else:
                self.sent = self.sent or isinstance(event, Delta)
                self._hand(index, event)

    def flush(self) -> None:
        """The attempt ended whole: a held answer goes to the requests."""
        for index, event in self.held:
            self._hand(index, event)
        self.held = []

    def fail(self, message: str, reason: str = "replica") -> None:
        self.held = []
        self._start(None)
        self._hand(0, Failed(message, reason))

    def _start(self, replica: str | None) -> None:
        if not self.started.done():
            self.started.set_result(replica)

    def _hand(self, index: int, event: Event) -> None:
        request = self.group[index]
        request.on_event(request, event)


async def _cancel_when_gone(stream, group: list[Request]) -> None:
    """Cancel the replica's stream once every request of the job was cancelled (the client left)."""
    while not all(r.cancelled.is_set() for r in group):
        await asyncio.sleep(CANCEL_POLL)
    stream.cancel()
