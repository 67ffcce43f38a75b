"""Suffix drafting, in the manner of SuffixDecoding: propose the most frequent continuation of the
longest match of the context's end, from the prompt, this request's output, what the request says
its answer will be like, and earlier outputs.

Three indexes, each a suffix trie cut at `depth` tokens: every node is a string that occurred, with
how often it occurred (`count`) and when last (`last`). The request's trie holds its prompt and its
output so far, kept up to date with the tokens that arrived since the last call; the prediction's
holds the text the request expects (`expect`: OpenAI's predicted output, empty without one); the
memory's trie holds the outputs of earlier requests (the most recent `max_global_tokens`), each
added when its request ends. A memory may be shared by several drafters: every lane of a server drafts from what
any earlier request answered, not only the ones that ran on its lane (LLM.new_engine shares it).

A proposal: find the longest suffix of the context, from `max_match` tokens down to `min_match`,
that occurred before with something after it (in any trie; the request's wins a tie, then the
prediction's). Then walk
down, each time to the child seen most often (the most recent on a tie), while the product of the
children's shares stays at least `min_prob`. When the walk leaves the trie's depth it matches again
on the context plus the draft so far. If at some node the runner-up child was seen at least
`branch_ratio` times as often as the best, the runner-up starts a second branch, walked the same
way: a two-branch tree, the likelier branch first (the acceptance rule tries siblings in order).

The draft is deterministic, so it is verified as one-hot: exact for greedy and sampling alike (and
a seeded request writes plain decoding's text, `accept.accept_one_hot`).

Cost: appending a token touches one node per depth (`depth` dictionary steps); a proposal walks at
most `max_match` suffixes of at most `max_match` tokens plus the draft: tens of microseconds. The
tries take memory in proportion to tokens × depth: about 16 nodes, ~4 kB, per token (a 4k-token
prompt ~16 MB; the memory's trie is bounded by `max_global_tokens`).

Where it wins: output that repeats its prompt or earlier outputs (code edits, retrieval answers,
summaries quoting their input, the same question asked again, loops). Where it loses: new prose,
where it proposes nothing (a plain step) or a short wrong match that one verification rejects.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters import register
from forerun.drafters.base import Drafter
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel
from forerun.verification.sampling import Draws
from forerun.verification.tree import DraftTree


class SuffixTrie:
    """Every substring of up to `depth` tokens of the indexed texts, with counts; node 0 is the root."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.kids: list[dict[int, int]] = [{}]  # node -> {token: child node}
        self.count: list[int] = [0]  # times the node's string occurred
        self.last: list[int] = [0]  # when it last occurred (a global clock)
        self.clock = 0
        self.size = 0  # tokens indexed
        self._open: list[int] = []  # nodes of the current text's suffixes shorter than depth

    def begin_text(self) -> None:
        """The next tokens start a new text: no string spans the boundary."""
        self._open = []

    def append(self, token: int) -> None:
        """Index `token` at the end of the current text: every suffix ending there gains one."""
        self.clock += 1
        self.size += 1
        kids, count, last = self.kids, self.count, self.last
        grown = []
        for node in [0] + self._open:
            child = kids[node].get(token)
            if child is None:
                child = len(count)
                kids[node][token] = child
                kids.append({})
                count.append(0)
                last.append(0)
            count[child] += 1
            last[child] = self.clock
            grown.append(child)
        # A suffix that reached `depth` tokens stops growing.
        self._open = grown[: self.depth - 1] if len(grown) >= self.depth else grown

    def walk(self, tokens: list[int]) -> int | None:
        """The node of string `tokens`, or None when it never occurred."""
        node = 0
        for t in tokens:
            node = self.kids[node].get(t)
            if node is None:
                return None
        return node

    def ranked(self, node: int) -> list[tuple[int, int]]:
        """(token, child) of `node`, most frequent first, the most recent first on a tie."""
        return sorted(self.kids[node].items(), key=lambda kv: (self.count[kv[1]], self.last[kv[1]]), reverse=True)


class SuffixMemory:
    """Earlier requests' outputs, the most recent `max_tokens` of them, indexed in one trie."""

    def __init__(self, depth: int, max_tokens: int) -> None:
        self.depth, self.max_tokens = depth, max_tokens
        self.outputs: list[list[int]] = []  # oldest first
        self.size = 0  # tokens in them
        self.trie = SuffixTrie(depth)

    def remember(self, output: list[int]) -> None:
        """Add one output, dropping the oldest (down to half the bound) when past the bound."""
        if not output:
            return
        self.outputs.append(list(output[-self.max_tokens :]))
        self.size += len(self.outputs[-1])
        if self.size > self.max_tokens:
            while self.size > self.max_tokens // 2:
                self.size -= len(self.outputs.pop(0))
            self.trie = SuffixTrie(self.depth)
            for text in self.outputs:
                self._index(text)
        else:
            self._index(self.outputs[-1])

    def outputs_held(self) -> list[list[int]]:
        """The outputs remembered now (a copy), for `restore`."""
        return [list(output) for output in self.outputs]

    def restore(self, outputs: list[list[int]]) -> None:
        """Remember exactly `outputs` again, in place (the drafters that share this memory keep it):
        a bench repeating a prompt lets no round draft from an earlier round's answer."""
        self.outputs = [list(output) for output in outputs]
        self.size = sum(len(output) for output in self.outputs)
        self.trie = SuffixTrie(self.depth)
        for text in self.outputs:
            self._index(text)

    def _index(self, text: list[int]) -> None:
        self.trie.begin_text()
        for t in text:
            self.trie.append(t)


@register(
    "suffix",
    cli_options={
        "suffix_max_match": "max_match",
        "suffix_min_match": "min_match",
        "suffix_min_prob": "min_prob",
        "suffix_branch_ratio": "branch_ratio",
    },
)
class SuffixDrafter(Drafter):
    stateless = True  # a proposal leaves nothing behind: the engine may propose without verifying

    def __init__(
        self,
        target: LoadedModel | None = None,
        max_match: int = 12,
        min_match: int = 2,
        depth: int = 16,
        min_prob: float = 0.1,
        branch_ratio: float = 0.5,
        max_global_tokens: int = 8192,
        memory: SuffixMemory | None = None,
    ) -> None:
        """`max_match` / `min_match`: the longest and shortest context suffix looked up (tokens);
        `depth`: the tries' depth; `min_prob`: stop the draft when the walked children's shares
        multiply below this; `branch_ratio`: a runner-up seen this share as often as the best child
        starts a second branch (above 1: never); `max_global_tokens`: earlier outputs remembered;
        `memory`: one shared with other drafters (else one of its own)."""
        if min_match < 1:
            raise ForerunError(f"--suffix-min-match must be at least 1, got {min_match}")
        if max_match < min_match:
            raise ForerunError(f"--suffix-max-match ({max_match}) must be at least --suffix-min-match ({min_match})")
        if depth <= max_match:
            raise ForerunError(
                f"--suffix-max-match {max_match} is too long for the suffix trie's depth of {depth}: "
                f"use at most {depth - 1}"
            )
        if not 0 <= min_prob <= 1:
            raise ForerunError(f"--suffix-min-prob must be in [0, 1], got {min_prob}")
        self.max_match, self.min_match, self.depth = max_match, min_match, depth
        self.min_prob, self.branch_ratio = min_prob, branch_ratio
        if memory is not None and memory.depth != depth:
            raise ForerunError(
                f"a shared suffix memory of depth {memory.depth} cannot serve a drafter of depth {depth}"
            )
        self.memory = memory if memory is not None else SuffixMemory(depth, max_global_tokens)
        self.local = SuffixTrie(depth)
        self.tokens: list[int] = []  # what the request's trie holds
        self.predicted = SuffixTrie(depth)  # the request's prediction (`expect`)

    def max_rows(self, k: int) -> int:
        return 2 * k  # a main branch and one more of at most k

    def start(self, prompt_ids: list[int], target_cache: KVCache | None, max_len: int) -> None:
        """A new request: the request's trie starts over."""
        self.local, self.tokens = SuffixTrie(self.depth), []
        self._extend(list(prompt_ids))

    def expect(self, tokens: list[int]) -> None:
        """The request's prediction: its own trie, drafted from as the prompt's is."""
        self.predicted = SuffixTrie(self.depth)
        self.predicted.begin_text()
        for t in tokens:
            self.predicted.append(t)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: Draws) -> DraftTree | None:
        return self.propose_with_match(context, k, params, generator)[0]

    def propose_with_match(
        self,
        context: list[int],
        k: int,
        params: SamplingParams | None = None,
        generator: Draws = None,
        ahead: Sequence[int] = (),
    ) -> tuple[DraftTree | None, int]:
        """(the proposal or None, the length in tokens of the context suffix it continues; 0: none).
        `ahead`: tokens sure to follow the context (a grammar's forced ones), matched with it but
        not remembered as the request's text (they are not output yet): the proposal follows them."""
        self._extend(context)
        context = [*context, *ahead]
        found = self._match(context)
        if found is None or k < 1:
            return None, 0
        trie, node, length = found
        main, fork = self._walk(context, trie, node, k, branch=True)
        if not main:
            return None, 0
        branches = [main]
        if fork is not None:
            at, fork_trie, token, child = fork
            rest, _ = self._walk(context + main[:at] + [token], fork_trie, child, k - at - 1, branch=False)
            branches.append(main[:at] + [token] + rest)
        return DraftTree.trie(branches), length

    def match_length(self, context: list[int]) -> int:
        """Tokens of the longest context suffix seen before with a follower (0: none)."""
        self._extend(context)
        found = self._match(context)
        return found[2] if found is not None else 0

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        pass  # accepted tokens arrive with the next context

    def end(self, output_ids: list[int]) -> None:
        """The request ended with `output_ids`: they join the memory for the requests after it."""
        self.memory.remember(output_ids)

    # -- internals ----------------------------------------------------------------------------------

    def _extend(self, context: list[int]) -> None:
        """Catch the request's trie up with `context`; a context that does not continue what it
        holds (a new text) rebuilds it."""
        n = len(self.tokens)
        if len(context) < n or context[:n] != self.tokens:
            self.local, self.tokens = SuffixTrie(self.depth), []
            n = 0
        for t in context[n:]:
            self.local.append(t)
        self.tokens.extend(context[n:])

    def _match(self, tokens: list[int]) -> tuple[SuffixTrie, int, int] | None:
        """(trie, node, length) of the longest suffix of `tokens` that occurred with a follower."""
        for length in range(min(self.max_match, len(tokens)), self.min_match - 1, -1):
            suffix = tokens[len(tokens) - length :]
            for trie in (self.local, self.predicted, self.memory.trie):
                node = trie.walk(suffix)
                if node is not None and trie.kids[node]:
                    return trie, node, length
        return None

    def _walk(
        self, context: list[int], trie: SuffixTrie, node: int, k: int, branch: bool
    ) -> tuple[list[int], tuple[int, SuffixTrie, int, int] | None]:
        """Up to k tokens down the most frequent children from `node`, matching again past the
        trie's depth; with `branch`, also where a second branch starts: (index in the draft, its
        trie, its first token and node)."""
        draft: list[int] = []
        fork = None
        prob = 1.0
        while len(draft) < k:
            ranked = trie.ranked(node)
            if not ranked:
                found = self._match(context + draft)
                if found is None:
                    break
                trie, node, _ = found
                continue
            (token, child), total = ranked[0], sum(trie.count[c] for _, c in ranked)
            prob *= trie.count[child] / total
            if prob < self.min_prob and draft:
                break
            if (
                branch
                and fork is None
                and len(ranked) > 1
                and trie.count[ranked[1][1]] >= self.branch_ratio * trie.count[child]
            ):
                fork = (len(draft), trie, *ranked[1])
            draft.append(token)
            node = child
        if fork is not None and fork[0] >= len(draft):
            fork = None
        return draft, fork
