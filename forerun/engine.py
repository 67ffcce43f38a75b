"""The step loop: draft, verify in one target pass, accept, roll caches back, emit, tell the drafter."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from forerun.accept import accept
from forerun.config import SamplingParams
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
    def __init__(self, target: LoadedModel, drafter: Drafter | None = None, num_speculative_tokens: int = 0) -> None:
        self.target = target
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        self.rows = rows_per_step(drafter, self.k)   # most cache slots a step uses after the root
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
        tree = None
        if self.drafter is not None and room > 1:
            tree = self.drafter.propose(context, min(self.k, room - 1), seq.params, gen)
        base = cache.length                      # slots before the root
        ver = verify(self.target.decoder, cache, root, tree, seq.params)
        if tree is None or len(tree) == 0:
            tokens, path = [int(sample(ver.probs[:1], gen)[0])], []
        else:
            acc = accept(ver.probs, tree, gen, seq.params.greedy)
            tokens, path = acc.tokens, acc.path
        if path == list(range(len(path))):     # a chain prefix: rollback is a length change (aux rows go too)
            cache.truncate(base + 1 + len(path))
        else:
            cache.keep(list(range(base + 1)) + [base + 1 + node for node in path])
        if self.drafter is not None and tree is not None:
            self.drafter.observe(len(path), ver.aux_logits)
        emitted = []
        for token in tokens:
            emitted.append(token)
            if seq.append(token):
                break
        metrics.record_step(len(tree) if tree else 0, len(path), len(emitted))
        return emitted

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        result: list[RequestOutput] = []
        for _ in self.stream(prompt_ids, params, result):
            pass
        return result[0]
