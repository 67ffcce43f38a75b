"""Drafters: anything that proposes tokens. Found by name in a registry, never by an if/elif chain."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.models.kv_cache import KVCache
from forerun.verification.tree import DraftTree


class Drafter(Protocol):
    """Propose, then hear how many were accepted (the two-method interface of assisted generation)."""

    def start(self, prompt_ids: list[int], target_cache: KVCache, max_len: int) -> None:
        """A new request begins; `target_cache` is the target's cache (self-speculation reads it)."""

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> DraftTree | None:
        """Up to k draft tokens following `context` (prompt + output so far); None when it has no guess."""

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        """How many of the last proposal's tokens the target kept; `aux_logits` [A, vocab] are the
        target's logits at the proposal's aux rows (None when it had none)."""

    # Optional: `end(output_ids)`, the request ended with this output (a drafter that remembers
    # earlier outputs adds it). `memory`: what it remembers, for LLM.new_engine to share among lanes.
    # Optional: `max_rows(k) -> int`, the most verifier rows after the root that one proposal of k
    # tokens may add (nodes of a wide tree, aux rows). Without it a proposal adds at most k rows.
    # Optional: `cost_per_token() -> float | None`, seconds one more draft token costs, when the
    # drafter knows better than the time its propose() call took (cost_model.py uses it).
    # Optional: `set_gate(gate)`, for a drafter with a one-off cost before it can propose (a draft
    # model reading a prompt): it calls gate(seconds, cost_per_token, alpha) first and returns None on False.
    # Optional: `stateless = True`, a proposal leaves no state behind, so the engine may propose
    # without verifying (shadow proposals that keep measuring acceptance on plain steps).
    # Optional: `reads_features = True` with `features(hidden)`: the target's final hidden states
    # [n, hidden] of the rows its cache keeps, in order (the prompt's after the prefill; the root's
    # and the accepted path's after each step), for drafters that read them (draft heads).
    # Optional: `set_pass_cost(c)`, c(rows) the target's measured pass cost, for a drafter that
    # sizes its own tree (EAGLE).
    # Optional: `propose_steps(context, k, params, generator)`, `propose` as a generator that yields
    # each model forward it needs (passes.py), so a batch runs its lanes' forwards as one; with it,
    # `batch_pass_seconds(n) -> float | None`, one such forward's seconds when n lanes share it
    # (None when the coming proposal runs no forward).


DrafterFactory = Callable[..., Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    def add(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        return factory

    return add


def rows_per_step(drafter: Drafter | None, k: int) -> int:
    """Cache slots one step may use after the root, so the engine can size the cache up front."""
    if drafter is None:
        return 0
    max_rows = getattr(drafter, "max_rows", None)
    return max_rows(k) if max_rows is not None else k


def available() -> list[str]:
    _import_all()
    return sorted(_REGISTRY)


def create(name: str, target, options: dict) -> Drafter:
    """Build drafter `name` for `target` (a LoadedModel) from its own settings alone."""
    _import_all()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ForerunError(
            f"unknown speculative method {name!r}; choose one of {', '.join(sorted(_REGISTRY))}"
        ) from None
    return factory(target, **options)


def _import_all() -> None:
    # Each module registers itself on import.
    from forerun.drafters import (  # noqa: F401
        auto,
        draft_model,
        eagle,
        early_exit,
        lookahead,
        medusa,
        ngram,
        suffix,
    )
