"""The ingress's /metrics: every replica's Prometheus series and the ingress's own, one `replica` label apart.

Each replica counts what it ran (finished requests, tokens, speculation, engine failures, its queue)
in `forerun serve`'s names (forerun/serve/metrics.py) and pushes them to the hub; the ingress counts
only what it decides itself: requests refused before any replica saw them, and requests lost with a
replica (`request_failure`). /metrics shows them all, each series labelled `replica="<id>"` (the
ingress's `replica="ingress"`), so `sum by (...)` in PromQL gives the cluster's totals and the
label shows the spread. Ray's own per-node metrics port (`ray.util.metrics`) is not used.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from forerun.engine.engine import RequestOutput
from forerun.serve.metrics import ServerMetrics
from forerun.serve.scheduler import Request

INGRESS = "ingress"  # the `replica` label of the ingress's own series


class IngressMetrics(ServerMetrics):
    """The ingress's own counts: refusals and lost requests; the rest is counted by the replicas."""

    def finished(self, request: Request, output: RequestOutput) -> None:
        pass  # counted by the replica that ran it

    def failed(self, reason: str = "engine") -> None:
        # A replica lost could not count it, nor one the ingress's call failed before a replica had
        # it ("relay"); a replica counted its own engine failures.
        if reason in ("replica", "relay"):
            self.failures.inc()

    def merged(self, reports: dict[str, str]) -> tuple[bytes, str]:
        """/metrics' body: the ingress's series and each replica's (`reports`: replica -> its text)."""
        texts = {INGRESS: generate_latest(self.registry).decode(), **reports}
        registry = CollectorRegistry()
        registry.register(_Labelled(texts))
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _Labelled:
    """A collector of parsed texts, each sample labelled with the text's source."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for source, text in self.texts.items():
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                merged.samples += [
                    Sample(s.name, {**s.labels, "replica": source}, s.value, s.timestamp, s.exemplar)
                    for s in family.samples
                ]
        yield from families.values()
