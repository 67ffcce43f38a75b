"""What travels between the ingress and the replicas: a job, the replica's facts, a refusal.

Plain records, so Ray pickles them cheaply; the events a job yields are the scheduler's own
(forerun/serve/scheduler.py: Delta, Done, Failed), tagged with the sample's index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from forerun.base.config import SamplingParams
from forerun.models.card import ModelCard
from forerun.models.tokenizer import Tokenizer
from forerun.serve.requests import BadRequest

if TYPE_CHECKING:
    from forerun.serve.scheduler import Request


@dataclass
class Job:
    """One HTTP request's samples (`n` of each of its prompts: a completions request may batch
    several), as the ingress hands them to a replica, which takes them all or none."""

    prompts: list[list[int]]  # each prompt's token ids
    params: list[list[SamplingParams]]  # per prompt, one per sample; its samples after the first share its prefill
    routing_key: str  # read by the router (forerun/cluster/router.py), not by the replica
    prompt_only: bool = False  # echo with max_tokens 0 (forerun/serve/scheduler.Request.prompt_only)

    @classmethod
    def of(cls, group: list[Request], routing_key: str) -> Job:
        """The job of `group`, in forerun/serve/inflight.new_group's order (each prompt's samples
        together, its first leading), which the replica's new_group rebuilds index for index."""
        prompts: list[list[int]] = []
        params: list[list[SamplingParams]] = []
        for request in group:
            if request.like is None:  # a prompt's first sample
                prompts.append(request.prompt_ids)
                params.append([])
            params[-1].append(request.params)
        return cls(prompts, params, routing_key, group[0].prompt_only)


@dataclass
class Facts:
    """What the ingress needs of the model to check and tokenize requests without loading it."""

    tokenizer: Tokenizer | None
    vocab_size: int
    context: int  # the model's most positions
    method: str | None  # the speculation method, None: none
    card: ModelCard  # the model's facts /v1/models and /props give


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
