"""The draft-length policy: each step drafts the length K with the most expected tokens per second,
from c(r), each source's tracked acceptance and its cost per draft token (0: a plain step).

See docs/architecture.md, Cost policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from forerun.policy.catch_up import CatchUp
from forerun.policy.pass_costs import PassCosts

DECAY = 0.95  # weight of an acceptance observation after one more (about 20 steps)
PRIOR = (1.0, 1.0)  # pseudo-counts (kept, rejected) behind a drafter's first estimate
REQUEST_PRIOR = 4.0  # a request starts from earlier requests' acceptance worth this many observations:
# its text may be unlike theirs, and a short answer must adapt within a few steps
PROBE_WAIT = (4, 64)  # plain steps before probing a drafter that is not costless: first wait, longest wait
PROBE_SHARE = 0.02  # probes may cost at most this share of the plain steps between them
COSTLESS_SHARE = 0.02  # a draft token costing under this share of c(1) counts as costless
# Drafting must promise this much more than a plain step's rate: the acceptance rule, cache roll-back
# and a drafter's bookkeeping cost a little beside what is priced, and a marginal draft is a coin toss
# (one-token drafts promising ~2 % lost ~10 % on short answers).
MARGIN = 1.05
LENGTHS_KEPT = 16  # finished requests whose lengths predict the next one's (the catch-up gate's)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one step of k drafts emits: the accepted run plus the target's own token."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def draft_rows(k: int, rows_per_token: float = 1.0, aux_rows: float = 0.0) -> int:
    """Verifier rows of a step that drafts k tokens: the root, the draft's nodes (k * rows_per_token,
    at least k: more for trees) and the aux rows that ride on every drafting step whatever k is
    (lookahead's window)."""
    return 1 + max(k, round(k * rows_per_token)) + round(aux_rows)


def best_k(
    alpha: float,
    pass_cost: Callable[[int], float],
    draft_cost: float,
    k_max: int,
    rows_per_token: float = 1.0,
    aux_rows: float = 0.0,
) -> int:
    """The draft length in [0, k_max] with the most expected tokens per second (0: a plain step);
    a step drafting k tokens verifies `draft_rows(k, rows_per_token, aux_rows)` rows."""
    best, best_rate = 0, MARGIN / pass_cost(1)
    for k in range(1, k_max + 1):
        rows = draft_rows(k, rows_per_token, aux_rows)
        rate = expected_tokens(alpha, k) / (pass_cost(rows) + k * draft_cost)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def batch_draft_length(
    lanes: list[tuple[float, float, float, float]],
    pass_cost: Callable[[int], float],
    k_max: int,
    plain_lanes: int = 0,
    draft_pass: float = 0.0,
) -> int:
    """The draft length K in [0, k_max] that every drafting sequence of a batch drafts this step,
    chosen for the most expected tokens per second of the whole batch. `lanes`: (α, c_draft, rows
    per token, aux rows) per drafting sequence; `plain_lanes` more sequences take a plain step anyway.
    K drafts each cost one pass over Σ draft_rows_i(K) rows, Σ K·c_draft_i for the lanes that draft
    alone, and K·`draft_pass` for those whose draft forwards run as one (a pooled forward's seconds),
    and emit Σ E(α_i, K): as the batch grows its rows stop being nearly free and K falls to 0."""
    plain_rows = len(lanes) + plain_lanes
    best, best_rate = 0, MARGIN * plain_rows / pass_cost(plain_rows)
    for k in range(1, k_max + 1):
        rows = plain_lanes + sum(draft_rows(k, per_token, aux) for _, _, per_token, aux in lanes)
        seconds = pass_cost(rows) + k * (draft_pass + sum(draft_cost for _, draft_cost, _, _ in lanes))
        rate = (plain_lanes + sum(expected_tokens(alpha, k) for alpha, _, _, _ in lanes)) / seconds
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class DecayedCounts:
    """Decayed counts of kept and rejected draft positions: α = kept / (kept + rejected)."""

    kept: float = PRIOR[0]
    rejected: float = PRIOR[1]

    @property
    def alpha(self) -> float:
        return self.kept / (self.kept + self.rejected)

    def observe(self, kept: float, rejected: float) -> None:
        self.kept = self.kept * DECAY + kept
        self.rejected = self.rejected * DECAY + rejected


@dataclass
class SourceFigures:
    """What the policy knows of one source of drafts: its acceptance and its cost per token."""

    history: DecayedCounts = field(default_factory=DecayedCounts)  # over earlier requests
    current: DecayedCounts = field(default_factory=DecayedCounts)  # this request
    draft_cost: float = 0.0  # seconds per proposed token, running average
    rows_per_token: float = 1.0  # verifier rows of a proposal's nodes per token asked, running average
    aux_rows: float = 0.0  # aux rows a proposal adds whatever its length (lookahead's window), running average
    timed: bool = False

    @property
    def alpha(self) -> float:
        return self.current.alpha

    @property
    def rows(self) -> tuple[float, float]:
        """(rows per token, aux rows): what `draft_rows` prices a proposal's rows by."""
        return self.rows_per_token, self.aux_rows


@dataclass
class DraftLengthPolicy:
    """Chooses each step's draft length; one per engine, its counts reset per request.

    `pass_cost` is c(r); `k_max` the most a step may draft; `fixed` always drafts k_max (the
    experiment switch). The engine calls `choose` before a step and the `record_*` events after it.
    A drafter with several sources of drafts (`auto`: suffix matches and a draft model) has each
    one's acceptance and cost kept apart: every call names the source it is about (None: a
    drafter's only one).
    """

    pass_cost: PassCosts
    k_max: int
    fixed: bool = False
    sources: dict[str | None, SourceFigures] = field(default_factory=dict)
    plain_steps: int = 0  # plain steps since the last draft or probe
    probe_wait: int = PROBE_WAIT[0]
    catch_up: CatchUp = field(default_factory=CatchUp)  # this request's ski-rental count
    # The source the policy last heard of (chosen, or proposing): a catch-up is priced with its rows
    # per token, as the source whose drafts the steps around the catch-up are made of.
    latest_source: str | None = None
    # Other sequences whose step waits on this one's (a batch's other running lanes, set by the batch
    # each step): a catch-up's seconds are theirs too, while what it saves is this sequence's alone.
    waiting: int = 0
    lengths: list[int] = field(default_factory=list)  # tokens emitted by the latest finished requests

    def start(self) -> None:
        """A new request: each source's estimate starts from its history."""
        for figures in self.sources.values():
            seen = figures.history.kept + figures.history.rejected
            weight = min(1.0, REQUEST_PRIOR / seen) if seen > 0 else 1.0
            figures.current = DecayedCounts(figures.history.kept * weight, figures.history.rejected * weight)
        self.plain_steps, self.probe_wait, self.catch_up, self.waiting = 0, PROBE_WAIT[0], CatchUp(), 0

    def figures(self, source: str | None = None) -> SourceFigures:
        """`source`'s figures to read (a fresh prior when it has none yet, not stored)."""
        return self.sources.get(source) or SourceFigures()

    def _kept_figures(self, source: str | None) -> SourceFigures:
        """`source`'s figures to update, made on its first verdict or timing."""
        figures = self.sources.get(source)
        if figures is None:
            figures = self.sources[source] = SourceFigures()
        return figures

    def costless(self, source: str | None = None) -> bool:
        """Whether `source`'s draft token costs next to nothing beside a target pass."""
        figures = self.figures(source)
        return figures.timed and figures.draft_cost < COSTLESS_SHARE * self.pass_cost(1)

    def choose(self, source: str | None = None, can_shadow: bool = False) -> tuple[int, bool]:
        """(draft length for the next step from `source`, whether it is a probe). `can_shadow`: the
        drafter may propose without being verified, so a plain step still measures it (no probes)."""
        self.latest_source = source
        if self.fixed:
            return self.k_max, False
        figures = self.figures(source)
        if not figures.timed:
            return 1, True  # a source's first draft is one token: it times the drafter
        k = best_k(figures.alpha, self.pass_cost, figures.draft_cost, self.k_max, *figures.rows)
        if k == 0 and not (can_shadow and self.costless(source)) and self.plain_steps >= self.probe_wait:
            return 1, True  # one draft token to see whether drafts recover
        return k, False

    def saving(self, draft_cost: float | None = None, alpha: float | None = None, source: str | None = None) -> float:
        """Seconds the best draft length saves per emitted token over plain steps (0: none), with
        draft tokens at `draft_cost` kept at rate `alpha` (defaults: `source`'s running figures)."""
        figures = self.figures(source)
        cost = figures.draft_cost if draft_cost is None else draft_cost
        alpha = figures.alpha if alpha is None else alpha
        k = best_k(alpha, self.pass_cost, cost, self.k_max, *figures.rows)
        if k == 0:
            return 0.0
        rows = draft_rows(k, *figures.rows)
        step = self.pass_cost(rows) + k * cost
        return max(self.pass_cost(1) - step / expected_tokens(alpha, k), 0.0)

    def pays_catch_up(
        self,
        seconds: float,
        draft_cost: float | None = None,
        alpha: float | None = None,
        remaining: int | None = None,
        emitted: int = 0,
    ) -> bool:
        """The catch-up gate (catch_up.py, a policy.catch_up.Gate): whether to pay a drafter's one-off
        `seconds` now, its tokens then costing `draft_cost` each and kept at rate `alpha`, with
        `remaining` tokens the request may still emit after the `emitted` ones; in a batch it costs
        every waiting sequence those seconds too. Always under a fixed K."""
        if self.fixed or seconds <= 0:
            return True
        saving = self.saving(draft_cost, alpha, self.latest_source)
        expected = self.expected_tokens_left(remaining, emitted)
        return self.catch_up.pays(seconds * (1 + self.waiting), saving, remaining, self.pass_cost, expected)

    def expected_tokens_left(self, remaining: int | None, emitted: int) -> int | None:
        """The tokens a request that has emitted `emitted` is expected to emit yet: what the median
        of the latest finished requests emitted beyond that, no more than `remaining`; `remaining`
        before any request has finished (None: no prediction)."""
        if not self.lengths:
            return remaining
        typical = sorted(self.lengths)[len(self.lengths) // 2]
        left = max(typical - emitted, 0)
        return left if remaining is None else min(left, remaining)

    def record_length(self, emitted: int) -> None:
        """A request finished (a stop or its max_tokens) after emitting `emitted` tokens."""
        self.lengths = [*self.lengths, emitted][-LENGTHS_KEPT:]

    def record_proposal(
        self, seconds: float, asked: int, rows: int | None, source: str | None = None, aux: int = 0
    ) -> None:
        """A proposal from `source` of `asked` tokens took `seconds` and added `rows` verifier rows,
        `aux` of them aux rows that come whatever the length asked (None: it drafted nothing, so
        nothing is timed)."""
        self.latest_source = source
        if rows is None or asked <= 0:
            return
        figures = self._kept_figures(source)
        per_token, ratio, fixed = seconds / asked, (rows - aux) / asked, float(aux)
        if figures.timed:
            per_token = 0.8 * figures.draft_cost + 0.2 * per_token
            ratio = 0.8 * figures.rows_per_token + 0.2 * ratio
            fixed = 0.8 * figures.aux_rows + 0.2 * fixed
        figures.draft_cost, figures.rows_per_token, figures.aux_rows = per_token, ratio, fixed
        figures.timed = True

    def record_drafted(self, depth: int, kept: int, probe: bool, source: str | None = None) -> None:
        """A verified draft from `source`, `depth` tokens deep, of which the first `kept` were kept."""
        rejected = 1 if kept < depth else 0
        figures = self._kept_figures(source)
        figures.current.observe(kept, rejected)
        figures.history.observe(kept, rejected)
        self.plain_steps = 0
        if probe:
            wait = PROBE_WAIT[0] if kept else min(2 * self.probe_wait, PROBE_WAIT[1])
            self.probe_wait = max(wait, self._probe_spacing(figures))

    def _probe_spacing(self, figures: SourceFigures) -> int:
        """Plain steps between probes so that a probe costs at most PROBE_SHARE of them: a one-token
        probe costs its draft token and its rows (a tree's or window's too) beyond a plain step."""
        one = self.pass_cost(1)
        extra = self.pass_cost(draft_rows(1, *figures.rows)) + figures.draft_cost - one
        return math.ceil(max(extra, 0.0) / (PROBE_SHARE * one) - 1e-9)

    def record_plain(self) -> None:
        self.plain_steps += 1

    def record_timed_step(self, rows: int, seconds: float) -> None:
        """The engine's step over `rows` verifier rows took `seconds` (pass, rule and roll-back)."""
        self.catch_up.record_timed_step(seconds)
        self.pass_cost.observe(rows, seconds)

    def record_shadow(self, kept_probability: float, source: str | None = None) -> None:
        """A costless proposal not verified: the target kept its first token with this probability."""
        figures = self._kept_figures(source)
        figures.current.observe(kept_probability, 1 - kept_probability)
        figures.history.observe(kept_probability, 1 - kept_probability)
