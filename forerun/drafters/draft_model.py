"""A smaller model of the same family drafts K tokens autoregressively with its own KV cache.

Before drafting it reads the tokens it has not seen (the prompt at first, then the target's token
and anything another drafter emitted) in one pass: its catch-up. The engine's cost policy may decline
a long catch-up (`gate`); the proposal is then None and the step goes without the draft model.

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
not), and a leaf costs no draft forward. On the AMX Xeon leaves raise the tokens per target pass
by ~16 % and the decode rate by ~5 % (docs/benchmarks.md, runs 20 and 21).
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable
from contextlib import nullcontext

import torch

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters import register
from forerun.drafters.draft_vocab import draft_vocabulary, reduced_head
from forerun.drafters.passes import DraftPass, DraftSteps, run_alone
from forerun.models import formats, linear
from forerun.models.attention import RowLayout
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel, load_model
from forerun.models.tokenizer import Tokenizer
from forerun.policy.cost_model import Acceptance, PassCosts
from forerun.verification.sampling import probabilities, sample
from forerun.verification.tree import DraftTree

DRAFT_MODEL_METHODS = ("draft", "auto")  # methods that run a draft model (its options: model, quantize, ...)
# A catch-up this short is part of drafting's rhythm (a step's accepted tokens, a suffix draft's
# run) and is paid without asking; longer ones (a prompt) are the cost policy's call.
CATCH_UP_FREE = 16
READ_PROBE_ROWS = 32  # rows of the pass that times a catch-up's cost per token
BATCH_PRIOR_ROWS = 16  # rows of a shared draft forward estimated before any is timed
# Kept and rejected pseudo-counts behind the acceptance a draft model expects before its first
# verdict: a draft of the target's own family is usually right (0.8; runs 9 and 10 measured
# 0.78-0.85 at the first position). It only decides when a catch-up pays; verdicts replace it.
DRAFT_PRIOR = (4.0, 1.0)
SECOND_CHOICE = 0.05  # the least draft probability of a second-choice leaf's path (greedy; above 1: none)


# Per draft decoder and target decoder: the reduced heads and first pass timings, by draft vocabulary size.
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Draft and target must agree token for token; say exactly where they differ."""
    t_rows, d_rows = target.decoder.cfg.vocab_size, draft.decoder.cfg.vocab_size
    if t_rows != d_rows:
        raise ForerunError(
            f"draft {draft.name} has {d_rows} vocabulary rows, target {target.name} has {t_rows}; "
            "speculation needs the same tokenizer: pick a draft of the same model family"
        )
    if target.tokenizer is None or draft.tokenizer is None:
        return
    _compare_tokenizers(target.tokenizer, draft.tokenizer, target.name, draft.name)


def _compare_tokenizers(t: Tokenizer, d: Tokenizer, t_name: str, d_name: str) -> None:
    tv, dv = t.vocabulary(), d.vocabulary()
    for i in sorted(set(tv) | set(dv)):
        if tv.get(i) != dv.get(i):
            raise ForerunError(
                f"draft and target tokenizers differ at id {i}: target {t_name} has {tv.get(i)!r}, "
                f"draft {d_name} has {dv.get(i)!r}; pick a draft with the target's tokenizer"
            )
    if t.stop_ids != d.stop_ids:
        raise ForerunError(
            f"draft and target stop tokens differ: target {sorted(t.stop_ids)}, draft {sorted(d.stop_ids)}"
        )


@register("draft")
class DraftModelDrafter:
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
    ) -> None:
        """`quantize` ("int8", "w8a8") stores the draft's products in that format (fewer bytes per
        draft token); `min_confidence` ends a draft early once the draft's top probability falls below
        it; `draft_vocab` N scores only the N tokens the target writes most (draft_vocab.py);
        `second_choice`: greedy drafts add the draft's second choice as a leaf where the draft's
        probability of its path is at least this and the leaf's row pays (above 1: chains only)."""
        if quantize not in (None, formats.AUTO):
            formats.get(quantize)
        if isinstance(model, LoadedModel):
            self.model = model
            if quantize:
                formats.quantize_(self.model.decoder, quantize)
        else:
            self.model = load_model(model, dtype, device or str(target.decoder.device), quantization=quantize)
        if _num_weights(self.model.decoder) > _num_weights(target.decoder):
            warnings.warn(
                f"draft {self.model.name} is larger than target {target.name}: "
                "speculation will likely be slower than plain decoding",
                stacklevel=2,
            )
        self.min_confidence = min_confidence
        self.second_choice = second_choice
        # What depends on the draft weights alone is made once per model and shared by every
        # drafter over it (a server has one per running sequence).
        self.shared = _SHARED.setdefault(self.model.decoder, weakref.WeakKeyDictionary()).setdefault(target.decoder, {})
        if not self.shared.get("same vocabulary"):
            check_same_vocabulary(target, self.model)
            self.shared["same vocabulary"] = True
        if ("head", draft_vocab) not in self.shared:
            vocab = draft_vocabulary(target, draft_vocab) if draft_vocab else None  # [N] token ids
            # The draft model keeps its full head; drafters with a reduced vocabulary score with its rows.
            self.shared["head", draft_vocab] = (
                vocab,
                reduced_head(self.model.decoder.lm_head, vocab) if vocab is not None else None,
            )
        self.vocab, self.head = self.shared["head", draft_vocab]
        self.draft_vocab = draft_vocab
        self.vocab_size = target.decoder.cfg.vocab_size
        self.cache: KVCache | None = None
        self.max_len = 0  # slots this request's cache needs
        self.fed: list[int] = []  # tokens whose keys/values sit in self.cache, in order
        self.token_seconds: float | None = None  # running mean time of a one-token draft forward
        self.read_seconds: float | None = None  # running mean time per token of a catch-up pass
        self.gate: Callable[[float, float | None, float], bool] | None = None  # see set_gate
        self.acceptance = Acceptance(*DRAFT_PRIOR)  # of its drafts, over every request of this drafter
        self.proposed = 0  # tokens in the proposal awaiting its verdict
        self.drafted = True  # this request drafted (a first request counts as having)
        self.admitted = False  # the gate agreed to a catch-up not made yet
        self.pass_cost: Callable[[int], float] | None = None  # the target's c(rows), for ending drafts early

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
        self.fed = []
        self.admitted = False
        if not self.drafted:
            self._age_evidence()
        self.drafted = False

    def _age_evidence(self) -> None:
        """After a request in which the draft model never drafted, its token cost moves halfway
        back to the timed figure. The gate admits a catch-up on it, and only drafting updates it:
        without ageing, one slow pass would shut the draft model out of every later request. (Its
        acceptance does not age: it is what keeps a draft model that is usually wrong on this
        traffic from being tried again on every short answer.)"""
        timed = self.shared.get(("timed", self.draft_vocab))
        if timed is not None and self.token_seconds is not None:
            self.token_seconds = (self.token_seconds + timed[1]) / 2

    def max_rows(self, k: int) -> int:
        """A chain of k, and under greedy up to k second-choice leaves beside it."""
        return 2 * k if self.second_choice <= 1 else k

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> DraftTree | None:
        return run_alone(self.propose_steps(context, k, params, generator))

    def propose_steps(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> DraftSteps:
        """`propose` as draft forwards yielded one by one (passes.py: a batch runs several
        sequences' forwards as one)."""
        if self.cache is None:
            self.cache = self.model.decoder.new_cache(self.max_len)
        cache = self.cache
        # Roll back to what the context still agrees with (drops rejected drafts), then catch up.
        keep = min(_common_prefix(self.fed, context), len(context) - 1)
        cache.truncate(keep)
        self.fed = self.fed[:keep]
        pending = context[keep:]
        # The root is read on every proposal; only what lies before it is catch-up.
        admitted, self.admitted = self.admitted, False
        if (
            self.gate is not None
            and len(pending) - 1 > CATCH_UP_FREE
            and not admitted
            and not self.gate(self.catch_up_seconds(len(pending) - 1), self.cost_per_token(), self.acceptance.alpha)
        ):
            return None
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        leaves: list[tuple[int, int]] = []  # (depth index, token): second choices beside the chain
        kept_chance = 1.0  # the draft's probability of its whole draft so far
        self.drafted = True
        for _ in range(k):
            step = DraftPass(self.model.decoder, cache, pending, len(self.fed), self.head)
            logits = yield step  # [1, N]
            self._time_pass(step)
            self.fed += pending
            confidence = logits.softmax(-1)[0]  # [N]
            if params.greedy:
                best = confidence.topk(min(2, confidence.shape[0]))
                choice = int(best.indices[0])
                if len(best.values) > 1 and self._leaf_pays(
                    kept_chance * float(best.values[1]), len(tokens) + len(leaves) + 1
                ):
                    leaves.append((len(tokens), self._token(int(best.indices[1]))))
            else:
                q = probabilities(logits, params)  # [1, N]
                choice = int(sample(q, generator)[0])
                probs.append(self._full_vocabulary(q[0]))
            token = self._token(choice)
            tokens.append(token)
            pending = [token]
            kept_chance *= float(confidence[choice])
            if self.min_confidence and float(confidence.max()) < self.min_confidence:
                break
            if len(tokens) < k and not self._worth_another(len(tokens), kept_chance, step):
                break
        self.proposed = len(tokens)
        if leaves:
            # A leaf beside the chain's token at depth index d hangs from that token's parent.
            return DraftTree(
                tokens + [t for _, t in leaves], list(range(-1, len(tokens) - 1)) + [d - 1 for d, _ in leaves]
            )
        return DraftTree.chain(tokens, None if params.greedy else torch.stack(probs))

    def _token(self, choice: int) -> int:
        """The target's token id of column `choice` of the draft's head."""
        return choice if self.vocab is None else int(self.vocab[choice])

    def set_pass_cost(self, pass_cost: Callable[[int], float]) -> None:
        self.pass_cost = pass_cost

    def _worth_another(self, drafted: int, kept_chance: float, last: DraftPass) -> bool:
        """Whether a token after `drafted` ones, all kept with probability `kept_chance`, pays for
        its draft forward and its verified row (True when the costs are not known). A forward
        shared like `last` by several sequences costs each its share."""
        if self.pass_cost is None:
            return True
        token_cost = self.token_seconds if last.shared == 1 else self.batch_pass_seconds(last.shared) / last.shared
        return token_cost is None or self._saves(kept_chance, token_cost, drafted + 1)

    def _leaf_pays(self, chance: float, rows: int) -> bool:
        """Whether a second-choice leaf the target keeps with probability about `chance` (the
        draft's own probability of its path) pays for one more verified row beside `rows`: at least
        `second_choice`, and, with the target's costs known, a pass saved that often outweighs the row."""
        return chance >= self.second_choice and (self.pass_cost is None or self._saves(chance, 0.0, rows))

    def _saves(self, chance: float, seconds: float, rows: int) -> bool:
        """Whether a verified row beside `rows` others, kept with probability `chance`, saves more
        (a target pass that often) than it costs (`seconds` to draft it, and the row)."""
        return chance * self.pass_cost(1) > seconds + self.pass_cost(rows + 1) - self.pass_cost(rows)

    def ready(self, context: list[int]) -> bool:
        """Whether a proposal after `context` would draft: its catch-up is free, or the gate pays
        for it now (asked here once per step; the proposal that follows does not ask again)."""
        skipped = len(context) - 1 - min(_common_prefix(self.fed, context), len(context) - 1)
        if self.gate is None or skipped <= CATCH_UP_FREE or self.admitted:
            return True  # admitted before and not proposed since (the step went plain): still paid for
        self.admitted = self.gate(self.catch_up_seconds(skipped), self.cost_per_token(), self.acceptance.alpha)
        return self.admitted

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        # The cache needs nothing: the next propose() rolls back by comparing contexts.
        if self.proposed:
            self.acceptance.observe(num_accepted, 1 if num_accepted < self.proposed else 0)
            self.proposed = 0

    def cost_per_token(self) -> float | None:
        """What one more draft token costs (a one-token forward), catching up on skipped tokens
        left out: the cost model's c_draft. None before one is timed."""
        return self.token_seconds

    def set_gate(self, gate: Callable[[float, float | None, float], bool]) -> None:
        """Before a catch-up longer than CATCH_UP_FREE tokens, ask `gate` with its estimated
        seconds, the cost of a draft token and the share of draft tokens kept so far; False
        declines the proposal. Times the draft model
        now (under a second), so the first estimates fall at load time, not in a request."""
        self.gate = gate
        if self.read_seconds is None or self.token_seconds is None:
            timed = self.shared.get(("timed", self.draft_vocab))
            read, token = timed if timed is not None else self._time_passes()
            self.shared["timed", self.draft_vocab] = (read, token)
            self.read_seconds = self.read_seconds or read
            self.token_seconds = self.token_seconds or token

    def catch_up_seconds(self, tokens: int) -> float:
        """Estimated time to read `tokens` skipped tokens, from the catch-up passes timed so far."""
        if self.read_seconds is None:
            self.read_seconds = self._time_passes()[0]
        return tokens * self.read_seconds

    def _time_passes(self) -> tuple[float, float]:
        """(seconds per token of a catch-up pass, seconds of a one-token pass), the fastest of a few."""
        decoder = self.model.decoder
        rows = min(READ_PROBE_ROWS, decoder.cfg.max_position - 1)
        cache = decoder.new_cache(rows + 1)
        ids = torch.zeros(rows + 1, dtype=torch.long, device=decoder.device)
        pos = torch.arange(rows + 1, device=decoder.device)
        best = {rows: float("inf"), 1: float("inf")}
        with torch.inference_mode():
            for _ in range(3):
                for n, first in ((rows, 0), (1, rows)):
                    cache.truncate(first)
                    start = time.perf_counter()
                    with linear.prefill() if n > 1 else nullcontext():
                        decoder(
                            ids[first : first + n],
                            pos[first : first + n],
                            cache,
                            layout=RowLayout.chain(first, n),
                            last_only=True,
                            head=self.head,
                        )
                    best[n] = min(best[n], time.perf_counter() - start)
        return best[rows] / rows, best[1]

    def _time_pass(self, step: DraftPass) -> None:
        """Learn from a timed forward: a pass alone times this drafter's token or catch-up cost; a
        forward shared with other sequences times the batched draft (`batch_pass_seconds`)."""
        rows = len(step.tokens)
        if step.shared > 1:
            if step.lead:
                self._batch_costs().observe(step.rows, step.seconds * step.shared)
        elif rows == 1:
            # One stalled pass (the machine is shared) counts as at most twice the running figure.
            previous = self.token_seconds
            self.token_seconds = (
                step.seconds if previous is None else 0.8 * previous + 0.2 * min(step.seconds, 2 * previous)
            )
        elif rows >= 8:  # long enough that the per-row cost dominates
            per_row, previous = step.seconds / rows, self.read_seconds
            self.read_seconds = per_row if previous is None else 0.8 * previous + 0.2 * per_row

    def batch_pass_seconds(self, sequences: int) -> float:
        """Seconds of one draft forward shared by `sequences` sequences drafting a token each: as
        measured in a batch, else estimated from a one-token forward and the per-row cost of a
        catch-up (the kernel's rows are nearly free until they are not)."""
        return self._batch_costs()(sequences)

    def _batch_costs(self) -> PassCosts:
        costs = self.shared.get(("batch passes", self.draft_vocab))
        if costs is None:
            read, token = self.read_seconds, self.token_seconds
            if read is None or token is None:
                timed_read, timed_token = self._time_passes()
                read, token = read or timed_read, token or timed_token
            costs = PassCosts([max(token, rows * read) for rows in range(1, BATCH_PRIOR_ROWS + 1)], learn=True)
            self.shared["batch passes", self.draft_vocab] = costs
        return costs

    def _full_vocabulary(self, q: torch.Tensor) -> torch.Tensor:
        """q over the draft vocabulary [N] as a distribution over every token [V] (0 outside it)."""
        if self.vocab is None:
            return q
        return torch.zeros(self.vocab_size, dtype=q.dtype, device=q.device).index_copy_(0, self.vocab.to(q.device), q)


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
