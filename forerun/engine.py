"""The step loop: draft, verify in one target pass, accept, roll caches back, emit, tell the drafter."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from forerun.accept import accept
from forerun.config import SamplingParams
from forerun.cost_model import DraftLengthPolicy
from forerun.drafters import Drafter, rows_per_step
from forerun.errors import ForerunError
from forerun.metrics import SpecMetrics
from forerun.models import linear
from forerun.models.load import LoadedModel
from forerun.sampling import make_generator, probabilities, sample
from forerun.sequence import Sequence
from forerun.verify import verify


@dataclass
class StepOutput:
    token_ids: list[int]         # tokens emitted by this step
    text: str                    # text that became final with them
    finished: bool


@dataclass
class RequestOutput:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    elapsed_s: float             # generation only, from prefill to the last token
    first_token_s: float         # time to the first token
    metrics: SpecMetrics = field(default_factory=SpecMetrics)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


class Engine:
    """Runs requests one at a time. With a drafter, each step drafts `num_speculative_tokens`, or,
    given a `policy` (forerun/cost_model.py), the length that policy chooses up to it (0: a plain step)."""

    def __init__(self, target: LoadedModel, drafter: Drafter | None = None, num_speculative_tokens: int = 0,
                 policy: DraftLengthPolicy | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        self.policy = policy if drafter is not None and self.k > 0 else None
        # Free, stateless proposals can be made beside a plain step to keep measuring acceptance.
        self.can_shadow = bool(getattr(drafter, "stateless", False))
        # A drafter with several sources says which it will use and which it used (`auto`).
        self.next_source = getattr(drafter, "next_source", None)
        set_gate = getattr(drafter, "set_gate", None)
        if self.policy is not None and set_gate is not None:
            set_gate(self.policy.pays_setup)     # the policy decides when a catch-up pays
        self.rows = rows_per_step(drafter, self.k)   # most cache slots a step uses after the root
        self.last_k = self.k if drafter is not None else None   # the draft length the last step chose
        tok = target.tokenizer
        self.stop_ids = tok.stop_ids if tok is not None else frozenset()

    def check_fits(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Cache slots the request needs; a clear error before any work when it exceeds the context."""
        if not prompt_ids:
            raise ForerunError("the prompt is empty: give at least one token of prompt")
        limit = self.target.decoder.cfg.max_position
        need = len(prompt_ids) + params.max_tokens
        if need > limit:
            raise ForerunError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                               f"is {need} tokens, beyond the model's context of {limit}; "
                               "shorten the prompt or lower max_tokens")
        return need + self.rows + 1

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               result: list[RequestOutput] | None = None) -> Iterator[StepOutput]:
        """Yield what each step emits; append the finished RequestOutput to `result` if given."""
        decoder = self.target.decoder
        max_len = self.check_fits(prompt_ids, params)
        seq = Sequence(prompt_ids, params, self.target.tokenizer, self.stop_ids)
        metrics = SpecMetrics(num_speculative_tokens=self.k)
        gen = make_generator(params.seed, decoder.device)
        start = time.perf_counter()
        cache = decoder.new_cache(max_len)
        ids = torch.tensor(prompt_ids, device=decoder.device)
        if self.policy is not None:
            self.policy.start()
        with linear.prefill():
            if self.drafter is not None:
                self.drafter.start(seq.prompt_ids, cache, max_len)
            # Prefill the whole prompt; only the last position's logits are needed.
            logits = decoder(ids, torch.arange(len(prompt_ids), device=decoder.device), cache,
                             last_only=True).logits[0]
        first = int(sample(probabilities(logits, params), gen)[0])
        metrics.record_step(0, 0, 1)
        seq.append(first)
        first_token_s = time.perf_counter() - start
        yield StepOutput([first], seq.take_text(), seq.finished)
        while not seq.finished:
            emitted = self._step(seq, cache, gen, metrics)
            yield StepOutput(emitted, seq.take_text(), seq.finished)
        if result is not None:
            result.append(RequestOutput(seq.prompt_ids, seq.output_ids, seq.text, seq.finish_reason,
                                        time.perf_counter() - start, first_token_s, metrics))

    def _step(self, seq: Sequence, cache, gen: torch.Generator, metrics: SpecMetrics) -> list[int]:
        context = seq.context
        root = context[-1]                       # emitted last step, not in the cache yet
        room = seq.params.max_tokens - len(seq.output_ids)
        tree = shadow = None
        k, probe = self.k, False
        if self.policy is not None:
            self.policy.remaining = room
            if self.next_source is not None:
                self.policy.select(self.next_source(context))
            k, probe = self.policy.choose(self.can_shadow)
            self.last_k = k
        if self.drafter is not None and room > 1:
            if k > 0:
                tree = self._propose(context, min(k, room - 1), seq.params, gen)
            elif self.can_shadow and self.policy.free:
                shadow = self._propose(context, 1, seq.params, gen)
        base = cache.length                      # slots before the root
        step_start = time.perf_counter()
        ver = verify(self.target.decoder, cache, root, tree, seq.params)
        if tree is None or len(tree) == 0:
            first = ver.probs[0].argmax() if seq.params.greedy else sample(ver.probs[:1], gen)[0]
            tokens, path = [int(first)], []
        else:
            acc = accept(ver.probs, tree, gen, seq.params.greedy)
            tokens, path = acc.tokens, acc.path
        if self.policy is not None:
            self._tell_policy(tree, shadow, path, probe, ver.probs[0])
        if path == list(range(len(path))):     # a chain prefix: rollback is a length change (aux rows go too)
            cache.truncate(base + 1 + len(path))
        else:
            cache.keep(list(range(base + 1)) + [base + 1 + node for node in path])
        if self.policy is not None:
            self.policy.timed_step(tree.num_rows if tree is not None else 1, time.perf_counter() - step_start)
        if self.drafter is not None and tree is not None:
            self.drafter.observe(len(path), ver.aux_logits)
        emitted = []
        for token in tokens:
            emitted.append(token)
            if seq.append(token):
                break
        metrics.record_step(len(tree) if tree else 0, len(path), len(emitted))
        return emitted

    def _propose(self, context: list[int], k: int, params: SamplingParams, gen: torch.Generator):
        start = time.perf_counter()
        tree = self.drafter.propose(context, k, params, gen)
        if self.policy is not None and self.next_source is not None:
            self.policy.select(self.drafter.source)
        if self.policy is not None and tree is not None:     # None: nothing drafted, nothing to time
            seconds = time.perf_counter() - start
            # A drafter that knows its own token cost says it (a draft model's catch-up on skipped
            # tokens is no cost of drafting one more); otherwise the call's time counts.
            own = getattr(self.drafter, "cost_per_token", None)
            per_token = own() if own is not None else None
            self.policy.time_proposal(per_token * k if per_token is not None else seconds, k,
                                      len(tree) if tree is not None else 0)
        return tree

    def _tell_policy(self, tree, shadow, path: list[int], probe: bool, root_probs: torch.Tensor) -> None:
        """What the step showed about acceptance: a verified draft, a shadow proposal's first
        tokens against the target's distribution after the root, or nothing (a plain step)."""
        if tree is not None and len(tree):
            self.policy.drafted(max(tree.depths), len(path), probe)
        elif shadow is not None and len(shadow):
            # One-hot siblings are kept with their summed target probability (one at most under greedy).
            firsts = torch.tensor([shadow.tokens[i] for i in shadow.children(-1)], device=root_probs.device)
            self.policy.shadow(min(float(root_probs[firsts].sum()), 1.0))
        else:
            self.policy.plain()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        result: list[RequestOutput] = []
        for _ in self.stream(prompt_ids, params, result):
            pass
        return result[0]
