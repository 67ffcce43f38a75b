"""Whether a batch of a given size drafts at all: its steps' measured tokens per second with drafting
and without, the faster chosen and the other tried again now and then (explore/exploit).

See docs/architecture.md, Cost policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EXPLORE_EVERY = 16  # steps between tries of the option that measured worse, at the least
EXPLORE_SHARE = 0.02  # and never so often that those tries cost more than this share of the time
EXPLORE_MAX = 512  # each try that measured worse again doubles the steps to the next, up to this
# Drafting is chosen only while it measures this much faster than plain steps: its steps' rates leave
# out what drafting costs beside them (a drafting step is longer, and requests waiting to join wait
# for it; a switch to drafting makes every lane's draft model catch up), and two nearly equal noisy
# rates would otherwise flip the choice back and forth at random (seen with 15-16 lanes).
DRAFTING_EDGE = 0.05


@dataclass
class Rates:
    """Tokens per second and seconds per step of one batch size's steps, with drafting and
    without (running means)."""

    drafting: float | None = None
    plain: float | None = None
    drafting_s: float | None = None
    plain_s: float | None = None
    since: int = 0  # steps since the worse option was last tried
    losses: int = 0  # tries in a row after which the same option still measured better
    trying: bool = False  # the step being taken is a try of the worse option

    def choose_drafting(self) -> bool:
        """Draft this step? Each option is tried first; then the faster one, and the other again
        now and then (acceptance and the batch's make-up drift), as often as it is cheap to."""
        if self.plain is None or self.drafting is None:
            return self.drafting is None
        better = self.drafting_better()
        self.since += 1
        if self.since >= self.explore_every(better):
            self.since, self.trying = 0, True
            return not better
        return better

    def drafting_better(self) -> bool:
        """Drafting measures faster than plain steps, by DRAFTING_EDGE at least (both measured)."""
        return self.drafting >= self.plain * (1 + DRAFTING_EDGE)

    def explore_every(self, drafting_better: bool) -> int:
        """Steps between tries of the worse option: a try loses its step's time times the share of
        throughput it gives up, and that may be at most EXPLORE_SHARE of the steps between tries;
        and EXPLORE_EVERY doubled for each try in a row that changed nothing (up to EXPLORE_MAX)."""
        if drafting_better:
            worse, best, worse_s, best_s = self.plain, self.drafting, self.plain_s, self.drafting_s
        else:
            worse, best, worse_s, best_s = self.drafting, self.plain, self.drafting_s, self.plain_s
        backoff = min(EXPLORE_EVERY << min(self.losses, 16), EXPLORE_MAX)
        loss = worse_s * (1 - worse / best) if best > 0 else 0.0
        return max(backoff, math.ceil(loss / (EXPLORE_SHARE * best_s) - 1e-9)) if best_s else backoff

    def record(self, drafting: bool, rate: float, seconds: float) -> None:
        def mean(old: float | None, new: float) -> float:
            return new if old is None else 0.7 * old + 0.3 * new

        before = self.drafting_better() if self.trying else None  # a try is made only once both have figures
        if drafting:
            self.drafting, self.drafting_s = mean(self.drafting, rate), mean(self.drafting_s, seconds)
        else:
            self.plain, self.plain_s = mean(self.plain, rate), mean(self.plain_s, seconds)
        if self.trying:
            self.trying = False
            self.losses = self.losses + 1 if self.drafting_better() == before else 0
