"""Prompt lookup: propose what followed the last time the context's current suffix appeared, and
what followed the first time when that differs.

The suffix of the context (prompt and accepted output) of length n, from `ngram_max` down to
`ngram_min`, is looked up among earlier n-grams; the longest length that matches wins. The tokens
that followed its most recent occurrence (continuing into the proposal itself when the match is
near the end, so a repeating pattern keeps repeating) are the draft, up to K. When the earliest
occurrence was followed by something else, that continuation becomes a second branch: a tree whose
first branch is the most recent one (text tends to continue as it did lately; the acceptance rule
tries siblings in order), sharing their common prefix.

The draft is deterministic, so it goes to the acceptance rule as one-hot: under sampling x is kept
when it equals the target's own draw at its position (`accept.accept_one_hot`), with probability
p_target(x). That is exact for sampling as well as greedy, and a seeded request writes the text
plain decoding writes.

Cost: an index from every n-gram to the positions after its earliest and latest occurrences,
extended by the tokens that arrived since the last call; a proposal is a few dictionary look-ups,
no model call. A second branch adds up to K verifier rows.

Where it loses: text that does not repeat its context (open-ended prose, creative sampling) finds
no match or a wrong one, so steps fall back to one token or pay a verification of rejected tokens.
It shines on code edits, retrieval answers and summaries that quote their input, and on loops.
"""

from __future__ import annotations

import torch

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters import register
from forerun.drafters.base import Drafter
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel
from forerun.verification.sampling import Draws
from forerun.verification.tree import DraftTree


class NgramIndex:
    """n-gram (n in [n_min, n_max]) -> index of the token right after its latest occurrence (and,
    in `first`, after its earliest).

    Only occurrences with a follower are indexed, so the context's own suffix never matches itself.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.follower: dict[tuple[int, ...], int] = {}
        self.first: dict[tuple[int, ...], int] = {}

    def extend(self, context: list[int]) -> None:
        """Catch up with `context`, which extends the tokens seen so far."""
        if len(context) < len(self.tokens) or (self.tokens and context[len(self.tokens) - 1] != self.tokens[-1]):
            self.tokens, self.follower, self.first = [], {}, {}  # not a continuation: a new text, start over
        old = len(self.tokens)
        self.tokens.extend(context[old:])
        toks = self.tokens
        # n-grams ending at position `end` gain a follower once token end+1 exists.
        for end in range(max(old - 1, 0), len(toks) - 1):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                gram = tuple(toks[end - n + 1 : end + 1])
                self.follower[gram] = end + 1
                self.first.setdefault(gram, end + 1)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest matching suffix's latest occurrence; [] when
        nothing matches."""
        drafts = self.lookup_both(k)
        return drafts[0] if drafts else []

    def lookup_both(self, k: int) -> list[list[int]]:
        """The continuations of the longest matching suffix's latest and (when it differs) earliest
        occurrence, up to k tokens each; [] when nothing matches."""
        toks = self.tokens
        for n in range(min(self.n_max, len(toks)), self.n_min - 1, -1):
            gram = tuple(toks[len(toks) - n :])
            at = self.follower.get(gram)
            if at is not None:
                latest, earliest = self._continuation(at, k), self._continuation(self.first[gram], k)
                return [latest] if earliest == latest else [latest, earliest]
        return []

    def _continuation(self, at: int, k: int) -> list[int]:
        toks = self.tokens
        draft: list[int] = []
        for i in range(at, at + k):
            draft.append(toks[i] if i < len(toks) else draft[i - len(toks)])
        return draft


@register("ngram", cli_options={"ngram_max": "ngram_max", "ngram_min": "ngram_min"})
class NgramDrafter(Drafter):
    stateless = True  # a proposal leaves nothing behind: the engine may propose without verifying

    def __init__(self, target: LoadedModel | None, ngram_max: int = 3, ngram_min: int = 1) -> None:
        if ngram_min < 1:
            raise ForerunError(f"--ngram-min must be at least 1, got {ngram_min}")
        if ngram_max < ngram_min:
            raise ForerunError(f"--ngram-max ({ngram_max}) must be at least --ngram-min ({ngram_min})")
        self.index = NgramIndex(ngram_min, ngram_max)

    def max_rows(self, k: int) -> int:
        return 2 * k  # the latest continuation and the earliest

    def start(self, prompt_ids: list[int], target_cache: KVCache, max_len: int) -> None:
        self.index = NgramIndex(self.index.n_min, self.index.n_max)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: Draws) -> DraftTree | None:
        self.index.extend(context)
        drafts = self.index.lookup_both(k)
        return DraftTree.trie(drafts) if drafts else None

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        pass  # accepted tokens arrive with the next context
