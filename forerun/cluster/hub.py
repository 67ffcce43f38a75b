"""What the replicas share: one memory of finished answers, and the metrics each one last reported.

A Ray Serve deployment of one replica (`Hub`) holding a `SharedAnswers` and the reports. A replica
publishes every answer it finishes and, a few times a second, takes the answers the others
published since it last asked; its suffix drafter then drafts from them (forerun/cluster/replica.py).
So a question answered on one replica drafts from that answer on every other. The memory is bounded
in tokens, oldest out first; a replica that starts (or restarts) takes all that is kept.

Metrics: each replica pushes its Prometheus text every second, and its lanes (GET /slots); the
ingress merges the texts at its /metrics with a `replica` label (forerun/cluster/metrics.py) and
numbers the lanes on from one replica to the next. A report not renewed for GAUGE_TTL
seconds (a replica gone) loses its gauges (its running and waiting requests, which would otherwise
count as load no replica carries); one not renewed for REPORT_TTL seconds is dropped.

Shutdown: `forerun serve --ray` tells the hub (`drain`); each replica hears it with its next report
and drains its scheduler as `forerun serve` does, and the command waits until none is `busy`. A
second signal drains again with grace 0, which the replicas take as a shorter grace: cut now.
"""

from __future__ import annotations

import collections
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forerun.serve.scheduler import Slot

REPORT_TTL = 120.0  # seconds a replica's last counters stay after it stopped reporting
GAUGE_TTL = 5.0  # seconds its last gauges stay (it reports every second)
DRAIN_LIVE_S = 3.0  # a replica silent this long is not waited for by a shutdown (it is gone)


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


@dataclass
class Report:
    when: float  # time.monotonic() when it came
    text: str  # the replica's Prometheus text
    busy: int = 0  # its requests running or waiting
    draining: bool = False  # it heard of the shutdown
    slots: list[Slot] = field(default_factory=list)  # its lanes, for GET /slots


class Hub:
    """The shared answers, the replicas' metrics reports, and the shutdown they hear of (deployed by
    forerun/cluster/app.py)."""

    def __init__(self, max_tokens: int) -> None:
        self.answers = SharedAnswers(max_tokens)
        self.epoch = uuid.uuid4().hex  # this hub's life: a replica's cursor from another life starts over
        self.reports: dict[str, Report] = {}  # replica -> its last report
        self.grace: float | None = None  # set by `drain`: the seconds running requests get

    async def publish(self, origin: str, token_ids: list[int]) -> None:
        self.answers.publish(origin, token_ids)

    async def since(self, reader: str, cursor: tuple[str, int] | None) -> tuple[tuple[str, int], list[list[int]]]:
        """(the new cursor, the answers other replicas gave after `cursor`); a cursor None, or from
        before the hub restarted, takes all that is kept."""
        seq = cursor[1] if cursor is not None and cursor[0] == self.epoch else 0
        seq, fresh = self.answers.since(reader, seq)
        return (self.epoch, seq), fresh

    async def report(
        self, replica: str, text: str, busy: int = 0, draining: bool = False, slots: list[Slot] | None = None
    ) -> float | None:
        """A replica's metrics, state and lanes; the grace it should drain with once the app is stopping."""
        self.reports[replica] = Report(time.monotonic(), text, busy, draining, slots or [])
        return self.grace

    async def slots(self) -> dict[str, list[Slot]]:
        """The lanes of every replica that reported within GAUGE_TTL seconds, by replica."""
        now = time.monotonic()
        return {r: report.slots for r, report in self.reports.items() if now - report.when < GAUGE_TTL}

    async def live(self, within_s: float) -> list[str]:
        """The replicas that reported within the last `within_s` seconds."""
        now = time.monotonic()
        return sorted(r for r, report in self.reports.items() if now - report.when < within_s)

    async def collected(self) -> dict[str, str]:
        """Every replica's last metrics text; without its gauges once it is silent GAUGE_TTL seconds."""
        now = time.monotonic()
        self.reports = {r: report for r, report in self.reports.items() if now - report.when < REPORT_TTL}
        return {
            r: report.text if now - report.when < GAUGE_TTL else without_gauges(report.text)
            for r, report in self.reports.items()
        }

    async def drain(self, grace: float) -> None:
        """The app is stopping: each replica hears it with its next report and drains (again with
        a shorter grace: a second signal's 0 cuts now)."""
        self.grace = grace

    async def stopping(self) -> bool:
        return self.grace is not None

    async def busy(self) -> int:
        """Requests the replicas reporting lately still run or hold, and those not yet draining."""
        now = time.monotonic()
        live = [report for report in self.reports.values() if now - report.when < DRAIN_LIVE_S]
        return sum(report.busy + (not report.draining) for report in live)


def without_gauges(text: str) -> str:
    """Prometheus `text` with its gauge families left out (a value now, which a silent replica no
    longer has); counters and histograms, which only grow, stay."""
    lines = text.splitlines()
    gauges = {line.split()[2] for line in lines if line.startswith("# TYPE ") and line.split()[3:] == ["gauge"]}
    return "".join(f"{line}\n" for line in lines if _family(line) not in gauges)


def _family(line: str) -> str:
    """The family a line of Prometheus text names: a sample's name, or a HELP or TYPE line's."""
    if line.startswith("#"):
        words = line.split()
        return words[2] if len(words) > 2 and words[1] in ("HELP", "TYPE") else ""
    return line.split("{", 1)[0].split(" ", 1)[0]
