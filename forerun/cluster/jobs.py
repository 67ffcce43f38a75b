"""What travels between the ingress and the replicas: a job, the replica's facts, a refusal.

Plain records, so Ray pickles them cheaply; the events a job yields are the scheduler's own
(forerun/serve/scheduler.py: Delta, Done, Failed), tagged with the sample's index.
"""

from __future__ import annotations

from dataclasses import dataclass

from forerun.base.config import SamplingParams
from forerun.models.tokenizer import Tokenizer
from forerun.serve.requests import BadRequest


@dataclass
class Job:
    """The samples of one prompt, as the ingress hands them to a replica."""

    prompt_ids: list[int]
    params: list[SamplingParams]  # one per sample; the samples after the first share its prefill
    routing_key: str  # read by the router (forerun/cluster/router.py), not by the replica


@dataclass
class Facts:
    """What the ingress needs of the model to check and tokenize requests without loading it."""

    tokenizer: Tokenizer | None
    vocab_size: int
    context: int  # the model's most positions
    method: str | None  # the speculation method, None: none


@dataclass
class Refused:
    """A replica would not take the job (queue full, shutting down, does not fit): the HTTP error."""

    message: str
    param: str | None
    status: int
    kind: str
    code: str | None

    @classmethod
    def of(cls, exc: BadRequest) -> Refused:
        return cls(exc.message, exc.param, exc.status, exc.kind, exc.code)

    def error(self) -> BadRequest:
        return BadRequest(self.message, self.param, self.status, self.kind, self.code)


@dataclass
class Started:
    """A replica took the job: its first item, naming the replica."""

    replica: str
