"""What the replicas share: one memory of finished answers, and the metrics each one last reported.

A Ray Serve deployment of one replica (`Hub`) holding a `SharedAnswers` and the reports. A replica
publishes every answer it finishes and, a few times a second, takes the answers the others
published since it last asked; its suffix drafter then drafts from them (forerun/cluster/replica.py).
So a question answered on one replica drafts from that answer on every other. The memory is bounded
in tokens, oldest out first; a replica that starts (or restarts) takes all that is kept.

Metrics: each replica pushes its Prometheus text every second; the ingress merges them at its
/metrics with a `replica` label (forerun/cluster/metrics.py). A report not renewed for
REPORT_TTL seconds (a replica gone) is dropped.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

REPORT_TTL = 120.0  # seconds a replica's last metrics stay after it stopped reporting


@dataclass
class Answer:
    seq: int  # the order it was published in, from 1
    origin: str  # the replica that answered
    token_ids: list[int]


class SharedAnswers:
    """Answers published by any replica, the most recent `max_tokens` tokens of them."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.answers: collections.deque[Answer] = collections.deque()  # oldest first
        self.size = 0  # tokens kept
        self.seq = 0  # the last answer's seq

    def publish(self, origin: str, token_ids: list[int]) -> None:
        if not token_ids:
            return
        self.seq += 1
        kept = list(token_ids[-self.max_tokens :])
        self.answers.append(Answer(self.seq, origin, kept))
        self.size += len(kept)
        while self.size > self.max_tokens:
            self.size -= len(self.answers.popleft().token_ids)

    def since(self, reader: str, cursor: int) -> tuple[int, list[list[int]]]:
        """(the new cursor, the answers after `cursor` that replicas other than `reader` gave)."""
        fresh = [a.token_ids for a in self.answers if a.seq > cursor and a.origin != reader]
        return self.seq, fresh


class Hub:
    """The shared answers and the replicas' metrics reports (deployed by forerun/cluster/app.py)."""

    def __init__(self, max_tokens: int) -> None:
        self.answers = SharedAnswers(max_tokens)
        self.reports: dict[str, tuple[float, str]] = {}  # replica -> (when, Prometheus text)

    async def publish(self, origin: str, token_ids: list[int]) -> None:
        self.answers.publish(origin, token_ids)

    async def since(self, reader: str, cursor: int) -> tuple[int, list[list[int]]]:
        return self.answers.since(reader, cursor)

    async def report(self, replica: str, text: str) -> None:
        self.reports[replica] = (time.monotonic(), text)

    async def live(self, within_s: float) -> list[str]:
        """The replicas that reported within the last `within_s` seconds."""
        now = time.monotonic()
        return sorted(r for r, (t, _) in self.reports.items() if now - t < within_s)

    async def collected(self) -> dict[str, str]:
        """Every live replica's last metrics text."""
        now = time.monotonic()
        self.reports = {r: (t, text) for r, (t, text) in self.reports.items() if now - t < REPORT_TTL}
        return {r: text for r, (_, text) in self.reports.items()}
