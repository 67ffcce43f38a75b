"""An EAGLE head drafts at the feature level, with a tree that grows where it is confident (EAGLE-2).

The head (forerun/heads/eagle.py) reads (embedding of x_{j+1}, the target's feature f_j) at
position j and predicts f_{j+1}. Each proposal first catches up on the pairs whose features the
target has computed since the last one (the prompt at first, then the root and the accepted path),
in one pass of its single layer; its last output is the predicted feature at the root, whose
projection scores the root's children. Then, depth by depth:

- greedy: the `branch` nodes with the highest path confidence (the product of the head's
  probabilities along the path) are expanded in one pass each, every one by its `branch` best
  tokens; at the end all nodes are ranked by confidence and the best n are kept, n chosen for the
  most expected tokens per second: (1 + Σ confidence of the n) / (c(1 + n) + depth · c_head), with
  c the target's measured pass costs (so a CPU keeps small trees and a GPU wide ones);
- sampling: a chain, each token drawn from the head's distribution q, so the exact rule applies.

A node's row attends to the head's cache of true pairs and to its own ancestors' rows only.

Cost: one layer and one projection over the draft vocabulary per depth, a few milliseconds for a
1.5B target. Where it loses: a head trained on little data guesses well only on text like its
training text.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.drafters import register
from forerun.drafters.base import Drafter
from forerun.drafters.vocabulary import full_vocabulary
from forerun.heads import shared_head
from forerun.models.kv_cache import KVCache
from forerun.models.load import LoadedModel
from forerun.verification.sampling import Draws, draw_tokens, probabilities
from forerun.verification.tree import DraftTree

DEFAULT_NODES = 16  # the most tree nodes a step verifies
DEFAULT_BRANCH = 4  # nodes expanded per depth, children per expanded node


@register("eagle", cli_options={"speculative_head": "head", "eagle_nodes": "nodes", "eagle_branch": "branch"})
class EagleDrafter(Drafter):
    reads_features = True

    def __init__(
        self, target: LoadedModel, head: str | None = None, nodes: int = DEFAULT_NODES, branch: int = DEFAULT_BRANCH
    ) -> None:
        if head is None:
            raise ForerunError(
                "--speculative-method eagle needs --speculative-head DIR (train one with "
                "`forerun train --method eagle`)"
            )
        if nodes < 1 or branch < 1:
            raise ForerunError(f"EAGLE's tree needs at least one node and one branch, got {nodes} and {branch}")
        context = target.decoder.cfg.max_position
        if nodes >= context:
            raise ForerunError(
                f"--eagle-nodes {nodes} verifies more rows a step than the model's context of {context} tokens "
                f"holds; use fewer (the default is {DEFAULT_NODES})"
            )
        if branch > nodes:
            raise ForerunError(
                f"--eagle-branch {branch} is more than --eagle-nodes {nodes}: a step keeps {nodes} nodes at most, "
                "so no node keeps more children than that; use at most as many branches as nodes"
            )
        self.config, self.head = shared_head(head, target, "eagle")
        self.vocab = self.head.vocab  # [N] token ids
        self.vocab_size = target.decoder.cfg.vocab_size
        self.embed = target.decoder.embed_tokens
        self.nodes, self.branch = nodes, branch
        self.pass_cost: Callable[[int], float] | None = None  # c(r), from the engine's policy
        self.head_seconds: float | None = None  # running mean of one expansion pass
        self.cache = None
        self.known: list[torch.Tensor] = []  # target features, [n_i, hidden] each
        self.num_known = 0
        self.fed = 0  # true pairs in the head's cache

    def max_rows(self, k: int) -> int:
        return self.nodes

    def set_pass_cost(self, pass_cost: Callable[[int], float]) -> None:
        self.pass_cost = pass_cost

    def start(self, prompt_ids: list[int], target_cache: KVCache, max_len: int) -> None:
        # A step's expansion rows sit after the true pairs: room for every depth's branch rows.
        # The head's device: the embedding's `weight` may be a whole quantized table dequantized.
        self.cache = self.head.new_cache(max_len + self.nodes * self.branch + 1, self.vocab.device)
        self.known, self.num_known, self.fed = [], 0, 0

    def features(self, hidden: torch.Tensor) -> None:
        """The target's hidden states [n, hidden] of the rows its cache just kept, in order."""
        self.known.append(hidden.float())
        self.num_known += hidden.shape[0]

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: Draws) -> DraftTree | None:
        n = self.num_known
        if n != len(context) - 1 or n == 0:
            return None  # features out of step with the text: nothing to draft from
        root_feature = self._catch_up(context)  # [hidden]
        if params.greedy:
            return self._greedy_tree(root_feature, k)
        return self._sampled_chain(root_feature, k, params, generator)

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        pass

    # --- stages -----------------------------------------------------------------------------------

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """Feed the true pairs (embed(x_{j+1}), f_j) for j in [fed, n); returns f̂ at the root."""
        features = torch.cat(self.known)  # [n, hidden]
        self.known = [features]
        n, start = self.num_known, self.fed
        self.cache.length = start  # drops the last step's expansion rows
        device = features.device
        ids = torch.tensor(context[start + 1 : n + 1], device=device)
        out = self.head(self.embed(ids).float(), features[start:n], torch.arange(start, n, device=device), self.cache)
        self.fed = n
        return out[-1]

    def _expand(
        self, tokens: list[int], inputs: torch.Tensor, positions: list[int], ancestors: list[list[int]]
    ) -> torch.Tensor:
        """One pass over expansion rows: row i is (embed(tokens[i]), inputs[i]) at positions[i],
        seeing the true pairs, the rows listed in ancestors[i] (cache slots) and itself. Returns
        the predicted features [R, hidden]."""
        device = inputs.device
        base = self.cache.length
        visible = torch.zeros(len(tokens), base + len(tokens), dtype=torch.bool, device=device)
        visible[:, : self.fed] = True
        for i, slots in enumerate(ancestors):
            visible[i, slots] = True
            visible[i, base + i] = True
        return self.head(
            self.embed(torch.tensor(tokens, device=device)).float(),
            inputs,
            torch.tensor(positions, device=device),
            self.cache,
            visible,
        )

    def _greedy_tree(self, root_feature: torch.Tensor, depth: int) -> DraftTree | None:
        branch, n = self.branch, self.num_known
        with torch.inference_mode():
            probs = self.head.logits(root_feature).softmax(-1)  # [N]
        top = probs.topk(min(branch, probs.shape[-1]))
        # Candidate nodes: token, parent, confidence, predicted feature input for its children.
        tokens = [int(self.vocab[i]) for i in top.indices]
        parents = [-1] * len(tokens)
        scores = top.values.tolist()
        feeds = [root_feature] * len(tokens)  # the feature that goes beside each node's embedding
        slots: dict[int, int] = {}  # expanded node -> its row's cache slot
        frontier = list(range(len(tokens)))
        for level in range(1, depth):
            chosen = sorted(frontier, key=lambda i: -scores[i])[:branch]
            if not chosen:
                break
            start = time.perf_counter()
            outs = self._expand(
                [tokens[i] for i in chosen],
                torch.stack([feeds[i] for i in chosen]),
                [n + level - 1] * len(chosen),
                [self._ancestor_slots(i, parents, slots) for i in chosen],
            )
            with torch.inference_mode():
                child_probs = self.head.logits(outs).softmax(-1)  # [B, N]
            best = child_probs.topk(min(branch, child_probs.shape[-1]), dim=-1)
            self._time(time.perf_counter() - start)
            frontier = []
            for row, node in enumerate(chosen):
                slots[node] = self.cache.length - len(chosen) + row
                for p, index in zip(best.values[row].tolist(), best.indices[row].tolist()):
                    tokens.append(int(self.vocab[index]))
                    parents.append(node)
                    scores.append(scores[node] * p)
                    feeds.append(outs[row])
                    frontier.append(len(tokens) - 1)
        keep = self._best_nodes(scores, parents, depth)
        new = {old: i for i, old in enumerate(keep)}
        return DraftTree([tokens[i] for i in keep], [new[parents[i]] if parents[i] >= 0 else -1 for i in keep])

    def _sampled_chain(
        self, root_feature: torch.Tensor, depth: int, params: SamplingParams, generator: Draws
    ) -> DraftTree:
        n = self.num_known
        feature, tokens, qs, slots = root_feature, [], [], []
        for level in range(depth):
            with torch.inference_mode():
                q = full_vocabulary(
                    probabilities(self.head.logits(feature)[None], params), self.vocab, self.vocab_size
                )  # [1, V]
            token = draw_tokens(q, generator, [level])[0]
            tokens.append(token)
            qs.append(q[0])
            if level + 1 == depth:
                break
            feature = self._expand([token], feature[None], [n + level], [list(slots)])[0]
            slots.append(self.cache.length - 1)
        return DraftTree.chain(tokens, torch.stack(qs))

    # --- helpers ----------------------------------------------------------------------------------

    @staticmethod
    def _ancestor_slots(node: int, parents: list[int], slots: dict[int, int]) -> list[int]:
        found = []
        node = parents[node]
        while node >= 0:
            found.append(slots[node])
            node = parents[node]
        return found

    def _best_nodes(self, scores: list[float], parents: list[int], depth: int) -> list[int]:
        """The nodes to verify, parents first: the best by confidence, as many as pay best."""
        # Confidence never grows down a path, so with ties broken by depth a prefix of this order
        # holds every kept node's parent.
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], _depth(i, parents)))[: self.nodes]
        count = self._best_count([scores[i] for i in order], depth)
        return sorted(order[:count])

    def _best_count(self, ranked: list[float], depth: int) -> int:
        """How many of the ranked nodes to verify: the most expected tokens per second."""
        if self.pass_cost is None or not ranked:
            return len(ranked)
        per_depth = self.head_seconds or 0.0
        best, best_rate, expected = 1, 0.0, 1.0
        for count, score in enumerate(ranked, 1):
            expected += score
            rate = expected / (self.pass_cost(1 + count) + depth * per_depth)
            if rate > best_rate:
                best, best_rate = count, rate
        return best

    def _time(self, seconds: float) -> None:
        previous = self.head_seconds
        self.head_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds


def _depth(node: int, parents: list[int]) -> int:
    depth = 0
    while node >= 0:
        depth += 1
        node = parents[node]
    return depth
