"""Which replica runs a request: the one that remembers its continuation, unless it is much busier.

Ray Serve's request-router extension point (`RequestRouter.choose_replicas`), set on the engine
deployment, runs in the caller (the ingress). A request's routing key (the prompt's first tokens,
or the client's X-Routing-Key: forerun/serve/generation.py) picks its replica by rendezvous
hashing: each replica scores hash(key, replica id) and the highest wins, so the same question goes
to the same replica, whose suffix drafter holds its earlier answer before the shared memory has
spread it, and a replica that comes or goes moves only its own keys.

Unless that replica's queue is more than `imbalance` requests longer than the shortest: then the
power of two choices (two replicas at random, Ray takes the shorter queue). Queue lengths are Ray's
own (ongoing requests per replica, from its cache or a probe), as Ray's routers read them.

`rank` is the whole placement rule, importable by tests and tools.
"""

from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from forerun.cluster.jobs import Job

IMBALANCE = 1  # requests more than the least loaded replica before affinity gives way


def score(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest(), "big")


def rank(key: str, replicas: list[str]) -> list[str]:
    """`replicas` (ids) in the order `key` prefers them."""
    return sorted(replicas, key=lambda r: score(key, r), reverse=True)


class AffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = IMBALANCE) -> None:
        self.imbalance = imbalance

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas, the first preferred: [[the key's replica], [the others]], or two at
        random when the key's replica is too busy (or the request carries no key)."""
        key = _routing_key(pending_request)
        if len(candidate_replicas) < 2:
            return [candidate_replicas]
        if key is None:
            return [random.sample(candidate_replicas, 2)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        first = by_id[rank(key, list(by_id))[0]]
        lengths = await self._queue_lengths(candidate_replicas)
        if first.replica_id in lengths and lengths[first.replica_id] - min(lengths.values()) > self.imbalance:
            return [random.sample(candidate_replicas, 2)]
        return [[first], [r for r in candidate_replicas if r is not first]]

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict:
        """Each replica's ongoing requests, as Ray knows them: its cache where it keeps one, else a
        probe (Ray 2.60's own routers do the same); a replica that does not answer is left out."""
        lengths = {}
        unknown = []
        for r in replicas:
            known = self.replica_queue_len_cache.get(r.replica_id)
            if known is None:
                unknown.append(r)
            else:
                lengths[r.replica_id] = known
        if unknown:
            for r, length in await self._probe_queue_lens(unknown, 0):
                if length is not None:
                    lengths[r.replica_id] = length
        return lengths


def _routing_key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], Job):
        return None
    return pending_request.args[0].routing_key
