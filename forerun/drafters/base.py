"""The drafter protocol, whole: what the engine asks of anything that proposes tokens.

Three methods are required: `start` (a request begins), `propose` (up to k tokens after the
context) and `observe` (how many of them the target kept): the propose-then-hear interface of
assisted generation. Every other hook has a default here that keeps a drafter without it exact
and out of the way; a drafter overrides the ones it needs, and the engine calls each one directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from forerun.base.config import SamplingParams
from forerun.drafters.passes import DraftSteps
from forerun.models.kv_cache import KVCache
from forerun.models.prefix_cache import PrefixCache
from forerun.policy.catch_up import Gate
from forerun.verification.grammar import Grammar
from forerun.verification.sampling import Draws
from forerun.verification.tree import DraftTree


class Drafter(ABC):
    """Propose, then hear how many were accepted; the optional hooks below say the rest."""

    # A proposal leaves no state behind, so the engine may propose without verifying: shadow
    # proposals beside plain steps keep measuring acceptance (prompt lookup, suffix).
    stateless: bool = False
    # The engine calls `features` with the target's final hidden states of every row it keeps.
    reads_features: bool = False
    # Which source made the last proposal, for a drafter with several (`auto`); None: its only one.
    source: str | None = None
    # What it remembers across requests (earlier outputs), for LLM.new_engine to share among lanes.
    memory: object | None = None

    # --- required ---------------------------------------------------------------------------------

    @abstractmethod
    def start(self, prompt_ids: list[int], target_cache: KVCache, max_len: int) -> None:
        """A new request begins; `target_cache` is the target's cache (self-speculation reads it)."""

    @abstractmethod
    def propose(self, context: list[int], k: int, params: SamplingParams, generator: Draws) -> DraftTree | None:
        """Up to k draft tokens following `context` (prompt + output so far); None when it has no guess."""

    @abstractmethod
    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        """How many of the last proposal's tokens the target kept; `aux_logits` [A, vocab] are the
        target's logits at the proposal's aux rows (None when it had none)."""

    # --- optional ---------------------------------------------------------------------------------

    def follow(self, grammar: Grammar | None) -> None:
        """The request's structured output (None: it has none), kept at its output as that grows. A
        drafter that draws its drafts from a distribution masks it by the grammar after its draft
        so far, so its drafts stay inside the text; one that does not is still exact (a draft the
        text cannot take is refused at its row), only kept less often."""
        return None

    def expect(self, tokens: list[int]) -> None:
        """What the request's answer is expected to be, much of it (`SamplingParams.prediction`,
        tokenized; empty: nothing expected), told after `start`. A drafter that copies text may
        draft from it; any other leaves it."""
        return None

    def end(self, output_ids: list[int]) -> None:
        """The request ended with this output (a drafter that remembers earlier outputs adds it)."""
        return None

    def max_rows(self, k: int) -> int:
        """The most verifier rows after the root that one proposal of k tokens may add (nodes of a
        wide tree, aux rows), so the engine can size the cache up front."""
        return k

    def features(self, hidden: torch.Tensor) -> None:
        """The target's final hidden states [n, hidden] of the rows its cache keeps, in order: the
        prompt's after the prefill, the root's and the accepted path's after each step. Called only
        when `reads_features`."""
        return None

    def cost_per_token(self) -> float | None:
        """Seconds one more draft token costs, when the drafter knows better than the time its
        last propose() call took (None: time the call)."""
        return None

    def set_gate(self, gate: Gate) -> None:
        """For a drafter with a one-off cost before it can propose (a draft model reading a
        prompt): ask `gate` (policy/catch_up.py) first, and propose None when it says no."""
        return None

    def set_pass_cost(self, pass_cost: Callable[[int], float]) -> None:
        """c(rows), the target's measured pass cost, for a drafter that sizes its own drafts by it."""
        return None

    def keep_prefixes(self, prefixes: PrefixCache | None, tokens: int) -> PrefixCache | None:
        """For a drafter that prefills prompts of its own (a draft model): keep its prompt rows for
        later prompts that start the same (models/prefix_cache.py), as the target does, in `prefixes`
        (another lane's drafter's) or, when None, in a cache of its own for `tokens` tokens' rows.
        Returns the cache it uses, for the next lane's drafter (None: it prefills nothing)."""
        return None

    def next_source(self, context: list[int], params: SamplingParams) -> str | None:
        """Which of its sources will propose after `context` (a drafter of several keeps each one's
        figures apart in the cost policy); None: its only one."""
        return None

    def costless_source(self, context: list[int], params: SamplingParams) -> str | None:
        """The source whose proposal after `context` would cost nothing (a full batch, where dearer
        drafts do not pay, still takes it); None: it has none at hand."""
        return None

    def propose_steps(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: Draws,
        source: str | None = None,
    ) -> DraftSteps:
        """`propose` as a generator that yields each model forward it needs (passes.py), so a batch
        runs its lanes' forwards as one. `source`: what `next_source` or `costless_source` said
        this step (None: not asked). The default needs no forward."""
        return self.propose(context, k, params, generator)
        yield  # a generator that yields nothing

    def batch_pass_seconds(self, sequences: int, source: str | None = None) -> float | None:
        """Seconds of one draft forward that `sequences` lanes pool, when a proposal from `source`
        runs such forwards; None when it runs none."""
        return None
