"""`auto-head`: `auto` with a trained head in place of the draft model: the suffix drafter's
proposal when its match is long, else the head's (EAGLE or Medusa, whichever the folder holds).

The head reads the target's features at every step, the suffix drafter's steps included, so it
is in step whenever it is asked; both proposals go through the same verifier and exact rule. As in
`auto`, `next_source` says before a step which of the two will propose and `source` after it which
did, so the cost policy keeps each one's acceptance and cost apart, and `costless_source` offers
the suffix drafter's long matches to a full batch.

Cost: a suffix look-up every step (microseconds) and the head's drafting only on steps without a
long match; no second model in memory. Where it loses: a head trained on little data guesses well
only on text like its training text, and then the suffix drafter's matches are all it adds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters import register
from forerun.drafters.base import Drafter
from forerun.drafters.suffix import SuffixDrafter, SuffixMemory
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel
from forerun.verification.tree import DraftTree


@register("auto-head", cli_options={"speculative_head": "head", "auto_long_match": "long_match"})
class AutoHeadDrafter(Drafter):
    reads_features = True

    def __init__(
        self,
        target: LoadedModel,
        head: str | None = None,
        long_match: int = 8,
        memory: SuffixMemory | None = None,
    ) -> None:
        """`head`: a folder made by `forerun train` (EAGLE or Medusa); `long_match`: the shortest
        suffix match (tokens) whose continuation is proposed instead of the head's; `memory`: the
        suffix drafter's memory of earlier outputs, when shared (SuffixDrafter)."""
        from forerun.drafters.eagle import EagleDrafter
        from forerun.drafters.medusa import MedusaDrafter
        from forerun.heads import read_config

        if head is None:
            raise ForerunError(
                "--speculative-method auto-head needs --speculative-head DIR (train one with "
                "`forerun train --method eagle`)"
            )
        kind = read_config(head).method
        self.suffix = SuffixDrafter(target, memory=memory)
        self.head = EagleDrafter(target, head) if kind == "eagle" else MedusaDrafter(target, head)
        self.kind = kind
        self.long_match = long_match
        self.steps = {"suffix": 0, kind: 0}  # proposals made by each, this process
        self.source = kind  # which made the last proposal

    @property
    def memory(self) -> SuffixMemory:
        return self.suffix.memory

    def max_rows(self, k: int) -> int:
        return max(self.suffix.max_rows(k), self.head.max_rows(k))

    def start(self, prompt_ids: list[int], target_cache: KVCache, max_len: int) -> None:
        self.suffix.start(prompt_ids, target_cache, max_len)
        self.head.start(prompt_ids, target_cache, max_len)

    def features(self, hidden: torch.Tensor) -> None:
        self.head.features(hidden)  # every step's, so the head is in step when it is asked

    def set_pass_cost(self, pass_cost: Callable[[int], float]) -> None:
        self.head.set_pass_cost(pass_cost)

    def next_source(self, context: list[int], params: SamplingParams) -> str:
        """Which will propose after `context`: the suffix drafter on a long match, else the head."""
        return "suffix" if self.suffix.match_length(context) >= self.long_match else self.kind

    def costless_source(self, context: list[int], params: SamplingParams) -> str | None:
        """ "suffix" when a long match makes the coming proposal the suffix drafter's."""
        return "suffix" if self.suffix.match_length(context) >= self.long_match else None

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> DraftTree | None:
        return self._propose(context, k, params, generator, None)

    def propose_steps(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        source: str | None = None,
    ):
        """`propose` from the source the step planned (None: the head unless the suffix drafter
        has a long match); neither runs a forward a batch could pool."""
        return self._propose(context, k, params, generator, source)
        yield  # a generator that yields nothing

    def _propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        source: str | None,
    ) -> DraftTree | None:
        tree, match = self.suffix.propose_with_match(context, k, params, generator)
        if (tree is None or match < self.long_match) if source is None else source == self.kind:
            drafted = self.head.propose(context, k, params, generator)
            if drafted is not None:  # None: the head has nothing (its features out of step)
                self.source = self.kind
                self.steps[self.kind] += 1
                return drafted
        self.source = "suffix"
        self.steps["suffix"] += 1
        return tree

    def end(self, output_ids: list[int]) -> None:
        self.suffix.end(output_ids)

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        if self.source == self.kind:
            self.head.observe(num_accepted, aux_logits)

    def cost_per_token(self) -> float | None:
        return self.head.cost_per_token() if self.source == self.kind else None
