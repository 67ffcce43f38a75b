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

import torch

from forerun.base.errors import ForerunError
from forerun.drafters import register
from forerun.drafters.auto import SuffixFirst
from forerun.drafters.suffix import SuffixMemory
from forerun.models.load import LoadedModel


@register("auto-head", cli_options={"speculative_head": "head", "auto_long_match": "long_match"})
class AutoHeadDrafter(SuffixFirst):
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
        self.head = EagleDrafter(target, head) if kind == "eagle" else MedusaDrafter(target, head)
        super().__init__(target, self.head, kind, long_match, memory)

    def features(self, hidden: torch.Tensor) -> None:
        self.head.features(hidden)  # every step's, so the head is in step when it is asked
