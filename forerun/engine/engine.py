"""The step loop: draft, verify in one target pass, accept, roll caches back, emit, tell the drafter."""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters.base import Drafter
from forerun.drafters.passes import DraftPass, DraftSteps, run_alone
from forerun.engine.metrics import SpecMetrics, prediction_used
from forerun.engine.sequence import Sequence
from forerun.models import linear
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel
from forerun.models.prefix_cache import PrefixCache
from forerun.policy.draft_length import DraftLengthPolicy
from forerun.verification.accept import Acceptance, accept, accept_greedy, accept_one_hot
from forerun.verification.grammar import Grammar, check_grammar
from forerun.verification.logprobs import TokenLogprob, prompt_logprobs, token_logprobs
from forerun.verification.sampling import (
    PositionDraws,
    adjusted,
    draw_key,
    make_generator,
    probabilities,
    sample_at,
)
from forerun.verification.tree import DraftTree
from forerun.verification.verify import Verification, verify

# Prompt tokens per prefill forward. A batch steps its running requests between a long prompt's
# chunks (chunked prefill), and the bounds are fixed by the prompt alone, so the prefill is the same
# computation in every batch. (Where the target's rows are exact whatever rows run beside them, the
# native layers, a batch may also carry a prompt's rows in its steps, any number at a time.)
PREFILL_CHUNK = 64


class _Unscored(nn.Module):
    """A head that scores nothing: a prompt's chunks before its last need no logits (the LM head
    of one row reads all its weights, a few percent of a chunk's time)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], 0)


UNSCORED = _Unscored()


@dataclass
class PromptChunk:
    """The next rows of a prompt being prefilled: `Engine.begin_steps` yields one and takes back
    the `ChunkDone` of a forward over rows [start, start + n) of `ids` on `cache`."""

    ids: torch.Tensor  # the whole prompt [T]
    start: int  # rows already in the cache
    cache: KVCache
    keep: bool  # every row's hidden state is wanted (features for a drafter, prompt log probabilities)

    @property
    def left(self) -> int:
        return len(self.ids) - self.start

    def alone(self, decoder, most: int = PREFILL_CHUNK) -> ChunkDone:
        """Up to `most` rows in a forward of their own."""
        stop = self.start + min(most, self.left)
        with linear.prefill():  # entered per chunk: a step between chunks is no prefill
            out = decoder(
                self.ids[self.start : stop],
                torch.arange(self.start, stop, device=decoder.device),
                self.cache,
                last_only=True,
                output_hidden=self.keep,
                all_hidden=True,
                head=None if stop == len(self.ids) else UNSCORED,
            )
        return ChunkDone(stop - self.start, out.logits[0], out.hidden[0] if self.keep else None)


@dataclass
class ChunkDone:
    """What a forward over a prompt's next `rows` rows gave: the last row's raw logits [1, vocab]
    ([1, 0] before the prompt's last chunk), every row's final hidden state [rows, hidden] when the
    chunk keeps them."""

    rows: int
    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@dataclass
class StepOutput:
    token_ids: list[int]  # tokens emitted by this step
    text: str  # text that became final with them
    finished: bool
    logprobs: list[TokenLogprob] | None = None  # each token's, aligned with token_ids (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the first step's only (params.prompt_logprobs)


@dataclass
class RequestOutput:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    elapsed_s: float  # generation only, from prefill to the last token
    first_token_s: float  # time to the first token
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    logprobs: list[TokenLogprob] | None = None  # each of token_ids' (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # each prompt token's, entry 0 None
    num_cached_tokens: int = 0  # prompt tokens whose rows came from the prefix cache
    # With SamplingParams.prediction: (accepted, rejected) prediction tokens (`prediction_used`)
    prediction_tokens: tuple[int, int] | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class Running:
    """A request between its steps."""

    seq: Sequence
    cache: KVCache
    gen: torch.Generator
    key: int  # what keys its tokens' position draws (sampling.position_uniform): its seed, else random
    metrics: SpecMetrics
    start: float  # perf_counter at its prefill
    first_token_s: float = 0.0
    # The prefill's raw logits at the prompt's last position [1, vocab], kept until the first step:
    # another request of the same prompt may start from them and a copy of the cache (`begin(like=)`).
    prefill_logits: torch.Tensor | None = None
    logprobs: list[TokenLogprob] | None = None  # every emitted token's, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0  # prompt rows restored from the prefix cache
    predicted: list[int] | None = None  # its prediction's tokens (None: it has none)

    def step_output(self, emitted: list[int]) -> StepOutput:
        """What a step that appended `emitted` hands out: the tokens, their text and log probabilities."""
        logprobs = self.logprobs[len(self.logprobs) - len(emitted) :] if self.logprobs is not None else None
        return StepOutput(emitted, self.seq.take_text(), self.seq.finished, logprobs)


@dataclass(frozen=True)
class Choice:
    """A step's draft length as one request alone would choose it, before a batch caps it."""

    k: int  # tokens to draft (0: a plain step)
    probe: bool  # the draft is the policy's probe
    source: str | None = None  # the drafter's source it was chosen for (None: its only one)


@dataclass
class Plan:
    """What one step will verify: the root and the draft."""

    root: int  # the token emitted last, fed first
    tree: DraftTree | None  # the draft (None: a plain step)
    shadow: DraftTree | None  # a costless proposal made beside a plain step, not verified
    probe: bool  # the draft is the policy's probe
    base: int  # cache slots before the root
    started: float  # perf_counter when the verification began
    k: int | None = None  # the draft length the step allowed (None: no drafter)
    source: str | None = None  # the source of the step's proposal, whose figures its verdict updates


class Engine:
    """Runs requests one at a time. With a drafter, each step drafts `num_speculative_tokens`, or,
    given a `policy` (policy/draft_length.py), the length that policy chooses up to it (0: a plain step)."""

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 0,
        policy: DraftLengthPolicy | None = None,
        prefixes: PrefixCache | None = None,
    ) -> None:
        """`prefixes`: prompt rows kept from earlier prefills (shared by an LLM's engines), used where
        the target's prefill is a chain of exact rows."""
        self.target = target
        self.prefixes = prefixes
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        self.policy = policy if drafter is not None and self.k > 0 else None
        # Costless, stateless proposals can be made beside a plain step to keep measuring acceptance.
        self.can_shadow = drafter is not None and drafter.stateless
        if self.policy is not None:
            drafter.set_gate(self.policy.pays_catch_up)  # the policy decides when a catch-up pays
            drafter.set_pass_cost(self.policy.pass_cost)  # drafts sized from what rows cost here
        # A drafter that reads the target's hidden states (draft heads) gets those of every kept row.
        self.reads_features = drafter is not None and drafter.reads_features
        self.rows = drafter.max_rows(self.k) if drafter is not None else 0  # most cache slots after the root
        tok = target.tokenizer
        self.stop_ids = tok.stop_ids if tok is not None else frozenset()

    def check_fits(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Cache slots the request needs; a clear error before any work when it exceeds the context
        (or its logit bias or stop token ids name a token the model lacks, its structured output
        cannot be followed, or its prediction cannot be read)."""
        return self._checked(prompt_ids, params)[0]

    def _checked(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, list[int] | None]:
        """`check_fits`'s slots, and the prediction's tokens it read (`_predicted`)."""
        vocab = self.target.decoder.cfg.vocab_size
        named = (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids))
        for name, tokens in named:
            outside = [token for token in tokens if token >= vocab]
            if outside:
                raise ForerunError(
                    f"{name} names token {outside[0]}, beyond the vocabulary of {vocab}: use ids below {vocab}"
                )
        if params.structured_outputs is not None:  # one its grammar cannot follow, or a model without a tokenizer
            check_grammar(params.structured_outputs, self.target.tokenizer, vocab)
        predicted = self._predicted(params)  # text without a tokenizer, or tokens beyond the vocabulary: an error
        slots = check_prompt_fits(self.target.decoder.cfg.max_position, prompt_ids, params.max_tokens) + self.rows + 1
        return slots, predicted

    def stream(
        self, prompt_ids: list[int], params: SamplingParams, result: list[RequestOutput] | None = None
    ) -> Iterator[StepOutput]:
        """Steps of one request, the first after the prefill; appends the finished RequestOutput
        to `result` when one is given."""
        run, first = self.begin(prompt_ids, params)
        yield first
        while not run.seq.finished:
            yield run.step_output(self.step(run))
        out = self.end(run)
        if result is not None:
            result.append(out)

    def begin(
        self, prompt_ids: list[int], params: SamplingParams, like: Running | None = None
    ) -> tuple[Running, StepOutput]:
        """Prefill a request and sample its first token. `like`: a running request of the same
        prompt that has not stepped yet (n completions of one prompt; usually another engine's, as
        a drafter follows one request at a time); this one then copies its cache and samples from
        its last logits with its own generator, instead of a prefill."""
        steps = self.begin_steps(prompt_ids, params, like)
        try:
            chunk = next(steps)
            while True:
                chunk = steps.send(chunk.alone(self.target.decoder))
        except StopIteration as stop:
            return stop.value

    def begin_steps(
        self, prompt_ids: list[int], params: SamplingParams, like: Running | None = None
    ) -> Generator[PromptChunk, ChunkDone, tuple[Running, StepOutput]]:
        """`begin` a chunk at a time: yields each next chunk of the prompt and takes back what its
        forward gave (a batch steps its running requests between chunks, or carries the chunk's
        rows in a step: chunked prefill); returns what `begin` does."""
        max_len, predicted = self._checked(prompt_ids, params)
        if like is not None:
            _check_shareable(like, prompt_ids)
        decoder = self.target.decoder
        seq = Sequence(prompt_ids, params, self.target.tokenizer, self.stop_ids, self._grammar(params))
        gen = make_generator(params.seed, decoder.device)
        run = Running(
            seq,
            decoder.new_cache(max_len),
            gen,
            draw_key(params.seed, gen),
            SpecMetrics(num_speculative_tokens=self.k),
            time.perf_counter(),
            logprobs=[] if params.logprobs is not None else None,
            predicted=predicted,
        )
        if self.policy is not None:
            self.policy.start()
        if self.drafter is not None:
            with linear.prefill():
                self.drafter.start(seq.prompt_ids, run.cache, max_len)
            self.drafter.follow(seq.grammar)
            self.drafter.expect(run.predicted or [])
        hidden = None
        if like is not None and self._can_share(like, params):
            logits = _share_prefill(run, like)
        else:
            logits, hidden = yield from self._prefill(run)
        if self.reads_features:
            self.drafter.features(hidden)  # [T, hidden]
        run.prefill_logits = logits  # [1, vocab]
        first_logits = adjusted(logits, params, [], [[]], seq.prompt_ids, seq.stop_ids, seq.grammar)
        first = sample_at(probabilities(first_logits, params)[0], run.key, seq.length)
        if run.logprobs is not None:
            run.logprobs += token_logprobs(logits, [first], params.logprobs)
        run.metrics.record_step(0, 0, 1)
        seq.append(first)
        run.first_token_s = time.perf_counter() - run.start
        out = run.step_output([first])
        out.prompt_logprobs = run.prompt_logprobs
        return run, out

    def _predicted(self, params: SamplingParams) -> list[int] | None:
        """The prediction's tokens (None without one): text tokenized alone, as a continuation."""
        prediction = params.prediction
        if prediction is None or not isinstance(prediction, str):
            ids = None if prediction is None else list(prediction)
        elif self.target.tokenizer is None:
            raise ForerunError("this model has no tokenizer: give the prediction as token ids")
        else:
            ids = list(self.target.tokenizer.hf.encode(prediction, add_special_tokens=False))
        vocab, context = self.target.decoder.cfg.vocab_size, self.target.decoder.cfg.max_position
        if ids is not None and any(token >= vocab for token in ids):
            raise ForerunError(f"the prediction names a token beyond the vocabulary of {vocab}: use ids below {vocab}")
        if ids is not None and len(ids) > context:  # its trie takes memory as a prompt's does
            raise ForerunError(f"the prediction's {len(ids)} tokens are over the context of {context}: shorten it")
        return ids

    def _grammar(self, params: SamplingParams) -> Grammar | None:
        """A structured output's start (None without one)."""
        if params.structured_outputs is None:
            return None
        return Grammar.start(params.structured_outputs, self.target.tokenizer, self.target.decoder.cfg.vocab_size)

    def _prefill(self, run: Running) -> Generator[PromptChunk, ChunkDone, tuple[torch.Tensor, torch.Tensor | None]]:
        """The whole prompt through the target, a chunk at a time (each yielded, its forward's
        result sent back): the last position's raw logits [1, vocab], and every position's final
        hidden state [T, hidden] when the drafter reads them. Run alone, a chunk is PREFILL_CHUNK
        rows, bounds that depend on the prompt alone, so a prompt's cache comes out the same
        whether its chunks run back to back or between other requests' steps."""
        decoder, prompt, params = self.target.decoder, run.seq.prompt_ids, run.seq.params
        ids = torch.tensor(prompt, device=decoder.device)
        scored = params.prompt_logprobs is not None
        keep = self.reads_features or scored
        # A prompt's rows come out the same in any chunks on the native chain: the rows of a prefix
        # prefilled before are those its prefill would compute (not where every row's hidden state
        # is wanted: those are not kept).
        prefixes = self.prefixes if self.prefixes is not None and not keep and decoder.chains_into(run.cache) else None
        start = run.cached_tokens = prefixes.restore(prompt, run.cache) if prefixes is not None else 0
        hiddens, logits = [], None
        # Sampling needs the last position's logits alone. The prompt's log probabilities score the
        # other rows' hidden states apart, a slice at a time: the last row comes out as without them.
        while start < len(prompt):
            done = yield PromptChunk(ids, start, run.cache, keep)
            start, logits = start + done.rows, done.logits
            if keep:
                hiddens.append(done.hidden)  # [rows, hidden]
        if prefixes is not None:
            prefixes.store(prompt, run.cache)
        hidden = torch.cat(hiddens) if keep else None  # [T, hidden]
        if scored:

            def score(a: int, b: int) -> torch.Tensor:
                with torch.inference_mode():
                    return decoder.lm_head(hidden[None, a:b])[0].float()  # [b - a, vocab]

            run.prompt_logprobs = prompt_logprobs(score, prompt, params.prompt_logprobs)
        return logits, hidden if self.reads_features else None

    def _can_share(self, like: Running, params: SamplingParams) -> bool:
        """Whether this engine's request may start from `like`'s prefill. A drafter that reads the
        target's features needs every prompt position's hidden state, which is not kept: it gets a
        prefill of its own (so do prompt log probabilities with more alternatives than `like` has)."""
        if self.reads_features:
            return False
        want = params.prompt_logprobs
        return want is None or (like.prompt_logprobs is not None and like.seq.params.prompt_logprobs >= want)

    def end(self, run: Running) -> RequestOutput:
        """The request is over (finished or given up): the drafter hears its output; returns it."""
        if self.drafter is not None:
            self.drafter.end(run.seq.output_ids)
        if self.policy is not None and run.seq.finished:  # a request given up early says nothing of lengths
            self.policy.record_length(len(run.seq.output_ids))
        return self.output(run)

    def output(self, run: Running) -> RequestOutput:
        seq = run.seq
        return RequestOutput(
            seq.prompt_ids,
            seq.output_ids,
            seq.text,
            seq.finish_reason,
            time.perf_counter() - run.start,
            run.first_token_s,
            run.metrics,
            run.logprobs,
            run.prompt_logprobs,
            run.cached_tokens,
            None if run.predicted is None else prediction_used(run.predicted, seq.output_ids),
            seq.stop_reason,
        )

    def step(self, run: Running) -> list[int]:
        """One step of a running request: draft, verify, accept. Returns the tokens it emitted."""
        plan = self.plan(run)
        ver = verify(self.target.decoder, run.cache, plan.root, plan.tree, run.seq.params, run.seq.past)
        return self.finish(run, plan, ver)

    def choose(self, run: Running) -> Choice:
        """The step's draft length as this request alone would choose it. With a drafter of several
        sources (`auto`), which one proposes is settled here, once a step, and the choice is that
        source's (a batch reads its figures next)."""
        if self.policy is None:
            return Choice(self.k, False)
        return self._choose(self.drafter.next_source(run.seq.context, run.seq.params))

    def choose_costless(self, run: Running) -> Choice:
        """`choose` limited to drafts that cost nothing to make (`auto`'s long suffix matches), for a
        batch whose draft model does not pay: a plain step when the drafter has none at hand. A dear
        source is not asked, so it neither probes nor pays a catch-up."""
        source = self.drafter.costless_source(run.seq.context, run.seq.params) if self.policy is not None else None
        if source is None:
            return Choice(0, False)
        return self._choose(source)

    def _choose(self, source: str | None) -> Choice:
        k, probe = self.policy.choose(source, self.can_shadow)
        return Choice(k, probe, source)

    def plan(self, run: Running, k_cap: int | None = None, chosen: Choice | None = None) -> Plan:
        """The step's draft (None: a plain step); `k_cap` bounds its length (a batch's load);
        `chosen` is what `choose` said, when the caller asked it already."""
        return run_alone(self.plan_steps(run, k_cap, chosen))

    def plan_steps(
        self, run: Running, k_cap: int | None = None, chosen: Choice | None = None
    ) -> Generator[DraftPass, torch.Tensor, Plan]:
        """`plan` with the drafter's model forwards yielded, for a batch to share them (passes.py)."""
        seq = run.seq
        context = seq.context
        room = seq.params.max_tokens - len(seq.output_ids)
        tree = shadow = None
        choice = chosen if chosen is not None else self.choose(run)
        k = choice.k if k_cap is None else min(choice.k, k_cap)
        source = choice.source
        if self.drafter is not None and room > 1:
            if k > 0:
                tree, source = yield from self._propose(run, min(k, room - 1), choice.source)
            elif self.can_shadow and self.policy is not None and self.policy.costless(choice.source):
                shadow, source = yield from self._propose(run, 1, choice.source)
        # The root was emitted last step and is not in the cache yet.
        allowed = k if self.drafter is not None else None
        return Plan(context[-1], tree, shadow, choice.probe, run.cache.length, time.perf_counter(), allowed, source)

    def batch_pass_seconds(self, sequences: int, source: str | None = None) -> float | None:
        """Seconds of one draft forward that `sequences` sequences pool, when a proposal from
        `source` runs a draft model whose forwards a batch pools; None otherwise."""
        return self.drafter.batch_pass_seconds(sequences, source) if self.drafter is not None else None

    @staticmethod
    def _accept(run: Running, ver: Verification, tree: DraftTree) -> Acceptance:
        """What the rule keeps of `tree`: greedy's argmax walk; under sampling, deterministic drafts
        and every draft of a seeded request against the target's own draw at each position (the
        text plain decoding writes with this key), other drafts with a distribution by the rejection
        rule with the request's generator."""
        if run.seq.params.greedy:
            return accept_greedy(ver.best, tree)
        if tree.probs is None or run.seq.params.seed is not None:
            return accept_one_hot(ver.probs, tree, run.key, run.seq.length)
        return accept(ver.probs, tree, run.gen, False)

    def finish(self, run: Running, plan: Plan, ver: Verification, timed: bool = True) -> list[int]:
        """Accept from the verified draft, roll the cache back, tell the policy and the drafter,
        emit. Returns the tokens emitted. `timed`: the step's time is this request's alone (not a
        pass shared with other sequences), so the policy may learn pass costs from it."""
        seq, cache, tree = run.seq, run.cache, plan.tree
        if tree is None or len(tree) == 0:
            first = ver.best[0] if seq.params.greedy else sample_at(ver.probs[0], run.key, seq.length)
            tokens, path = [int(first)], []
        else:
            acc = self._accept(run, ver, tree)
            tokens, path = acc.tokens, acc.path
        if self.policy is not None:
            self._tell_policy(plan, path, ver)
        base = plan.base  # slots before the root
        if path == list(range(len(path))):  # a chain prefix: rollback is a length change (aux rows go too)
            cache.truncate(base + 1 + len(path))
        else:
            cache.keep(list(range(base + 1)) + [base + 1 + node for node in path])
        if self.policy is not None and timed:
            self.policy.record_timed_step(tree.num_rows if tree is not None else 1, time.perf_counter() - plan.started)
        if self.drafter is not None and tree is not None:
            self.drafter.observe(len(path), ver.aux_logits)
        if self.reads_features:
            self.drafter.features(ver.hidden[[0] + [1 + node for node in path]])  # the root and the kept path
        emitted = []
        for token in tokens:
            emitted.append(token)
            if seq.append(token):
                break
        if run.logprobs is not None:
            # Each token from the row that predicted it: the root's (row 0), then each kept node's.
            rows = [0] + [1 + node for node in path[: len(emitted) - 1]]
            run.logprobs += token_logprobs(ver.logits[rows], emitted, seq.params.logprobs)
        run.prefill_logits = None  # stepped: its prefill can no longer be shared
        run.metrics.record_step(len(tree) if tree else 0, len(path), len(emitted))
        return emitted

    def _propose(
        self, run: Running, k: int, source: str | None
    ) -> Generator[DraftPass, torch.Tensor, tuple[DraftTree | None, str | None]]:
        """The drafter's proposal of up to k tokens from `source` (what the step chose), timed for the
        policy: the proposal and the source that made it."""
        seq = run.seq
        # The drafter's own time plus its share of the forwards (in a batch, the time between its
        # forwards is spent on other sequences).
        # A seeded request's drafts are drawn with its positions' uniforms (`PositionDraws`), so
        # the target's own draws keep them about as often as the rejection rule would.
        draws = PositionDraws(run.key, seq.length) if seq.params.seed is not None else run.gen
        tree, seconds = yield from _timed(self.drafter.propose_steps(seq.context, k, seq.params, draws, source))
        run.metrics.draft_seconds += seconds
        proposer = self.drafter.source
        if self.policy is not None:
            # A drafter that knows its own token cost says it (a draft model's catch-up on skipped
            # tokens is no cost of drafting one more); otherwise the call's time counts.
            per_token = self.drafter.cost_per_token() if tree is not None else None
            priced = per_token * k if per_token is not None else seconds
            # Every row the proposal adds counts, aux rows apart (lookahead's window rides on every
            # drafting step, whatever its length); None: nothing drafted, nothing to time.
            rows = tree.num_rows - 1 if tree is not None else None
            aux = len(tree.aux_tokens) if tree is not None else 0
            self.policy.record_proposal(priced, k, rows, proposer, aux)
        return tree, proposer

    def _tell_policy(self, plan: Plan, path: list[int], ver: Verification) -> None:
        """What the step showed about acceptance: a verified draft, a shadow proposal's first
        tokens against the target's distribution after the root, or nothing (a plain step). A
        proposal of aux rows alone (lookahead's window with no guess) paid for rows and drafted
        nothing: the policy sees it as a draft whose first token failed."""
        tree, shadow, source = plan.tree, plan.shadow, plan.source
        if tree is not None and len(tree):
            self.policy.record_drafted(max(tree.depths), len(path), plan.probe, source)
        elif tree is not None and tree.num_rows > 1:
            self.policy.record_drafted(1, 0, plan.probe, source)
        elif shadow is not None and len(shadow):
            # One-hot siblings are kept with their summed target probability (one at most under greedy).
            firsts = [shadow.tokens[i] for i in shadow.children(-1)]
            if ver.best is not None:
                kept = float(ver.best[0] in firsts)
            else:
                kept = min(float(ver.probs[0][torch.tensor(firsts, device=ver.probs.device)].sum()), 1.0)
            self.policy.record_shadow(kept, source)
        else:
            self.policy.record_plain()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        result: list[RequestOutput] = []
        for _ in self.stream(prompt_ids, params, result):
            pass
        return result[0]


def check_prompt_fits(limit: int, prompt_ids: list[int], max_tokens: int) -> int:
    """The tokens a prompt and its answer take (`len(prompt_ids) + max_tokens`); a clear error when
    the prompt is empty or they exceed the model's context of `limit`."""
    if not prompt_ids:
        raise ForerunError("the prompt is empty: give at least one token of prompt")
    need = len(prompt_ids) + max_tokens
    if need > limit:
        raise ForerunError(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) "
            f"is {need} tokens, beyond the model's context of {limit}; "
            "shorten the prompt or lower max_tokens"
        )
    return need


def _check_shareable(like: Running, prompt_ids: list[int]) -> None:
    """A clear error when `like`'s prefill cannot serve a request of `prompt_ids`."""
    if like.seq.prompt_ids != list(prompt_ids):
        raise ForerunError(
            "a prefill can be shared only by requests of the same prompt, and this "
            "prompt differs from the one of the request named to share it"
        )
    if like.prefill_logits is None or like.cache.length != len(prompt_ids):
        raise ForerunError(
            "the request named to share its prefill has already stepped (its cache holds "
            "more than the prompt): start every request of one prompt before the next step"
        )


def _share_prefill(run: Running, like: Running) -> torch.Tensor:
    """Copy `like`'s prompt slots into `run`'s cache (both empty past the prompt: `like` has not
    stepped); its prompt log probabilities too, cut to `run`'s count. Returns the last logits."""
    n = like.cache.length
    run.cache.k[:, :, :, :n] = like.cache.k[:, :, :, :n]  # [layers, B, kv_heads, n, head_dim]
    run.cache.v[:, :, :, :n] = like.cache.v[:, :, :, :n]
    run.cache.advance(n)
    top = run.seq.params.prompt_logprobs
    if top is not None:
        run.prompt_logprobs = [None] + [
            TokenLogprob(t.token_id, t.logprob, t.top[:top]) for t in like.prompt_logprobs[1:]
        ]
    return like.prefill_logits


def _timed(steps: DraftSteps) -> Generator[DraftPass, torch.Tensor, tuple[object, float]]:
    """Pass `steps`' forwards through; returns its result and the seconds it took: its own
    time between forwards plus each forward's share."""
    seconds, value = 0.0, None
    while True:
        started = time.perf_counter()
        try:
            step = steps.send(value)
        except StopIteration as stop:
            return stop.value, seconds + time.perf_counter() - started
        seconds += time.perf_counter() - started
        value = yield step
        seconds += step.seconds
