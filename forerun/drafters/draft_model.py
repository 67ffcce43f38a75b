"""A smaller model of the same family drafts K tokens autoregressively with its own KV cache.

Before drafting it reads the tokens it has not seen (the prompt at first, then the target's token
and anything another drafter emitted) in one pass: its catch-up. The engine's cost policy may decline
a long catch-up (`set_gate`); the proposal is then None and the step goes without the draft model.

A draft also ends early once another token cannot pay (given the target's pass costs,
`set_pass_cost`): the product of the draft's own probabilities of its tokens so far estimates the
chance that all of them are kept, and one more token is worth drafting only while that chance
times a target pass (what an accepted token saves) exceeds the token's price, one draft forward
plus the extra verified row. Unsure drafts (translation, facts) then stop after a token or two
instead of paying for K.

With `second_choice`, a greedy draft is a small tree: the draft's second choice at a depth is
proposed too, as a leaf beside the chain's token, where its path's draft probability (the chain's
tokens before it, then it) is at least `second_choice` and a pass saved that often outweighs its
verified row. Where the chain's token is wrong, the target's token is often the draft's second (on
coding prompts the 0.5B's second choice is the 1.5B's token in ~60 % of the places its first is
not), and a leaf costs no draft forward: on a CPU with fast rows leaves raise the tokens per target
pass by ~16 % and the decode rate by ~5 %.

With `keep_prefixes` (an LLM with a prefix cache asks it), a prompt's leading blocks that an earlier
prompt's catch-up computed are restored into the draft's cache instead of read again
(models/prefix_cache.py), where its rows come out the same in any chunks: a conversation's next
turn, a shared system prompt. An LLM's drafters (one a lane) share one such cache.

The cost figures and the rules that use them are the policy's (policy/draft_model_costs.py); what
every drafter over one draft model shares is in draft_setup.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from forerun import native
from forerun.base.config import SamplingParams
from forerun.drafters import register
from forerun.drafters.base import Drafter
from forerun.drafters.draft_setup import draft_setup
from forerun.drafters.passes import DraftPass, DraftSteps, run_alone
from forerun.drafters.vocabulary import full_vocabulary
from forerun.models import formats
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel, load_model
from forerun.models.prefix_cache import PrefixCache, token_bytes
from forerun.policy.catch_up import CATCH_UP_UNASKED, Gate
from forerun.policy.draft_model_costs import BRANCH, SECOND_CHOICE, DraftModelCosts, pooled_prior, time_draft_passes
from forerun.policy.pass_costs import PassCosts
from forerun.verification.grammar import Grammar
from forerun.verification.sampling import Draws, draw_tokens, probabilities
from forerun.verification.tree import DraftTree

# The draft model's own flags (CLI destination -> keyword), shared with `auto`.
DRAFT_MODEL_CLI = {
    "speculative_model": "model",
    "speculative_quantization": "quantize",
    "draft_min_confidence": "min_confidence",
    "draft_vocab": "draft_vocab",
    "draft_second_choice": "second_choice",
    "draft_branch": "branch",
}


@register("draft", needs_draft_model=True, cli_options=DRAFT_MODEL_CLI)
class DraftModelDrafter(Drafter):
    def __init__(
        self,
        target: LoadedModel,
        model: str | LoadedModel,
        dtype: str = "bfloat16",
        device: str | None = None,
        quantize: str | None = None,
        min_confidence: float = 0.0,
        draft_vocab: int | None = None,
        second_choice: float = SECOND_CHOICE,
        branch: int = BRANCH,
    ) -> None:
        """`quantize` ("int8", "w8a8") stores the draft's products in that format (fewer bytes per
        draft token); `min_confidence` ends a draft early once the draft's top probability falls below
        it; `draft_vocab` N scores only the N tokens the target writes most (draft_vocab.py);
        `second_choice`: greedy drafts add the draft's second choice as a leaf where the draft's
        probability of its path is at least this and the leaf's row pays (above 1: chains only);
        `branch`: the first such leaf is continued by up to this many draft tokens (0: none)."""
        if branch < 0:
            raise ValueError(f"draft branch must be 0 or more tokens, got {branch}")
        self.model = _draft_model(target, model, dtype, device, quantize)
        self.min_confidence = min_confidence
        self.second_choice = second_choice
        self.branch = branch
        self.setup = draft_setup(target, self.model, draft_vocab)
        self.vocab, self.head = self.setup.vocab, self.setup.head
        self.vocab_size = target.decoder.cfg.vocab_size
        self.rows_short = self.model.decoder.cfg.vocab_size < self.vocab_size  # the target's head is larger
        self.cache: KVCache | None = None
        self.max_len = 0  # slots this request's cache needs
        self.prompt_len = 0  # the request's prompt tokens (what the context holds beyond them is output)
        self.prefixes: PrefixCache | None = None  # see keep_prefixes
        self.stored = False  # this request's prompt rows went to the prefix cache
        self.fed: list[int] = []  # tokens whose keys/values sit in self.cache, in order
        self.costs = DraftModelCosts()
        self.gate: Gate | None = None  # see set_gate
        self.proposed = 0  # tokens in the proposal awaiting its verdict
        self.drafted = True  # this request drafted (a first request counts as having)
        # The gate agreed to a catch-up not made yet. It stands until a proposal makes it: a batch's
        # load may turn the step it was agreed for into a plain one.
        self.admitted = False
        self.grammar: Grammar | None = None  # the request's structured output (`follow`)

    def start(self, prompt_ids: list[int], target_cache: KVCache, max_len: int) -> None:
        # The cache is made at the first proposal (a request the draft model never drafts for, as
        # under a full server batch, needs none), and the last request's is kept when it is long
        # enough: its entries past the length are overwritten or masked (weight exactly 0), and
        # whatever they held could change only a draft, never the output (the target decides).
        self.max_len = max_len
        if self.cache is not None and self.cache.max_len >= self.model.decoder.cache_slots(max_len):
            self.cache.reset()
        else:
            self.cache = None
        self.prompt_len = len(prompt_ids)
        self.fed = []
        self.stored = False
        self.admitted = False
        if not self.drafted and self.setup.timed is not None:
            self.costs.age(self.setup.timed[1])
        self.drafted = False

    def max_rows(self, k: int) -> int:
        """A chain of k, and under greedy up to k second-choice leaves and `branch` tokens after one."""
        return 2 * k + self.branch if self.second_choice <= 1 else k

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
        """`propose` as draft forwards yielded one by one (passes.py: a batch runs several
        sequences' forwards as one)."""
        pending = self._roll_back(context)
        if self.rows_short and max(pending) >= self.model.decoder.cfg.vocab_size:
            return None  # a token only the target's larger head has (one of its padding rows): no draft
        # The root is read on every proposal; only what lies before it is catch-up.
        admitted, self.admitted = self.admitted, False
        if len(pending) - 1 > CATCH_UP_UNASKED and not admitted and not self._pays(len(pending) - 1, context, params):
            return None
        self.drafted = True
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        leaves: list[tuple[int, int]] = []  # (depth index, token): second choices beside the chain
        branch = _Branch(self.branch if params.greedy else 0)
        kept_chance = 1.0  # the draft's probability of its whole draft so far
        for _ in range(k):
            step = DraftPass(self.model.decoder, self.cache, pending, len(self.fed), self.head, *branch.rows())
            logits = yield step  # [1, N], [2, N] with a branch
            self._time_pass(step)
            self.fed += pending
            self._store()
            if self.grammar is not None and not self._inside(logits[0], tokens):
                break  # the text allows none of the draft's tokens next
            if branch.growing:
                rows = len(tokens) + len(leaves) + branch.after
                branch.grow(_top2(logits[1]), lambda p, rows=rows: self.leaf_pays(p, rows), self._token)
            if params.greedy:
                top = _top2(logits[0])
                choice = self._greedy_choice(top, kept_chance, len(tokens), leaves, branch.after)
                if len(leaves) == 1 and leaves[0][0] == len(tokens):
                    branch.start(leaves[0][1], len(self.fed), kept_chance * top.p_second)
                chance = most = top.p_first
            else:
                confidence = logits[0].softmax(-1)  # [N]
                q = probabilities(logits, params)  # [1, N]
                # Over the draft vocabulary's columns: its ids ascend, so a position's uniform picks
                # the token it picks over the whole vocabulary (a seeded request's `PositionDraws`).
                choice = draw_tokens(q, generator, [len(tokens)])[0]
                probs.append(full_vocabulary(q[0], self.vocab, self.vocab_size))
                chance, most = float(confidence[choice]), float(confidence.max())
            tokens.append(self._token(choice))
            pending = [tokens[-1]]
            kept_chance *= chance
            if self.min_confidence and most < self.min_confidence:
                break
            if len(tokens) < k and not self._worth_another(len(tokens), kept_chance, step):
                break
        self.proposed = len(tokens)
        if not tokens:
            return None
        return _tree(tokens, leaves, None if params.greedy else torch.stack(probs), branch.tokens[1:])

    def follow(self, grammar: Grammar | None) -> None:
        self.grammar = grammar

    def _inside(self, row: torch.Tensor, path: list[int]) -> bool:
        """Mask a draft row [N] in place to the tokens the structured output allows after the
        output and `path`; False when it allows none of the draft's columns."""
        allowed = self.grammar.allowed([path])[0]  # [V], the target's vocabulary
        columns = allowed[self.vocab] if self.vocab is not None else allowed[: row.shape[-1]]
        if columns.shape[-1] < row.shape[-1]:  # draft rows past the target's vocabulary: never allowed
            columns = torch.cat([columns, columns.new_zeros(row.shape[-1] - columns.shape[-1])])
        row.masked_fill_(~columns.to(row.device), float("-inf"))
        return bool(columns.any())

    def _roll_back(self, context: list[int]) -> list[int]:
        """Drop what the context no longer agrees with (rejected drafts); the tokens to read next."""
        self._restore(context)
        keep = min(_common_prefix(self.fed, context), len(context) - 1)
        self.cache.truncate(keep)
        self.fed = self.fed[:keep]
        return context[keep:]

    def _prefixes(self) -> PrefixCache | None:
        """The shared prefix cache where this cache's rows are exact (`Decoder.chains_into`), else None."""
        prefixes = self.prefixes
        return prefixes if prefixes is not None and self.model.decoder.chains_into(self.cache) else None

    def _restore(self, context: list[int]) -> None:
        """Make the cache at need; into an empty one, the prompt's leading blocks an earlier catch-up kept."""
        if self.cache is None:
            self.cache = self.model.decoder.new_cache(self.max_len)
        prefixes = self._prefixes() if self.cache.length == 0 else None
        if prefixes is not None:
            self.fed = context[: prefixes.restore(context[: self.prompt_len], self.cache)]

    def _store(self) -> None:
        """Keep the prompt's rows once the cache holds them all (once a request)."""
        if self.stored or len(self.fed) < self.prompt_len:
            return
        prefixes = self._prefixes()
        if prefixes is not None:
            prefixes.store(self.fed[: self.prompt_len], self.cache)
        self.stored = True

    def keep_prefixes(self, prefixes: PrefixCache | None, tokens: int) -> PrefixCache | None:
        """The draft model's prompt rows kept in `prefixes`, or in a new cache for `tokens` of them."""
        if prefixes is None and tokens > 0:
            prefixes = PrefixCache(tokens * token_bytes(self.model.decoder))
        self.prefixes = prefixes
        return prefixes

    def _greedy_choice(
        self, top: native.Top2, kept_chance: float, drafted: int, leaves: list[tuple[int, int]], more: int = 0
    ) -> int:
        """The draft's first choice [column]; its second joins `leaves` where that leaf pays beside
        the draft's rows so far (`drafted` chain tokens, the leaves, `more` others)."""
        if top.second >= 0 and self.leaf_pays(kept_chance * top.p_second, drafted + len(leaves) + more):
            leaves.append((drafted, self._token(top.second)))
        return top.first

    def leaf_pays(self, chance: float, rows: int) -> bool:
        """Whether a node off the chain (a second-choice leaf, a token continuing one) that the
        target keeps with probability about `chance` pays for its row beside `rows` others."""
        return self.costs.leaf_pays(chance, rows + 1, self.second_choice)

    def _token(self, choice: int) -> int:
        """The target's token id of column `choice` of the draft's head."""
        return choice if self.vocab is None else int(self.vocab[choice])

    def set_pass_cost(self, pass_cost: Callable[[int], float]) -> None:
        self.costs.pass_cost = pass_cost

    def _worth_another(self, drafted: int, kept_chance: float, last: DraftPass) -> bool:
        """Whether a token after `drafted` ones, all kept with probability `kept_chance`, pays
        (True when the target's costs are not known). A forward pooled like `last` by several
        sequences costs each its share."""
        if self.costs.pass_cost is None:
            return True
        if last.passes == 1:
            token_seconds = self.costs.token_seconds
        else:
            token_seconds = self.batch_pass_seconds(last.passes) / last.passes
        return self.costs.worth_another(kept_chance, token_seconds, drafted)

    def ready(self, context: list[int], params: SamplingParams) -> bool:
        """Whether a proposal after `context` would draft: its catch-up is paid without asking, or
        the gate pays for it now (asked here once per step; the proposal that follows does not ask
        again)."""
        if self.gate is None:
            return True
        self._restore(context)  # a restored prefix is no catch-up
        skipped = len(context) - 1 - min(_common_prefix(self.fed, context), len(context) - 1)
        if skipped <= CATCH_UP_UNASKED or self.admitted:
            return True  # admitted before and not proposed since (the step went plain): still paid for
        self.admitted = self._pays(skipped, context, params)
        return self.admitted

    def _pays(self, skipped: int, context: list[int], params: SamplingParams) -> bool:
        """The gate's answer on a catch-up of `skipped` tokens (True without a gate)."""
        if self.gate is None:
            return True
        emitted = len(context) - self.prompt_len
        costs = self.costs
        seconds = self.catch_up_seconds(skipped)
        return self.gate(seconds, costs.token_seconds, costs.acceptance.alpha, params.max_tokens - emitted, emitted)

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        # The cache needs nothing: the next propose() rolls back by comparing contexts.
        if self.proposed:
            self.costs.acceptance.observe(num_accepted, 1 if num_accepted < self.proposed else 0)
            self.proposed = 0

    def cost_per_token(self) -> float | None:
        """What one more draft token costs (a one-token forward), catching up on skipped tokens
        left out: the cost model's c_draft. None before one is timed."""
        return self.costs.token_seconds

    def set_gate(self, gate: Gate) -> None:
        """Before a catch-up longer than CATCH_UP_UNASKED tokens, ask `gate`; no declines the
        proposal. Times the draft model now (under a second), so the first estimates fall at load
        time, not in a request."""
        self.gate = gate
        costs = self.costs
        if costs.read_seconds is None or costs.token_seconds is None:
            read, token = self.setup.timed if self.setup.timed is not None else self._time_passes()
            self.setup.timed = (read, token)
            costs.read_seconds = costs.read_seconds or read
            costs.token_seconds = costs.token_seconds or token

    def catch_up_seconds(self, tokens: int) -> float:
        """Estimated time to read `tokens` skipped tokens, from the catch-up passes timed so far."""
        if self.costs.read_seconds is None:
            self.costs.read_seconds = self._time_passes()[0]
        return tokens * self.costs.read_seconds

    def _time_passes(self) -> tuple[float, float]:
        return time_draft_passes(self.model.decoder, self.head)

    def _time_pass(self, step: DraftPass) -> None:
        """Learn from a timed forward: a pass alone times this drafter's token or catch-up cost; a
        forward pooled with other sequences times the batched draft (`batch_pass_seconds`)."""
        if step.passes == 1:
            self.costs.record_pass(len(step.tokens), step.seconds)
        elif step.lead:
            self._pooled_costs().observe(step.rows, step.seconds * step.passes)

    def batch_pass_seconds(self, sequences: int, source: str | None = None) -> float:
        """Seconds of one draft forward pooled by `sequences` sequences drafting a token each: as
        measured in a batch, else estimated from a one-token forward and the per-row cost of a
        catch-up."""
        return self._pooled_costs()(sequences)

    def _pooled_costs(self) -> PassCosts:
        if self.setup.pooled_costs is None:
            read, token = self.costs.read_seconds, self.costs.token_seconds
            if read is None or token is None:
                timed_read, timed_token = self._time_passes()
                read, token = read or timed_read, token or timed_token
            self.setup.pooled_costs = pooled_prior(read, token)
        return self.setup.pooled_costs


def _draft_model(
    target: LoadedModel, model: str | LoadedModel, dtype: str, device: str | None, quantize: str | None
) -> LoadedModel:
    """The draft model, loaded (or quantized) as asked; a warning when it is larger than the target."""
    if quantize not in (None, formats.AUTO):
        formats.get(quantize)
    if isinstance(model, LoadedModel):
        if quantize:
            formats.quantize_(model.decoder, quantize)
    else:
        device = device or str(target.decoder.device)
        model = load_model(model, dtype, device, quantization=quantize, draft=True, tokens_like=target)
    if _num_weights(model.decoder) > _num_weights(target.decoder):
        warnings.warn(
            f"draft {model.name} is larger than target {target.name}: "
            "speculation will likely be slower than plain decoding",
            stacklevel=3,
        )
    return model


def _tree(tokens: list[int], leaves: list[tuple[int, int]], probs: torch.Tensor | None, after: list[int]) -> DraftTree:
    """The chain of `tokens` (draft distributions `probs` [K, V], None: greedy), with each leaf
    (depth index d, token) beside the chain's token at depth d, hanging from that token's parent,
    and the tokens `after` continuing the first leaf (node len(tokens)), one below the other."""
    if not leaves:
        return DraftTree.chain(tokens, probs)
    n, first_after = len(tokens), len(tokens) + len(leaves)
    parents = list(range(-1, n - 1)) + [d - 1 for d, _ in leaves]
    parents += [n if i == 0 else first_after + i - 1 for i in range(len(after))]
    return DraftTree(tokens + [t for _, t in leaves] + after, parents)


class _Branch:
    """A greedy draft's first second-choice leaf, continued by the draft model in the chain's own
    forwards (DraftPass.branch) while each further token's row pays, by up to `most` tokens."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.tokens: list[int] = []  # the leaf, then its continuation
        self.fork = 0  # the leaf's position (slot)
        self.chance = 0.0  # the draft's probability of the branch's whole path
        self.growing = False

    @property
    def after(self) -> int:
        """Tokens continuing the leaf so far."""
        return max(len(self.tokens) - 1, 0)

    def rows(self) -> tuple[list[int], int]:
        """What the next forward feeds for the branch: its tokens and the leaf's position (nothing
        unless it is growing)."""
        return (list(self.tokens), self.fork) if self.growing else ([], 0)

    def start(self, leaf: int, fork: int, chance: float) -> None:
        """The leaf at position `fork`, kept with probability about `chance`, starts the branch
        (once a draft)."""
        if self.most > 0 and not self.tokens:
            self.tokens, self.fork, self.chance, self.growing = [leaf], fork, chance, True

    def grow(self, top: native.Top2, pays: Callable[[float], bool], token: Callable[[int], int]) -> None:
        """The draft's next token on the branch, from the likeliest of its distribution after the
        branch, kept where `pays` (the path's probability) says its row pays; else the branch ends."""
        self.chance *= top.p_first
        if not pays(self.chance):
            self.growing = False
            return
        self.tokens.append(token(top.first))
        self.growing = self.after < self.most


def _top2(logits: torch.Tensor) -> native.Top2:
    """A row of draft logits' two likeliest tokens (columns) and their probabilities; a one-column
    row has no second (-1)."""
    if logits.shape[-1] < 2:
        return native.Top2(0, -1, 1.0, 0.0)
    return native.softmax_top2(logits)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _num_weights(module: torch.nn.Module) -> int:
    """Weights in any format: parameters and int8 buffers alike, GGUF blocks by the weights they hold."""
    from forerun.models.gguf_format import GGUFEmbedding, GGUFLinear

    total = 0
    for m in module.modules():
        if isinstance(m, GGUFLinear):
            total += m.in_features * m.out_features
        elif isinstance(m, GGUFEmbedding):
            total += m.num_embeddings * m.embedding_dim
        else:
            total += sum(t.numel() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
    return total
