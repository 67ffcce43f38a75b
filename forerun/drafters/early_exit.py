"""Self-speculation: the target with fewer layers drafts for the full target.

The draft runs either the first L layers (`layer=L`, early exit) or every layer but a chosen set
(`skip_layers=[...]`, as in Draft & Verify and SWIFT), then the target's own final norm and LM
head. It needs no second model, no extra memory and no extra prefill: it reads and writes the
target's KV cache for the layers it runs. For a prefix of layers those entries are exactly what
the draft would compute itself; for a skip set a kept layer's earlier entries come from the full
model, a close approximation that only costs acceptance, since verification keeps the output exact.
The draft's entries are provisional: the cache length is reset after drafting and verification
overwrites those slots with the full model's.

The draft tokens are sampled from the draft's processed distribution q (argmax under greedy) and
q goes to the acceptance rule, so sampling stays exact.

Where it loses: each draft token still costs a sequential forward of L/num_layers of the model plus
the full LM head, so a shallow exit drafts cheaply but is rarely accepted and a deep one is accepted
but costs almost a target forward; on models whose layers all matter (small models, or sampling at
high temperature) no setting pays. `forerun tune-skip` measures a few settings so you can pick one.
"""

from __future__ import annotations

import torch

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters import register
from forerun.drafters.base import Drafter
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel
from forerun.verification.grammar import Grammar
from forerun.verification.sampling import Draws, draw_tokens, probabilities
from forerun.verification.tree import DraftTree


def draft_layers(num_layers: int, layer: int | None = None, skip_layers: list[int] | None = None) -> list[int]:
    """The layers the draft runs, checked: a prefix (`layer`), everything but `skip_layers`, or by
    default the first three quarters (on the 1.5B Qwen2.5 target, α 0.02 at half depth, 0.18 at three
    quarters)."""
    if layer is not None and skip_layers is not None:
        raise ForerunError("give either --early-exit-layer or --skip-layers, not both")
    if skip_layers is not None:
        bad = [i for i in skip_layers if not 0 <= i < num_layers]
        if bad:
            raise ForerunError(f"--skip-layers {bad} are outside the model's layers 0..{num_layers - 1}")
        kept = [i for i in range(num_layers) if i not in set(skip_layers)]
        if not kept:
            raise ForerunError("--skip-layers skips every layer; keep at least one")
        return kept
    if layer is None:
        layer = max(1, 3 * num_layers // 4)
    if not 1 <= layer <= num_layers:
        raise ForerunError(f"--early-exit-layer must be between 1 and the model's {num_layers} layers, got {layer}")
    return list(range(layer))


@register("early-exit", cli_options={"early_exit_layer": "layer", "skip_layers": "skip_layers"})
class EarlyExitDrafter(Drafter):
    def __init__(self, target: LoadedModel, layer: int | None = None, skip_layers: list[int] | None = None) -> None:
        self.decoder = target.decoder
        self.layers = draft_layers(self.decoder.cfg.num_layers, layer, skip_layers)
        self.cache: KVCache | None = None
        self.grammar: Grammar | None = None  # the request's structured output (`follow`)

    def start(self, prompt_ids: list[int], target_cache: KVCache, max_len: int) -> None:
        self.cache = target_cache

    def follow(self, grammar: Grammar | None) -> None:
        self.grammar = grammar

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: Draws) -> DraftTree | None:
        decoder, cache = self.decoder, self.cache
        base = cache.length  # the target cache holds context[:-1]; the root comes next
        token = context[-1]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            ids = torch.tensor([token], device=decoder.device)
            pos = torch.tensor([base + i], device=decoder.device)
            logits = decoder(ids, pos, cache, last_only=True, layers=self.layers).logits[0]  # [1, V]
            if self.grammar is not None:  # the tokens the structured output allows after the draft so far
                allowed = self.grammar.allowed([tokens])[0, : logits.shape[-1]]
                if not allowed.any():
                    break
                logits = logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))
            q = probabilities(logits, params)  # [1, V]
            token = int(q.argmax()) if params.greedy else draw_tokens(q, generator, [i])[0]
            tokens.append(token)
            probs.append(q[0])
        cache.truncate(base)  # provisional entries: verification overwrites them
        if not tokens:
            return None
        return DraftTree.chain(tokens, None if params.greedy else torch.stack(probs))

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        pass
