"""Continuous batching: several requests stepped together, every step one target forward for all.

Each running request has a lane: an Engine of its own (its drafter, its cost policy, its cache)
over the shared target and draft weights. A step plans every lane's draft (the lanes' draft-model
forwards run as one forward over all their rows, drafters/passes.py), verifies all of them in one
target pass (`verify_many`: each sequence's rows on its own cache, every row exactly as it would
come out alone), then accepts, rolls back and emits per lane. Requests join (a prefill of
their own, or a copy of another's of the same prompt: n completions) and leave between steps;
an idle lane is kept for the next request, so a drafter's one-off set-up is paid once per lane,
not per request.

Load: with B sequences a step of K drafts verifies about B·(K+1) rows, so the step's K is capped
at the length that pays for the whole batch, and a per-batch-size bandit decides whether it drafts
at all (docs/architecture.md, Cost policy: batch draft length, batch explore/exploit).

Failures stay with their request: a lane whose drafter or acceptance raises is ended with that
error; if the shared pass raises, each lane is verified alone so only the guilty one fails.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, field

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters.passes import run_passes
from forerun.engine.engine import Choice, ChunkDone, Engine, Plan, PromptChunk, RequestOutput, Running, StepOutput
from forerun.models.decoder import Decoder
from forerun.policy.batch_rates import Rates
from forerun.policy.draft_length import batch_draft_length
from forerun.policy.pass_costs import PassCosts, cached_pass_costs
from forerun.verification.verify import PromptRows, Verification, VerifyJob, verify, verify_many


@dataclass
class Lane:
    engine: Engine
    run: Running


@dataclass
class Prefill:
    """A request whose prompt is being prefilled a chunk at a time (`BatchEngine.start`)."""

    engine: Engine
    steps: Generator[PromptChunk, ChunkDone, tuple[Running, StepOutput]]
    prompt_ids: list[int]
    params: SamplingParams
    # Requests of the same prompt that start from this one's prefill once it is done (n samples).
    followers: list[tuple[Hashable, SamplingParams]] = field(default_factory=list)
    chunk: PromptChunk | None = None  # the prompt's next rows (None: its set-up has not run yet)


@dataclass
class StepResult:
    """What one step did to one request: its emitted tokens, or the error that ended it."""

    output: StepOutput | None
    error: Exception | None = None


class BatchEngine:
    def __init__(self, new_engine: Callable[[], Engine], max_seqs: int = 1, engines: Sequence[Engine] = ()) -> None:
        """`new_engine()` builds a lane's engine (sharing the target and draft weights); `engines`
        are ready ones to use first; `max_seqs` is the most requests running at once."""
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be at least 1, got {max_seqs}")
        self.new_engine = new_engine
        self.max_seqs = max_seqs
        self.lanes: dict[Hashable, Lane] = {}
        self.prefilling: dict[Hashable, Prefill] = {}  # started, prompt not through yet (in turn: `_take_turn`)
        self.idle: list[Engine] = list(engines)
        self._checker: Engine | None = engines[0] if engines else None  # answers check_fits; may also run a lane
        self.last_k: int | None = None  # the draft length the last step allowed (None: no drafter)
        # Per batch size class (1, 2-3, 4-7, 8-15, ...: the size's bit length), measured rates.
        self.rates: collections.defaultdict[int, Rates] = collections.defaultdict(Rates)
        self._costs: PassCosts | None = None  # the target's pass costs, once a step carries a prompt's rows
        self.carried_rows = 0  # prompt rows the last step's pass carried

    def prepare(self) -> None:
        """Build every lane now (a server at start), not when the batch first grows to it; and where
        steps may carry prompt rows, have the target's pass costs at hand (timed now if never)."""
        while len(self.idle) + len(self.lanes) < self.max_seqs:
            self.idle.append(self._new())
        if self.idle and self.idle[0].target.decoder.chain_prefill:
            self._pass_costs(self.idle[0].target)

    @property
    def full(self) -> bool:
        return self.size >= self.max_seqs

    @property
    def size(self) -> int:
        """Requests holding a lane: running, prefilling, or waiting on another's prefill."""
        return len(self.lanes) + sum(1 + len(p.followers) for p in self.prefilling.values())

    def check_fits(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Engine.check_fits, asked of one engine kept for it (any lane answers alike); it takes no
        lane, so a server's HTTP thread may ask it while the loop steps."""
        if self._checker is None:
            self.idle.append(self._new())
        return self._checker.check_fits(prompt_ids, params)

    def add(
        self, key: Hashable, prompt_ids: list[int], params: SamplingParams, like: Hashable | None = None
    ) -> StepOutput:
        """Start a request under `key` (prefill and first token); the caller must not exceed max_seqs.
        `like`: the key of a request of the same prompt added since the last step, whose prefill
        this one shares (n completions of one prompt: one prefill, each its own seed)."""
        if self.full:
            raise RuntimeError(f"{self.size} requests already run; max_seqs is {self.max_seqs}")
        leader = None  # the request whose prefill this one starts from
        if like is not None:
            if like not in self.lanes:
                raise ForerunError(
                    f"like={like!r} names no running request: a prefill is shared with a "
                    "request added before this one and not removed yet"
                )
            leader = self.lanes[like].run
        engine = self._engine()
        try:
            run, first = engine.begin(prompt_ids, params, like=leader)
        except BaseException:
            self.idle.append(engine)
            raise
        self.lanes[key] = Lane(engine, run)
        return first

    def start(self, key: Hashable, prompt_ids: list[int], params: SamplingParams, like: Hashable | None = None) -> None:
        """`add` without the prefill: the request's prompt goes through in `prefill` calls, a chunk
        at a time, between steps of the running requests (chunked prefill). `like`: the key of a
        request of the same prompt still prefilling, whose prefill this one then shares (otherwise
        it prefills on its own)."""
        if self.full:
            raise RuntimeError(f"{self.size} requests already run; max_seqs is {self.max_seqs}")
        first = self.prefilling.get(like) if like is not None else None
        if first is not None and first.prompt_ids == list(prompt_ids):
            first.followers.append((key, params))
            return
        self._queue_prefill(key, list(prompt_ids), params)

    def prefill(self, budget_s: float) -> dict[Hashable, StepResult]:
        """Prefill chunks of the started requests, a chunk each in turn (`_take_turn`), for about
        `budget_s` seconds (at least one chunk when the budget is above 0). Returns the first step
        of each request whose prefill completed (its followers' too), or the error that ended it;
        those run from the next `step`."""
        results: dict[Hashable, StepResult] = {}
        started, chunks = time.perf_counter(), 0
        while self.prefilling and budget_s > 0 and (not chunks or time.perf_counter() - started < budget_s):
            chunks += 1
            key, job = next(iter(self.prefilling.items()))
            if self._next_chunk(key, job, results):
                self._feed(key, job, job.chunk.alone(job.engine.target.decoder), results)
            self._take_turn(key)
        return results

    def _take_turn(self, key: Hashable) -> None:
        """`key`'s prompt, if not through yet, goes behind the other waiting prompts: they take
        chunks (and a step's carried rows) in turn, so a short prompt that comes during a long
        one's prefill waits a chunk for each prompt ahead of it, not their whole prefills."""
        if key in self.prefilling:
            self.prefilling[key] = self.prefilling.pop(key)

    def _next_chunk(self, key: Hashable, job: Prefill, results: dict[Hashable, StepResult]) -> bool:
        """Whether `job` has a chunk to run (its set-up run first: a prefill shared with another
        request's ends there, into `results`)."""
        if job.chunk is None:
            self._feed(key, job, None, results)
        return key in self.prefilling

    def _feed(self, key: Hashable, job: Prefill, done: ChunkDone | None, results: dict[Hashable, StepResult]) -> None:
        """Hand `job` its chunk's forward (None: start it); once its prompt is through, the request
        joins the lanes (its followers too) with its first step in `results`, or its error."""
        try:
            job.chunk = next(job.steps) if done is None else job.steps.send(done)
        except StopIteration as stop:
            run, first = stop.value
            del self.prefilling[key]
            self.lanes[key] = Lane(job.engine, run)
            results[key] = StepResult(first)
            for follower, params in job.followers:
                results[follower] = self._follow(follower, job.prompt_ids, params, key)
        except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
            self._drop_prefill(key)
            results[key] = StepResult(None, exc)

    def _queue_prefill(self, key: Hashable, prompt_ids: list[int], params: SamplingParams) -> None:
        engine = self._engine()
        self.prefilling[key] = Prefill(engine, engine.begin_steps(prompt_ids, params), prompt_ids, params)

    def _follow(self, key: Hashable, prompt_ids: list[int], params: SamplingParams, like: Hashable) -> StepResult:
        try:
            return StepResult(self.add(key, prompt_ids, params, like=like))
        except Exception as exc:  # noqa: BLE001
            return StepResult(None, exc)

    def _drop_prefill(self, key: Hashable) -> None:
        """Stop `key`'s prefill; its followers prefill on their own instead."""
        job = self.prefilling.pop(key)
        job.steps.close()
        self.idle.append(job.engine)
        for follower, params in job.followers:
            self._queue_prefill(follower, job.prompt_ids, params)

    def remove(self, key: Hashable) -> RequestOutput | None:
        """End the request under `key` (finished or not; prefilling too); its output so far, None
        if it had none."""
        if key in self.prefilling:
            self._drop_prefill(key)
            return None
        for job in self.prefilling.values():
            for i, (follower, _) in enumerate(job.followers):
                if follower == key:
                    del job.followers[i]
                    return None
        lane = self.lanes.pop(key, None)
        if lane is None:
            return None
        self.idle.append(lane.engine)
        return lane.engine.end(lane.run)

    def step(self, prefill_share: float = 0.0) -> dict[Hashable, StepResult]:
        """One step of every running request; finished ones stay until `remove`d. With
        `prefill_share` above 0 the step's pass also carries the waiting prompts' next rows, in
        turn, as many as add about that many one-row passes' time to it (`_carry`); a prompt that
        gets through has its first step in the results."""
        lanes = [(key, lane) for key, lane in self.lanes.items() if not lane.run.seq.finished]
        if not lanes:
            return {}
        results: dict[Hashable, StepResult] = {}
        started = time.perf_counter()
        bucket = self.rates[len(lanes).bit_length()]
        # Plain steps measure faster at this batch size: until the batch tries drafting again, no
        # lane runs its draft model, probes it or pays its catch-up. A lane with a costless draft at
        # hand (auto's long suffix match) still drafts it where the batch's length says its rows
        # pay; such steps count as plain ones, so the choice measured is whether the draft model
        # adds to them.
        plain = (
            len(lanes) > 1 and all(lane.engine.policy is not None for _, lane in lanes) and not bucket.choose_drafting()
        )
        # Each lane first settles what it alone would draft (and from which source); the batch
        # then caps everyone's length by what the load makes pay. A draft model's catch-up in one
        # lane holds up the others' step: its gate prices it for all of them.
        for _, lane in lanes:
            if lane.engine.policy is not None:
                lane.engine.policy.waiting = len(lanes) - 1
        chosen = self._choose(lanes, plain, results)
        lanes = [(key, lane) for key, lane in lanes if key in chosen]
        cap = self._k_cap([(lane, chosen[key]) for key, lane in lanes]) if len(lanes) > 1 else None
        drafting = not plain and (cap is None or cap > 0)
        planned = self._plan(lanes, cap, chosen, results)
        carried = self._carry(planned, prefill_share, results)
        self.carried_rows = sum(len(prompt.tokens) for *_, prompt in carried)
        together = len(planned) > 1 or bool(carried)  # no lane's step is timed alone
        for (key, lane, plan), ver in zip(planned, self._verify(planned, carried)):
            if isinstance(ver, Exception):
                results[key] = StepResult(None, ver)
                continue
            try:
                emitted = lane.engine.finish(lane.run, plan, ver, timed=not together)
                results[key] = StepResult(lane.run.step_output(emitted))
            except Exception as exc:  # noqa: BLE001
                results[key] = StepResult(None, exc)
        ks = [plan.k for _, _, plan in planned if plan.k is not None]
        self.last_k = max(ks) if ks else None
        for key, job, prompt in carried:
            if prompt.logits is not None:
                self._feed(key, job, ChunkDone(len(prompt.tokens), prompt.logits), results)
            self._take_turn(key)
        if cap is not None:
            emitted = sum(len(r.output.token_ids) for r in results.values() if r.output is not None)
            seconds = self._lanes_seconds(time.perf_counter() - started, planned)
            bucket.record(drafting, emitted / seconds, seconds)
        return results

    def _lanes_seconds(self, seconds: float, planned: list[tuple[Hashable, Lane, Plan]]) -> float:
        """A step's `seconds` less what the prompt rows it carried added to its pass by the target's
        measured costs (their prefill's time, not the lanes'), so that the batch's rates with and
        without drafting are measured on every step, also while prompts wait (which, at a full
        server, is most steps). A tenth of the step at least, whatever the estimate."""
        if not self.carried_rows or not planned:
            return max(seconds, 1e-9)
        cost = self._pass_costs(planned[0][1].engine.target).offline
        lanes = _lane_rows(planned)
        return max(seconds - (cost(lanes + self.carried_rows) - cost(lanes)), 0.1 * seconds, 1e-9)

    @staticmethod
    def _choose(
        lanes: list[tuple[Hashable, Lane]], plain: bool, results: dict[Hashable, StepResult]
    ) -> dict[Hashable, Choice]:
        """Each lane's draft as it alone would choose it (`plain`: costless drafts only); a lane
        whose drafter raises gets its error in `results`."""
        chosen: dict[Hashable, Choice] = {}
        for key, lane in lanes:
            try:
                chosen[key] = lane.engine.choose_costless(lane.run) if plain else lane.engine.choose(lane.run)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                results[key] = StepResult(None, exc)
        return chosen

    @staticmethod
    def _plan(
        lanes: list[tuple[Hashable, Lane]],
        cap: int | None,
        chosen: dict[Hashable, Choice],
        results: dict[Hashable, StepResult],
    ) -> list[tuple[Hashable, Lane, Plan]]:
        """Every lane's draft at once, their draft-model forwards run as one (passes.py); a lane
        whose proposal raises gets its error in `results`."""
        planned: list[tuple[Hashable, Lane, Plan]] = []
        steps = [lane.engine.plan_steps(lane.run, cap, chosen[key]) for key, lane in lanes]
        for (key, lane), plan in zip(lanes, run_passes(steps)):
            if isinstance(plan, Exception):
                results[key] = StepResult(None, plan)
            else:
                planned.append((key, lane, plan))
        return planned

    def _engine(self) -> Engine:
        if not self.idle:
            self.idle.append(self._new())
        return self.idle.pop()

    def _new(self) -> Engine:
        engine = self.new_engine()
        self._checker = self._checker or engine
        return engine

    def _k_cap(self, lanes: list[tuple[Lane, Choice]]) -> int | None:
        """The common draft length that pays best for the whole batch (None: no lane has a policy).
        `lanes`: each lane with what it chose alone; those that chose 0 count as plain rows."""
        figures = []
        pass_cost, k_max, plain = None, 0, 0
        pooled: list[tuple[Engine, str | None]] = []  # lanes whose draft forwards run as one
        for lane, choice in lanes:
            engine, policy = lane.engine, lane.engine.policy
            if policy is None:
                return None  # a fixed K was asked for: the experiment rules
            pass_cost = policy.pass_cost
            if choice.k == 0:
                plain += 1
                continue
            seen = policy.figures(choice.source)  # of the source this step drafts from
            pooling = engine.batch_pass_seconds(1, choice.source) is not None
            figures.append((seen.alpha, 0.0 if pooling else seen.draft_cost, *seen.rows))
            if pooling:
                pooled.append((engine, choice.source))
            k_max = max(k_max, engine.k)
        if not figures:
            return 0
        draft_pass = pooled[0][0].batch_pass_seconds(len(pooled), pooled[0][1]) if pooled else 0.0
        return batch_draft_length(figures, pass_cost, k_max, plain_lanes=plain, draft_pass=draft_pass)

    def _carry(
        self, planned: list[tuple[Hashable, Lane, Plan]], share: float, results: dict[Hashable, StepResult]
    ) -> list[tuple[Hashable, Prefill, PromptRows]]:
        """The waiting prompts' next rows for this step's pass, in their turn (a prompt's rest, then
        the next prompt's): as many as add at most `share` one-row passes' time to it by the
        target's measured pass costs (`cached_pass_costs`), so the decoding requests' time per
        token grows by at most `share` times its one-request figure, and a batch of few lanes
        (prompts holding it back) carries as many rows as a full one. None where the target's
        prefill is not a chain of exact rows (`Decoder.chain_prefill`: its chunks run alone,
        PREFILL_CHUNK rows each, so their bounds stay the prompt's alone), and none from a prompt
        that keeps every row's hidden state on (its chunks run alone first)."""
        carried: list[tuple[Hashable, Prefill, PromptRows]] = []
        if share <= 0 or not planned or not self.prefilling:
            return carried
        target = planned[0][1].engine.target  # every lane's and prompt's: the batch's one target
        if not target.decoder.chain_prefill:
            return carried
        cost = self._pass_costs(target).offline
        lanes = _lane_rows(planned)
        own, allowed = cost(lanes), share * cost(1)
        rows = lanes  # the pass's rows so far
        for key, job in list(self.prefilling.items()):
            if not self._next_chunk(key, job, results):  # its prefill was another's: it is through
                continue
            if job.chunk.keep:
                break
            chunk, n = job.chunk, 0
            while n < chunk.left and cost(rows + n + 1) - own <= allowed:
                n += 1
            if n:
                carried.append((key, job, PromptRows(chunk.ids[chunk.start : chunk.start + n], chunk.cache)))
                rows += n
            if n < chunk.left:  # the budget is spent
                break
        return carried

    def _pass_costs(self, target) -> PassCosts:
        """The target's measured pass costs, read (or timed) once."""
        if self._costs is None:
            self._costs = cached_pass_costs(target)
        return self._costs

    def _verify(
        self,
        planned: list[tuple[Hashable, Lane, Plan]],
        carried: list[tuple[Hashable, Prefill, PromptRows]] | None = None,
    ) -> list[Verification | Exception]:
        def job(lane: Lane, plan: Plan) -> VerifyJob:
            return VerifyJob(lane.run.cache, plan.root, plan.tree, lane.run.seq.params, lane.run.seq.past)

        if carried:
            prompts, target = [prompt for *_, prompt in carried], planned[0][1].engine.target.decoder
            caches = [prompt.cache for prompt in prompts] + [lane.run.cache for _, lane, _ in planned]
            before = [cache.length for cache in caches]
            try:
                return list(verify_many(target, [job(lane, plan) for _, lane, plan in planned], prompts))
            except Exception:  # noqa: BLE001 - the prompts' rows run alone later; the lanes as below
                for prompt in prompts:
                    prompt.logits = None
                for cache, length in zip(caches, before):
                    cache.truncate(min(length, cache.length))
        target = planned[0][1].engine.target.decoder
        if len(planned) == 1:
            return [_verify_alone(target, job(planned[0][1], planned[0][2]))]
        lengths = [lane.run.cache.length for _, lane, _ in planned]
        try:
            return list(verify_many(target, [job(lane, plan) for _, lane, plan in planned]))
        except Exception:  # noqa: BLE001 - find whose rows failed
            outcomes: list[Verification | Exception] = []
            for (_, lane, plan), length in zip(planned, lengths):
                lane.run.cache.truncate(min(length, lane.run.cache.length))
                outcomes.append(_verify_alone(target, job(lane, plan)))
            return outcomes


def _lane_rows(planned: list[tuple[Hashable, Lane, Plan]]) -> int:
    """The rows the lanes' plans put in a step's pass: each lane's root and its draft's nodes."""
    return sum(1 + (len(plan.tree.tokens) + len(plan.tree.aux_tokens) if plan.tree else 0) for *_, plan in planned)


def _verify_alone(target: Decoder, job: VerifyJob) -> Verification | Exception:
    """One sequence's verification on its own, or what it raised."""
    try:
        return verify(target, job.cache, job.root, job.tree, job.params, job.past)
    except Exception as exc:  # noqa: BLE001 - the lane ends alone; the others go on
        return exc
