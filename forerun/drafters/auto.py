"""The combining method (`auto`, the default when a draft model is given): the suffix drafter's
proposal when its match is long, else the draft model's; under a structured output, first the
tokens the grammar forces where it forces any.

A long match (`long_match` tokens or more of the context found earlier in the prompt, the output
or earlier outputs) means the text is copying: the suffix draft is then costless and usually right,
and the draft model is not run at all for that step. Elsewhere the draft model guesses. Both go
through the same verifier and exact rule, so the output is the target's either way; the draft
model catches up on the tokens it skipped in one chain pass at its next proposal. Until the cost
policy agrees to pay the draft model's catch-up (reading a long prompt is worth it only for a long
answer), the suffix drafter proposes whatever match it has. `next_source(context)` says before a
step which source will propose (the grammar's forced tokens where there are any; else asking the
draft model whether its catch-up pays now, so a step the draft model sits out is priced as the
suffix drafter's), and `source` after it which did, so the cost policy keeps each one's
acceptance and cost apart (a forced draft's copied continuation counts with the grammar's).
`costless_source(context)` asks only the grammar and the suffix drafter: a full batch, where the
draft model does not pay, still takes their costless drafts.

Where a structured output allows one continuation (a schema's fixed keys, a tool call's
`{"name": "`), its tokens are the draft (source "grammar", `Grammar.forced`): they cost nothing and
the target's masked rows keep them but where a token splits their text otherwise; verified as any
other draft, so exact whatever they are.

Cost: a suffix look-up every step (microseconds), a draft-model token only on steps without a long
match. Where it loses: a long match that stops being copied wastes one verification, and the
threshold is a fixed number of tokens, not a learned score.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forerun.base.config import SamplingParams
from forerun.drafters import register
from forerun.drafters.base import Drafter
from forerun.drafters.draft_model import DRAFT_MODEL_CLI, DraftModelDrafter
from forerun.drafters.passes import DraftSteps, run_alone
from forerun.drafters.suffix import SuffixDrafter, SuffixMemory
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel
from forerun.models.prefix_cache import PrefixCache
from forerun.policy.catch_up import Gate
from forerun.policy.draft_model_costs import BRANCH, SECOND_CHOICE
from forerun.verification.grammar import Grammar
from forerun.verification.sampling import Draws
from forerun.verification.tree import DraftTree

GRAMMAR = "grammar"  # the source of the tokens a structured output forces


class SuffixFirst(Drafter):
    """The suffix drafter's proposal on a long match, else a second drafter's (`second`, its
    source named `name`): what `auto` (a draft model) and `auto-head` (a trained head) share.
    Under a structured output, first the tokens it forces (source "grammar"), where it forces any.
    `next_source`, `source` and `steps` name the sources; the second drafter hears its own
    verdicts and prices its own tokens only after its own proposals."""

    def __init__(
        self, target: LoadedModel, second: Drafter, name: str, long_match: int, memory: SuffixMemory | None
    ) -> None:
        self.suffix = SuffixDrafter(target, memory=memory)
        self.second, self.name = second, name
        self.long_match = long_match
        self.steps = {"suffix": 0, name: 0}  # proposals made by each, this process ("grammar" once it drafts)
        self.source = name  # which made the last proposal
        self.grammar: Grammar | None = None  # the request's structured output, at its output

    @property
    def memory(self) -> SuffixMemory:
        return self.suffix.memory

    def max_rows(self, k: int) -> int:
        return max(self.suffix.max_rows(k), self.second.max_rows(k))

    def start(self, prompt_ids: list[int], target_cache: KVCache, max_len: int) -> None:
        self.suffix.start(prompt_ids, target_cache, max_len)
        self.second.start(prompt_ids, target_cache, max_len)

    def follow(self, grammar: Grammar | None) -> None:
        self.grammar = grammar
        self.second.follow(grammar)

    def expect(self, tokens: list[int]) -> None:
        self.suffix.expect(tokens)
        self.second.expect(tokens)

    def _forced(self) -> list[int]:
        """The tokens the request's structured output takes next whatever is said (none without one)."""
        return self.grammar.forced() if self.grammar is not None else []

    def set_gate(self, gate: Gate) -> None:
        self.second.set_gate(gate)

    def set_pass_cost(self, pass_cost: Callable[[int], float]) -> None:
        self.second.set_pass_cost(pass_cost)

    def keep_prefixes(self, prefixes: PrefixCache | None, tokens: int) -> PrefixCache | None:
        return self.second.keep_prefixes(prefixes, tokens)

    def second_ready(self, context: list[int], params: SamplingParams) -> bool:
        """Whether the second drafter would propose now (True unless it says otherwise)."""
        return True

    def next_source(self, context: list[int], params: SamplingParams) -> str:
        """Which will propose after `context` (the cost policy keeps their acceptance apart): the
        grammar where it forces tokens, the suffix drafter on a long match or while the second is
        not ready, else the second."""
        if self._forced():
            return GRAMMAR
        long = self.suffix.match_length(context) >= self.long_match
        return "suffix" if long or not self.second_ready(context, params) else self.name

    def costless_source(self, context: list[int], params: SamplingParams) -> str | None:
        """ "grammar" where the structured output forces the next tokens, "suffix" when a long match
        makes the coming proposal the suffix drafter's, both costing nothing; None when only the
        second drafter would propose."""
        if self._forced():
            return GRAMMAR
        return "suffix" if self.suffix.match_length(context) >= self.long_match else None

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: Draws) -> DraftTree | None:
        return run_alone(self.propose_steps(context, k, params, generator))

    def propose_steps(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: Draws,
        source: str | None = None,
    ) -> DraftSteps:
        """`propose` with the second drafter's forwards yielded (passes.py). `source`: the one the
        step planned (None: the grammar's forced tokens where there are any, else the second drafter
        unless the suffix drafter has a long match)."""
        forced = self._forced() if source in (None, GRAMMAR) else []
        if forced:
            self.source = GRAMMAR
            self.steps[GRAMMAR] = self.steps.get(GRAMMAR, 0) + 1
            return self._after_forced(context, forced[:k], k, params, generator)
        tree, match = self.suffix.propose_with_match(context, k, params, generator)
        if (tree is None or match < self.long_match) if source is None else source == self.name:
            drafted = yield from self.second.propose_steps(context, k, params, generator)
            if drafted is not None:  # None: it declined (a catch-up that does not pay), the suffix's guess stands
                self.source = self.name
                self.steps[self.name] += 1
                return drafted
        self.source = "suffix"
        self.steps["suffix"] += 1
        return tree

    def _after_forced(
        self, context: list[int], forced: list[int], k: int, params: SamplingParams, generator: Draws
    ) -> DraftTree:
        """The forced tokens, and past them, where the text is being copied (a long suffix match of
        the context and them), the suffix drafter's continuation."""
        if len(forced) < k:
            tree, match = self.suffix.propose_with_match(context, k - len(forced), params, generator, ahead=forced)
            if tree is not None and match >= self.long_match:
                n = len(forced)
                parents = [*range(-1, n - 1), *(p + n if p >= 0 else n - 1 for p in tree.parents)]
                return DraftTree(forced + tree.tokens, parents)
        return DraftTree.chain(forced)

    def batch_pass_seconds(self, sequences: int, source: str | None = None) -> float | None:
        """A pooled draft forward's seconds (the second drafter's) when the coming proposal is the
        second drafter's; None when it is the grammar's or the suffix drafter's (no forward to pool)."""
        return self.second.batch_pass_seconds(sequences) if source == self.name else None

    def end(self, output_ids: list[int]) -> None:
        self.suffix.end(output_ids)

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        if self.source == self.name:  # the second drafter counts its own verdicts
            self.second.observe(num_accepted, aux_logits)

    def cost_per_token(self) -> float | None:
        """The second drafter's token cost after its proposals; None (time the call) after the suffix's."""
        return self.second.cost_per_token() if self.source == self.name else None


@register("auto", needs_draft_model=True, cli_options={**DRAFT_MODEL_CLI, "auto_long_match": "long_match"})
class AutoDrafter(SuffixFirst):
    def __init__(
        self,
        target: LoadedModel,
        model,
        dtype: str = "bfloat16",
        device: str | None = None,
        quantize: str | None = None,
        min_confidence: float = 0.0,
        draft_vocab: int | None = None,
        long_match: int = 8,
        second_choice: float = SECOND_CHOICE,
        memory: SuffixMemory | None = None,
        branch: int = BRANCH,
    ) -> None:
        """The draft model's settings as DraftModelDrafter takes them; `long_match`: the shortest
        suffix match (tokens) whose continuation is proposed instead of the draft model's;
        `memory`: the suffix drafter's memory of earlier outputs, when shared (SuffixDrafter)."""
        self.draft = DraftModelDrafter(
            target, model, dtype, device, quantize, min_confidence, draft_vocab, second_choice, branch
        )
        super().__init__(target, self.draft, "draft", long_match, memory)

    def second_ready(self, context: list[int], params: SamplingParams) -> bool:
        """Whether the draft model's catch-up pays now (until it does, the suffix drafter proposes)."""
        return self.draft.ready(context, params)
