"""Speculate only when it pays: each step's draft length from measured costs and tracked acceptance.

A step that drafts K tokens, each kept with probability α while the ones before it were kept, emits
E(K) = (1 − α^(K+1)) / (1 − α) tokens on average and costs c(K+1) + K·c_draft seconds: one target
pass over the root and K draft rows, plus K draft tokens. K = 0 is a plain step (one token for
c(1)). The policy picks the K in [0, k_max] with the most tokens per second.

- c(r), the target's pass over r rows, is measured once per machine, model and numeric format (every
  r up to 16, then a few wider passes up to 128 rows, for a full batch's drafts; linear between
  them) and cached under FORERUN_HOME/costs (a few seconds for a 1.5B model; delete the folder to measure
  again), then corrected by the steps actually timed: the acceptance rule, a tree's cache
  compaction and a busy machine all count.
- c_draft, the drafter's cost per proposed token, is timed on every proposal as generation goes.
- α is counted per request from what the target keeps (decayed, so it follows the text), starting
  from what this drafter achieved over earlier requests. A drafter with several sources of drafts
  (`auto`: suffix matches and a draft model) has each source's α and c_draft kept apart, so a
  free, often-wrong suffix guess neither hides nor stands in for a dearer, usually-right draft model.

A draft model must first read what it has not seen (the prompt, or tokens a suffix draft emitted)
before it can draft: a one-off cost that a long prompt makes larger than anything a short answer
could win back. The policy pays it the way one decides to buy rather than rent (ski rental): each
step taken without the draft model adds what drafting would have saved on it, and the catch-up is
paid once that sum reaches its cost. A short answer then never pays for reading a long prompt, and a
long one loses at most the catch-up's cost again before it drafts.

When the policy chooses 0, nothing is verified and α would stop moving. Drafters whose proposals are
free and leave no state behind (prompt lookup, suffix) still propose in the shadow of the plain step,
and the target's probability of their first token updates α at no cost. Other drafters are probed
with one draft token after a number of plain steps that doubles after every probe that fails (up to
64), and is never so short that probes cost more than 2 % of the plain steps between them (a probe
of a dear drafter, early exit's or lookahead's, waits longer), so a prompt where drafts keep failing
stays within a few per cent of plain decoding.

Where it loses: c(r) is taken at one cache length, and the chain model counts a tree's branches as
extra rows only through the proposal's actual size; α is assumed the same at every position.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forerun.base import cpu
from forerun.base.paths import forerun_home
from forerun.models.attention import RowLayout
from forerun.models.gguf_format import GGUFLinear
from forerun.models.load import LoadedModel, model_identity
from forerun.models.w8a8 import W8A8Linear

POLICIES = ("adaptive", "fixed")
MEASURED_ROWS = 16  # c(r) is measured for r = 1 .. 16,
WIDE_ROWS = (24, 32, 48, 64, 96, 128)  # and at these wider passes (a full batch's rows), linear between
MEASURE_CONTEXT = 256  # cache length the passes are timed at
DECAY = 0.95  # weight of an acceptance observation after one more (about 20 steps)
PRIOR = (1.0, 1.0)  # pseudo-counts (kept, rejected) behind a drafter's first estimate
REQUEST_PRIOR = 4.0  # a request starts from earlier requests' acceptance worth this many observations:
# its text may be unlike theirs, and a short answer must adapt within a few steps
LEARN_AFTER = 3  # steps over a row count before its own running mean replaces the scaled offline figure
PROBE_WAIT = (4, 64)  # plain steps before probing a non-free drafter: first wait, longest wait
PROBE_SHARE = 0.02  # probes may cost at most this share of the plain steps between them
FREE_SHARE = 0.02  # a draft token costing under this share of c(1) counts as free
MARGIN = 1.05  # drafting must promise this much more than a plain step's rate: the
# acceptance rule, cache roll-back and a drafter's bookkeeping cost a
# little beside what is priced, and a marginal draft is a coin toss
# (measured: one-token drafts promising ~2 % lost ~10 % on short answers)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one step of k drafts emits: the accepted run plus the target's own token."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def best_k(
    alpha: float, pass_cost: Callable[[int], float], draft_cost: float, k_max: int, rows_per_token: float = 1.0
) -> int:
    """The draft length in [0, k_max] with the most expected tokens per second (0: a plain step).

    A proposal of k tokens adds about k * rows_per_token verifier rows (more than k for trees and
    aux rows)."""
    best, best_rate = 0, MARGIN / pass_cost(1)
    for k in range(1, k_max + 1):
        rows = 1 + max(k, round(k * rows_per_token))
        rate = expected_tokens(alpha, k) / (pass_cost(rows) + k * draft_cost)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def batch_draft_length(
    lanes: list[tuple[float, float, float]],
    pass_cost: Callable[[int], float],
    k_max: int,
    plain_lanes: int = 0,
    draft_pass: float = 0.0,
) -> int:
    """The draft length K in [0, k_max] that every drafting sequence of a batch drafts this step,
    chosen for the most expected tokens per second of the whole batch. `lanes`: (α, c_draft, rows
    per token) per drafting sequence; `plain_lanes` more sequences take a plain step anyway. K drafts
    each cost one pass over Σ (1 + rows_i(K)) rows, Σ K·c_draft_i for the lanes that draft alone, and
    K·`draft_pass` for those whose draft forwards run as one (a shared forward's seconds), and emit
    Σ E(α_i, K): as the batch grows its rows stop being nearly free and K falls to 0."""
    plain_rows = len(lanes) + plain_lanes
    best, best_rate = 0, MARGIN * plain_rows / pass_cost(plain_rows)
    for k in range(1, k_max + 1):
        rows = plain_lanes + sum(1 + max(k, round(k * per_token)) for _, _, per_token in lanes)
        seconds = pass_cost(rows) + k * (draft_pass + sum(draft_cost for _, draft_cost, _ in lanes))
        rate = (plain_lanes + sum(expected_tokens(alpha, k) for alpha, _, _ in lanes)) / seconds
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class PassCosts:
    """The target's pass time for 1 .. len(seconds) rows, and for the row counts in `wide` past
    them; linear between those, and past the last with the last two's slope.

    Made non-decreasing: a timing above a wider pass's is noise. With `learn`,
    the steps the engine times (the pass plus the acceptance rule and cache roll-back, on a machine
    as busy as it is now) correct it as generation goes: a row count seen a few times is its own
    running mean, the others the offline figure times the running ratio of seen to offline. Plain
    steps (one row) and verifications keep separate ratios: a verification's work around the pass
    (a tree's mask, the rule over its nodes, a window's rows) is not in the offline figure, and a
    drafter whose row count changes every step is priced by it before any count is seen often."""

    seconds: list[float]
    wide: dict[int, float] = field(default_factory=dict)  # rows past len(seconds) -> seconds
    learn: bool = False
    scale: float = 1.0  # running mean of seen / offline, one-row steps
    multi_scale: float | None = None  # the same over steps of several rows
    online: dict[int, float] = field(default_factory=dict)  # rows -> running mean of seen step times
    seen: dict[int, int] = field(default_factory=dict)  # rows -> steps seen

    def __post_init__(self) -> None:
        # Noise only adds time: a timing above a wider pass's is a slow moment, and comes down to it
        # (raising the wider ones instead would spread one slow moment over every row count after it).
        wide = dict(sorted((r, t) for r, t in self.wide.items() if r > len(self.seconds)))
        times = [*self.seconds, *wide.values()]
        for i in range(len(times) - 2, -1, -1):
            times[i] = min(times[i], times[i + 1])
        self.seconds[:] = times[: len(self.seconds)]
        self.wide = dict(zip(wide, times[len(self.seconds) :]))

    def offline(self, rows: int) -> float:
        s = self.seconds
        if rows <= len(s):
            return s[rows - 1]
        points = [(len(s), s[-1]), *self.wide.items()]
        for (r0, t0), (r1, t1) in zip(points, points[1:]):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        if len(points) > 1:
            (r0, t0), (r1, t1) = points[-2:]
            slope = (t1 - t0) / (r1 - r0)
        else:
            slope = max(s[-1] - s[-2], 0.0) if len(s) > 1 else s[-1]
        return points[-1][1] + slope * (rows - points[-1][0])

    def __call__(self, rows: int) -> float:
        if not self.online:
            return self.offline(rows)
        return max(self._estimate(r) for r in range(1, rows + 1))

    def _estimate(self, rows: int) -> float:
        if self.seen.get(rows, 0) >= LEARN_AFTER:
            return self.online[rows]
        scale = self.multi_scale if rows > 1 and self.multi_scale is not None else self.scale
        return self.offline(rows) * scale

    def observe(self, rows: int, seconds: float) -> None:
        """A step over `rows` rows took `seconds` (ignored unless `learn`)."""
        if not self.learn:
            return
        ratio = seconds / self.offline(rows)
        if rows > 1:
            self.multi_scale = ratio if self.multi_scale is None else 0.9 * self.multi_scale + 0.1 * ratio
        else:
            first = not self.seen.get(1)
            self.scale = ratio if first else 0.9 * self.scale + 0.1 * ratio
        count = self.seen.get(rows, 0)
        self.online[rows] = seconds if count == 0 else 0.8 * self.online[rows] + 0.2 * seconds
        self.seen[rows] = count + 1


def measure_pass_costs(
    decoder,
    rows: int = MEASURED_ROWS,
    context: int = MEASURE_CONTEXT,
    repeats: int = 3,
    wide: tuple[int, ...] = WIDE_ROWS,
) -> PassCosts:
    """Time one chain pass over 1..rows rows, and over each of `wide` rows past them (those within
    half the model's context), after `context` cached slots (the fastest of `repeats`).

    The cache holds zeros: time does not depend on the values, and nothing is prefilled.
    """
    limit = decoder.cfg.max_position
    wide = tuple(r for r in wide if rows < r <= limit // 2)
    widest = max((rows, *wide))
    context = min(context, limit - widest)
    cache = decoder.new_cache(context + widest)
    tokens = torch.zeros(widest, dtype=torch.long, device=decoder.device)
    positions = torch.arange(context, context + widest, device=decoder.device)
    timed = {}
    with torch.inference_mode():
        for r in (*range(1, rows + 1), *wide):
            best = float("inf")
            for _ in range(repeats + 1):  # the first run warms kernels and buffers
                cache.length = context
                start = time.perf_counter()
                decoder(tokens[:r], positions[:r], cache, layout=RowLayout.chain(context, r), last_only=False)
                best = min(best, time.perf_counter() - start)
            timed[r] = best
    return PassCosts([timed[r] for r in range(1, rows + 1)], {r: timed[r] for r in wide})


def costs_dir() -> Path:
    return forerun_home() / "costs"


def pass_costs(model: LoadedModel, rows: int = MEASURED_ROWS) -> PassCosts:
    """c(r) for `model` on this machine: from FORERUN_HOME/costs when measured before, else measured
    now (and cached when the weights have an identity to cache against)."""
    key = _cost_key(model, rows)
    path = costs_dir() / f"{key}.json" if key else None
    if path is not None and path.exists():
        try:
            saved = json.loads(path.read_text())
            return PassCosts(
                [float(s) for s in saved["seconds"]], {int(r): float(s) for r, s in saved["wide"].items()}, learn=True
            )
        except (ValueError, KeyError, TypeError):
            pass  # unreadable: measure again and overwrite it
    if path is not None:
        print(
            f"forerun: timing {model.name}'s pass over 1-{rows} rows and wider, once for this machine "
            f"(cached in {path.parent})",
            file=sys.stderr,
            flush=True,
        )
    costs = measure_pass_costs(model.decoder, rows)
    costs.learn = True
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": model.name, "seconds": costs.seconds, "wide": costs.wide}))
        tmp.replace(path)
    return costs


def _cost_key(model: LoadedModel, rows: int) -> str | None:
    """Weights, numeric format, machine and threads: what the measured times depend on."""
    identity = model_identity(model)
    if identity is None:
        return None
    decoder = model.decoder
    # A product's kernel is part of its kind (the kernels cost differently per row count), and so is
    # whether the layers run natively.
    kinds = sorted(
        {
            type(m).__name__ + (f"[{m.kernel}]" if isinstance(m, (W8A8Linear, GGUFLinear)) else "")
            for m in decoder.modules()
        }
        | {f"native layers: {decoder._native_layers() is not None}"}
    )
    dtypes = sorted({str(t.dtype) for t in [*decoder.parameters(), *decoder.buffers()]})
    # The CPU's name alone does not tell its kernels apart (one "AMD EPYC" has AVX2 only, another AVX-512).
    parts = [
        identity,
        ",".join(kinds),
        ",".join(dtypes),
        str(decoder.device),
        cpu.name(),
        torch.backends.cpu.get_cpu_capability(),
        str(torch.get_num_threads()),
        torch.__version__,
        str(rows),
        str(WIDE_ROWS),
        str(MEASURE_CONTEXT),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


@dataclass
class Acceptance:
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
class SourceState:
    """What the policy knows of one source of drafts: its acceptance and its cost per token."""

    history: Acceptance = field(default_factory=Acceptance)  # over earlier requests
    current: Acceptance = field(default_factory=Acceptance)  # this request
    draft_cost: float = 0.0  # seconds per proposed token, running average
    rows_per_token: float = 1.0  # verifier rows a proposal adds per token asked, running average
    timed: bool = False


@dataclass
class DraftLengthPolicy:
    """Chooses each step's draft length; one per engine, its counts reset per request.

    `pass_cost` is c(r); `k_max` the most a step may draft; `fixed` always drafts k_max (the
    experiment switch). The engine calls `choose` before a step, `drafted` / `shadow` after it.
    A drafter with several sources of drafts (`auto`: suffix matches and a draft model) has each
    one's acceptance and cost kept apart: `select(source)` says whose drafts the step is about.
    """

    pass_cost: Callable[[int], float]
    k_max: int
    fixed: bool = False
    sources: dict[str | None, SourceState] = field(default_factory=dict)
    source: str | None = None  # whose drafts the current step is about
    plain_steps: int = 0  # plain steps since the last draft or probe
    probe_wait: int = PROBE_WAIT[0]
    forgone: float = 0.0  # seconds drafting would have saved while a catch-up waited
    asked_at: int | None = None  # `remaining` when pays_setup was last asked
    unasked_seconds: float = 0.0  # seconds of the steps timed since then
    remaining: int | None = None  # tokens the request may still emit (the engine sets it each step)

    def start(self) -> None:
        """A new request: each source's estimate starts from its history."""
        for state in self.sources.values():
            seen = state.history.kept + state.history.rejected
            weight = min(1.0, REQUEST_PRIOR / seen) if seen > 0 else 1.0
            state.current = Acceptance(state.history.kept * weight, state.history.rejected * weight)
        self.plain_steps, self.probe_wait, self.forgone, self.remaining = 0, PROBE_WAIT[0], 0.0, None
        self.asked_at, self.unasked_seconds = None, 0.0

    def select(self, source: str | None) -> None:
        self.source = source

    @property
    def state(self) -> SourceState:
        """The selected source's figures, made on its first verdict or timing."""
        state = self.sources.get(self.source)
        if state is None:
            state = self.sources[self.source] = SourceState()
        return state

    @property
    def _seen(self) -> SourceState:
        """The selected source's figures to read (a fresh prior when it has none yet, not stored)."""
        return self.sources.get(self.source) or SourceState()

    @property
    def alpha(self) -> float:
        return self._seen.current.alpha

    @property
    def draft_cost(self) -> float:
        return self._seen.draft_cost

    @property
    def rows_per_token(self) -> float:
        return self._seen.rows_per_token

    @property
    def free(self) -> bool:
        """Whether a draft token costs next to nothing beside a target pass."""
        return self._seen.timed and self.draft_cost < FREE_SHARE * self.pass_cost(1)

    def choose(self, can_shadow: bool = False) -> tuple[int, bool]:
        """(draft length for the next step, whether it is a probe). `can_shadow`: the drafter may
        propose without being verified, so a plain step still measures it (no probes needed)."""
        if self.fixed:
            return self.k_max, False
        if not self._seen.timed:
            return 1, True  # a source's first draft is one token: it times the drafter
        k = best_k(self.alpha, self.pass_cost, self.draft_cost, self.k_max, self.rows_per_token)
        if k == 0 and not (can_shadow and self.free) and self.plain_steps >= self.probe_wait:
            return 1, True  # one draft token to see whether drafts recover
        return k, False

    def saving(self, draft_cost: float | None = None, alpha: float | None = None) -> float:
        """Seconds the best draft length saves per emitted token over plain steps (0: none), with
        draft tokens at `draft_cost` kept at rate `alpha` (defaults: this source's running figures)."""
        cost = self.draft_cost if draft_cost is None else draft_cost
        alpha = self.alpha if alpha is None else alpha
        k = best_k(alpha, self.pass_cost, cost, self.k_max, self.rows_per_token)
        if k == 0:
            return 0.0
        rows = 1 + max(k, round(k * self.rows_per_token))
        step = self.pass_cost(rows) + k * cost
        return max(self.pass_cost(1) - step / expected_tokens(alpha, k), 0.0)

    def pays_setup(self, seconds: float, draft_cost: float | None = None, alpha: float | None = None) -> bool:
        """Whether to pay a drafter's one-off `seconds` (a catch-up) now, its tokens then costing
        `draft_cost` each and kept at rate `alpha`; asked before each step that would pay it. No:
        the step goes without it, and what drafting would have saved on it counts towards paying
        next time: the time the steps since the last ask took beyond what their tokens would have
        cost drafted (a plain step forgoes one token's saving; a step of kept suffix drafts, whose
        tokens came cheap anyway, forgoes nothing), or one token's saving a step where steps are
        not timed alone (a batch). Never when even drafting every token the request may still emit
        (`remaining`) could not save `seconds`."""
        if self.fixed or seconds <= 0:
            return True
        saving = self.saving(draft_cost, alpha)
        if self.remaining is not None and saving * self.remaining < seconds:
            return False  # the tokens left could not win it back
        forgone = saving
        if self.remaining is not None and self.asked_at is not None and self.unasked_seconds > 0:
            emitted = max(1, self.asked_at - self.remaining)
            forgone = max(0.0, self.unasked_seconds - emitted * (self.pass_cost(1) - saving))
        self.asked_at, self.unasked_seconds = self.remaining, 0.0
        if self.forgone >= seconds:
            self.forgone = 0.0
            return True
        self.forgone += forgone
        return False

    def time_proposal(self, seconds: float, asked: int, rows: int) -> None:
        """A proposal of `asked` tokens took `seconds` and added `rows` verifier rows."""
        if asked <= 0:
            return
        state = self.state
        per_token, ratio = seconds / asked, rows / asked
        if state.timed:
            per_token, ratio = 0.8 * state.draft_cost + 0.2 * per_token, 0.8 * state.rows_per_token + 0.2 * ratio
        state.draft_cost, state.rows_per_token, state.timed = per_token, ratio, True

    def drafted(self, depth: int, kept: int, probe: bool) -> None:
        """A verified draft `depth` tokens deep of which the first `kept` were kept."""
        rejected = 1 if kept < depth else 0
        self.state.current.observe(kept, rejected)
        self.state.history.observe(kept, rejected)
        self.plain_steps = 0
        if probe:
            wait = PROBE_WAIT[0] if kept else min(2 * self.probe_wait, PROBE_WAIT[1])
            self.probe_wait = max(wait, self._probe_spacing())

    def _probe_spacing(self) -> int:
        """Plain steps between probes so that a probe costs at most PROBE_SHARE of them: a one-token
        probe costs its draft token and its rows (a tree's or window's too) beyond a plain step."""
        one = self.pass_cost(1)
        extra = self.pass_cost(1 + max(1, round(self.rows_per_token))) + self.draft_cost - one
        return math.ceil(max(extra, 0.0) / (PROBE_SHARE * one) - 1e-9)

    def plain(self) -> None:
        self.plain_steps += 1

    def timed_step(self, rows: int, seconds: float) -> None:
        """The engine's step over `rows` verifier rows took `seconds` (pass, rule and roll-back)."""
        self.unasked_seconds += seconds
        observe = getattr(self.pass_cost, "observe", None)
        if observe is not None:
            observe(rows, seconds)

    def shadow(self, kept_probability: float) -> None:
        """A free proposal not verified: the target kept its first token with this probability."""
        self.state.current.observe(kept_probability, 1 - kept_probability)
        self.state.history.observe(kept_probability, 1 - kept_probability)
