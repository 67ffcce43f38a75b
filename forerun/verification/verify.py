"""One target forward over the root and every draft node; the target's distribution at each row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from forerun import native
from forerun.base.config import SamplingParams
from forerun.models.attention import RowLayout, Segment
from forerun.models.decoder import Decoder
from forerun.models.kv_cache import KVCache
from forerun.verification.grammar import Grammar
from forerun.verification.sampling import adjusted, one_hot, probabilities
from forerun.verification.tree import DraftTree


@dataclass
class Verification:
    hidden: torch.Tensor  # [N+1, hidden] final hidden state of each row (for feature-level drafters)
    aux_logits: torch.Tensor | None = None  # [A, vocab] raw target logits of the tree's aux rows, if any
    # [N+1, vocab] raw target logits of the root and each node (a view of the pass's), only for a
    # request that asks for log probabilities: the engine scores the rows it emits from.
    logits: torch.Tensor | None = None
    # Greedy: the target's argmax after the root and each node [N+1], all the rule needs (a step's
    # one-hot rows, [N+1, vocab], cost more to write than the rest of its bookkeeping).
    best: list[int] | None = None
    dense: torch.Tensor | None = None  # `probs`: given when sampling, made from `best` under greedy when asked
    vocab_size: int = 0

    @property
    def probs(self) -> torch.Tensor:
        """[N+1, vocab] processed target distribution after the root (row 0) and each node; under
        greedy the one-hot rows of `best`, made when first asked for."""
        if self.dense is None:
            self.dense = one_hot(torch.tensor(self.best, device=self.hidden.device), self.vocab_size)
        return self.dense


@dataclass
class Past:
    """What a sequence has read and written before a verification: the prompt, and the tokens
    generated so far (the root last). Only the requests whose logits are `adjusted` need it."""

    prompt: Sequence[int]
    output: Sequence[int]
    stop_ids: Sequence[int] = ()  # held off while fewer than min_tokens are out
    grammar: Grammar | None = None  # a structured output's, at `output`

    @staticmethod
    def paths(tree: DraftTree) -> list[list[int]]:
        """What each verification row's history holds beyond the output: nothing for the root's,
        each node's path down to it (itself included) for the node's."""
        return [[]] + [[tree.tokens[j] for j in tree.path_to(i)] for i in range(len(tree))]


def target_rows(
    logits: torch.Tensor,
    params: SamplingParams,
    best: torch.Tensor | None = None,
    past: Past | None = None,
    tree: DraftTree | None = None,
) -> dict:
    """A Verification's distribution fields for logits [N+1, vocab] (the root's and `tree`'s nodes'):
    the argmax under greedy (`best` when the caller has it already), else the processed
    probabilities; both from the logits `adjusted` by the request's bias and penalties (`past`)."""
    if params.adjusts:
        if past is None:
            raise ValueError("a request with a logit bias or penalties is verified with its past")
        paths = Past.paths(tree or DraftTree([], []))
        logits = adjusted(logits, params, past.output, paths, past.prompt, past.stop_ids, past.grammar)
        best = None
    if params.greedy:
        ids = native.argmax(logits.float()) if best is None else best
        return {"best": ids.tolist(), "vocab_size": logits.shape[-1]}
    return {"dense": probabilities(logits, params)}


def verify(
    target: Decoder,
    cache: KVCache,
    root: int,
    tree: DraftTree | None,
    params: SamplingParams,
    past: Past | None = None,
) -> Verification:
    """Feed the root (last accepted token, at slot and position cache.length), the tree's nodes,
    then its aux rows.

    The root and every node are computed row-exactly (each comes out as it would alone, so greedy
    speculation equals plain decoding); aux rows see what the tree's mask allows. Slots past the
    accepted path (aux rows included) are left for the caller to drop with cache.keep /
    cache.truncate. `past`: the sequence's, where its logits are adjusted (`target_rows`).
    """
    tree = tree if tree is not None else DraftTree([], [])
    # [R] rows: the root, the nodes, the aux rows; their positions are the layout's
    out = target.forward_layout([root] + tree.tokens + tree.aux_tokens, cache, row_layout(tree, cache.length))
    n = len(tree) + 1
    logits = out.logits[0]  # [R, vocab]
    return Verification(
        **target_rows(logits[:n], params, None, past, tree),
        hidden=out.hidden[0, :n],
        aux_logits=logits[n:] if tree.aux_tokens else None,
        logits=logits[:n] if params.logprobs is not None else None,
    )


@dataclass
class VerifyJob:
    """One sequence's part of a verification over several sequences."""

    cache: KVCache
    root: int
    tree: DraftTree | None
    params: SamplingParams
    past: Past | None = None  # where the request's logits are adjusted


@dataclass
class PromptRows:
    """A prompt's next rows carried in a verification pass (chunked prefill): `tokens` at slots and
    positions cache.length, ... of its own cache; the pass sets `logits`, its last row's [1, vocab]."""

    tokens: torch.Tensor  # [n]
    cache: KVCache
    logits: torch.Tensor | None = None


def verify_many(target: Decoder, jobs: list[VerifyJob], prompts: Sequence[PromptRows] = ()) -> list[Verification]:
    """`verify` for several sequences in one target forward (continuous batching): each job's rows
    run on its own cache and come out exactly as in a `verify` of that job alone. Each of `prompts`
    goes after them, its rows a chain on its own cache, only its last one scored (the caller makes
    sure the target's rows are exact whatever runs beside them, as in its native layers)."""
    tokens: list[int] = []
    positions: list[torch.Tensor] = []
    segments: list[Segment] = []
    trees = [job.tree if job.tree is not None else DraftTree([], []) for job in jobs]
    for job, tree in zip(jobs, trees):
        start = job.cache.length
        rows = [job.root] + tree.tokens + tree.aux_tokens
        segments.append(Segment(len(tokens), len(tokens) + len(rows), job.cache, row_layout(tree, start)))
        tokens += rows
        positions.append(tree.positions(start))
    for prompt in prompts:
        n, start = len(prompt.tokens), prompt.cache.length
        segments.append(Segment(len(tokens), len(tokens) + n, prompt.cache, RowLayout.chain(start, n), True))
        tokens += prompt.tokens.tolist()
        positions.append(torch.arange(start, start + n))
    device = target.device
    out = target(
        torch.tensor(tokens, device=device),
        torch.cat(positions).to(device),
        None,
        segments=segments,
        output_hidden=True,
    )
    logits, hidden = out.logits[0], out.hidden[0]  # [R, vocab], [R, hidden]
    for i, prompt in enumerate(prompts):  # the last rows: one a prompt
        prompt.logits = logits[len(logits) - len(prompts) + i :][:1]
    # Greedy sequences' argmax in one go over the pass, not one call per sequence.
    best = native.argmax(logits.float()) if sum(job.params.greedy for job in jobs) > 1 else None
    results = []
    for job, tree, seg in zip(jobs, trees, segments):
        n = len(tree) + 1
        rows = logits[seg.start : seg.stop]
        ours = best[seg.start : seg.start + n] if best is not None and job.params.greedy else None
        results.append(
            Verification(
                **target_rows(rows[:n], job.params, ours, job.past, tree),
                hidden=hidden[seg.start : seg.start + n],
                aux_logits=rows[n:] if tree.aux_tokens else None,
                logits=rows[:n] if job.params.logprobs is not None else None,
            )
        )
    return results


def row_layout(tree: DraftTree, start: int) -> RowLayout:
    """The root at slot `start`, node i at slot start + 1 + i, aux rows after the nodes."""
    n = len(tree) + 1
    leaves = [i for i in range(len(tree)) if not tree.children(i)]
    paths = [[0] + [1 + node for node in tree.path_to(leaf)] for leaf in leaves] or [[0]]
    layout = RowLayout.from_paths(start, paths, n)
    if tree.aux_tokens:
        visible = tree.attention_mask(start)[n:]  # [A, start+R]
        layout.add_masked_rows(list(range(n, n + len(tree.aux_tokens))), [start + o for o in tree.aux_offsets], visible)
    return layout
