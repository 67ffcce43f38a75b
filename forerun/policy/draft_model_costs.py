"""A draft model's own cost figures (a draft token, a catch-up's token, a forward pooled by a batch's
lanes) and the rules that price its drafts with them: end a draft once another token cannot pay,
and add a second-choice leaf only where its verified row pays.

See docs/architecture.md, Cost policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from forerun.models import linear
from forerun.models.attention import RowLayout
from forerun.models.decoder import Decoder
from forerun.policy.draft_length import DecayedCounts
from forerun.policy.pass_costs import PassCosts

READ_PROBE_ROWS = 32  # rows of the pass that times a catch-up's cost per token
BATCH_PRIOR_ROWS = 16  # rows of a pooled draft forward estimated before any is timed
# Kept and rejected pseudo-counts behind the acceptance a draft model expects before its first
# verdict: a draft of the target's own family is usually right (0.78-0.85 at the first position
# measured). It only decides when a catch-up pays; verdicts replace it.
DRAFT_PRIOR = (4.0, 1.0)
SECOND_CHOICE = 0.05  # the least draft probability of a second-choice leaf's path (greedy; above 1: none)
# Tokens by which the draft model continues its first second-choice leaf (greedy; 0: none). Off: on
# the Zen 4 two tokens made `auto` 3.5 % slower on coding (run 86), the extra rows costing more than
# the few more tokens a pass they kept.
BRANCH = 0


def time_draft_passes(decoder: Decoder, head: nn.Module | None) -> tuple[float, float]:
    """(seconds per token of a catch-up pass, seconds of a one-token pass), the fastest of a few."""
    rows = min(READ_PROBE_ROWS, decoder.cfg.max_position - 1)
    cache = decoder.new_cache(rows + 1)
    ids = torch.zeros(rows + 1, dtype=torch.long, device=decoder.device)
    pos = torch.arange(rows + 1, device=decoder.device)
    best = {rows: float("inf"), 1: float("inf")}
    with torch.inference_mode():
        for _ in range(3):
            for n, first in ((rows, 0), (1, rows)):
                cache.truncate(first)
                start = time.perf_counter()
                with linear.prefill() if n > 1 else nullcontext():
                    decoder(
                        ids[first : first + n],
                        pos[first : first + n],
                        cache,
                        layout=RowLayout.chain(first, n),
                        last_only=True,
                        head=head,
                    )
                best[n] = min(best[n], time.perf_counter() - start)
    return best[rows] / rows, best[1]


def pooled_prior(read_seconds: float, token_seconds: float) -> PassCosts:
    """Seconds of a draft forward over r rows (one per lane) before any is timed: a one-token
    forward, until r rows cost more at a catch-up's per-row rate (rows are nearly free until they
    are not); learning from the pooled forwards timed."""
    return PassCosts([max(token_seconds, rows * read_seconds) for rows in range(1, BATCH_PRIOR_ROWS + 1)], learn=True)


@dataclass
class DraftModelCosts:
    """One draft-model drafter's running figures, and the target's c(r) once the engine gives it."""

    token_seconds: float | None = None  # running mean time of a one-token draft forward
    read_seconds: float | None = None  # running mean time per token of a catch-up pass
    acceptance: DecayedCounts = field(default_factory=lambda: DecayedCounts(*DRAFT_PRIOR))  # over every request
    pass_cost: Callable[[int], float] | None = None  # the target's c(rows)

    def record_pass(self, rows: int, seconds: float) -> None:
        """A draft forward over `rows` rows ran alone in `seconds`: a one-token forward times a draft
        token, a long one a catch-up's token."""
        if rows == 1:
            # One stalled pass (the machine is shared) counts as at most twice the running figure.
            previous = self.token_seconds
            self.token_seconds = seconds if previous is None else 0.8 * previous + 0.2 * min(seconds, 2 * previous)
        elif rows >= 8:  # long enough that the per-row cost dominates
            per_row, previous = seconds / rows, self.read_seconds
            self.read_seconds = per_row if previous is None else 0.8 * previous + 0.2 * per_row

    def age(self, timed_token_seconds: float) -> None:
        """After a request in which the draft model never drafted, its token cost moves halfway
        back to the timed figure. The gate admits a catch-up on it, and only drafting updates it:
        without ageing, one slow pass would shut the draft model out of every later request. (Its
        acceptance does not age: it is what keeps a draft model that is usually wrong on this
        traffic from being tried again on every short answer.)"""
        if self.token_seconds is not None:
            self.token_seconds = (self.token_seconds + timed_token_seconds) / 2

    def worth_another(self, kept_chance: float, token_seconds: float | None, drafted: int) -> bool:
        """Whether a token after `drafted` ones, all kept with probability `kept_chance`, pays for its
        draft forward (`token_seconds`, None: not known) and its verified row."""
        return token_seconds is None or self.saves(kept_chance, token_seconds, drafted + 1)

    def leaf_pays(self, chance: float, rows: int, least: float) -> bool:
        """Whether a second-choice leaf the target keeps with probability about `chance` (the
        draft's own probability of its path) pays for one more verified row beside `rows`: at least
        `least`, and, with the target's costs known, a pass saved that often outweighs the row."""
        return chance >= least and (self.pass_cost is None or self.saves(chance, 0.0, rows))

    def saves(self, chance: float, seconds: float, rows: int) -> bool:
        """Whether a verified row beside `rows` others, kept with probability `chance`, saves more
        (a target pass that often) than it costs (`seconds` to draft it, and the row)."""
        return chance * self.pass_cost(1) > seconds + self.pass_cost(rows + 1) - self.pass_cost(rows)
