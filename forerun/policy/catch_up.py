"""The catch-up gate: when to pay a drafter's one-off cost before it can draft (a draft model reading
a long prompt), decided the way one decides to buy rather than rent (ski rental), with a prediction
of the request's length (Purohit, Svitkina and Kumar, "Improving Online Algorithms via ML
Predictions", NeurIPS 2018): where the tokens the request is expected to emit win the cost back
1 / TRUST times over, it is paid once a TRUST share of it is forgone, not all of it.

See docs/architecture.md, Cost policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# A catch-up this short is part of drafting's rhythm (a step's accepted tokens, a suffix draft's
# run) and is paid without asking; longer ones (a prompt) are the gate's call.
CATCH_UP_UNASKED = 16
# Where the expected length of the request wins a catch-up back 1 / TRUST times over, it is paid once
# this share of its cost is forgone (1 is plain ski rental, 2-competitive whatever the length; at
# 0.25 a catch-up a prediction misjudged costs at most 1.25 times its cost in savings forgone and
# paid, where one judged right costs a quarter of its cost beside it). The margin guards the saving's
# estimate too: it comes from earlier requests, and a long prompt of another kind (RAG: its answer
# kept drafts a third as often as code's, run 89) may save a fraction of it.
TRUST = 0.25

# What a drafter with a one-off cost asks before paying it: (its seconds, the seconds a draft token
# then costs (None: not known yet), the share of draft tokens kept, the tokens the request may still
# emit (None: not known), the tokens it has emitted) -> whether to pay it now.
Gate = Callable[[float, float | None, float, int | None, int], bool]


@dataclass
class CatchUp:
    """One request's ski-rental count: what drafting would have saved on the steps taken while a
    catch-up waited. The catch-up is paid once that reaches its cost."""

    forgone: float = 0.0  # seconds drafting would have saved while a catch-up waited
    asked_at: int | None = None  # the tokens the request could still emit when last asked
    unasked_seconds: float = 0.0  # seconds of the steps timed since then

    def record_timed_step(self, seconds: float) -> None:
        self.unasked_seconds += seconds

    def pays(
        self,
        seconds: float,
        saving: float,
        remaining: int | None,
        pass_cost: Callable[[int], float],
        expected: int | None = None,
    ) -> bool:
        """Whether to pay a catch-up of `seconds` now, drafting then saving `saving` seconds per
        emitted token; `remaining`: tokens the request may still emit; `expected`: the tokens it is
        expected to emit yet (None: no prediction). No: the step goes without it, and what drafting
        would have saved on it counts towards paying next time: the time the steps since the last
        ask took beyond what their tokens would have cost drafted (a plain step forgoes one token's
        saving; a step of kept suffix drafts, whose tokens came cheap anyway, forgoes nothing), or
        one token's saving a step where steps are not timed alone (a batch). Paid once the savings
        forgone reach `seconds`, or, where `expected` tokens win it back 1 / TRUST times over, once
        those forgone and the coming step's reach TRUST of it (a short prompt before a long answer
        is read at once).
        Never when even drafting every remaining token could not save `seconds`."""
        if remaining is not None and saving * remaining < seconds:
            return False  # the tokens left could not win it back
        if expected is not None and TRUST * saving * expected >= seconds and self.forgone + saving >= TRUST * seconds:
            self.forgone, self.asked_at, self.unasked_seconds = 0.0, remaining, 0.0
            return True
        forgone = saving
        if remaining is not None and self.asked_at is not None and self.unasked_seconds > 0:
            emitted = max(1, self.asked_at - remaining)
            forgone = max(0.0, self.unasked_seconds - emitted * (pass_cost(1) - saving))
        self.asked_at, self.unasked_seconds = remaining, 0.0
        if self.forgone >= seconds:
            self.forgone = 0.0
            return True
        self.forgone += forgone
        return False
