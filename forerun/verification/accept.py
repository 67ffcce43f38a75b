"""The exact acceptance rule (Leviathan et al. 2023; Chen et al. 2023), for chains and trees.

Vocabulary:
- draft tokens: what the drafter proposed, each drawn from its draft distribution q.
- accepted: draft tokens the rule kept. Draft x is kept with probability min(1, p(x) / q(x)),
  where p is the target's (processed) distribution at that position.
- recovered: at the first rejection, the token sampled from normalize(max(0, p - q)).
- bonus: when every draft of a chain (or a whole tree path) is kept, one more token sampled from
  the target's distribution after the last one.
Every step therefore emits accepted + 1 tokens, and the result follows p exactly.

Greedy is the special case where p and q are one-hot: a draft is kept exactly when it is the
target's argmax, and the recovered or bonus token is that argmax.

Worked example (chain, K = 3): drafts [a, b, c]; a kept, b rejected -> emit [a, r] with r drawn from
normalize(max(0, p_2 - q_2)); c is never looked at. All kept -> emit [a, b, c, bonus ~ p_4].

A deterministic drafter (prompt lookup) gives q = one-hot(x): x is kept with probability p(x), and
on rejection the recovered token comes from p with x removed. `accept_one_hot` does the same with
each position's own uniform (`sampling.position_uniform`): the target's sample T at the position is
drawn first and a draft is kept when it equals T, else T is emitted. x is kept with probability
p(x) all the same (siblings x and x' with p(x) + p(x'), as by SpecInfer's rule), and every emitted
token is the one plain decoding draws at that position with that uniform, so a seeded request's text
does not depend on the drafts. A seeded request's drafts with a distribution go the same way (the
engine has them drawn with their positions' uniforms, `sampling.PositionDraws`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from forerun import native
from forerun.verification.sampling import sample, sample_at
from forerun.verification.tree import DraftTree


@dataclass
class Acceptance:
    path: list[int]  # accepted nodes of the tree, root side first
    tokens: list[int]  # the accepted draft tokens, then the recovered or bonus token [len(path) + 1]


def accept_chain(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised over a batch of chains.

    target_probs [B, K+1, V]; draft_tokens [B, K] (long); draft_probs [B, K, V] or None (one-hot drafts).
    Returns num_accepted [B] and next_token [B] (the recovered or bonus token).
    """
    b, k = draft_tokens.shape
    rows = torch.arange(b, device=draft_tokens.device)
    if greedy:
        best = native.argmax(target_probs)  # [B, K+1]
        kept = draft_tokens == best[:, :k]  # [B, K]
        num = kept.long().cumprod(-1).sum(-1)  # [B]
        return num, best[rows, num]
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    q_x = (
        draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1) if draft_probs is not None else torch.ones_like(p_x)
    )  # [B, K]
    u = torch.rand(b, k, generator=generator, device=p_x.device)
    kept = u * q_x < p_x  # u < p/q without dividing; q_x = 0 keeps any p_x > 0
    num = kept.long().cumprod(-1).sum(-1)  # [B]
    final = target_probs[rows, num].clone()  # [B, V]
    rejected = num < k
    if rejected.any():
        r = rows[rejected]
        at = num[rejected]
        if draft_probs is not None:
            residual = (final[r] - draft_probs[r, at]).clamp_min(0)
        else:
            residual = final[r].scatter(-1, draft_tokens[r, at][:, None], 0.0)
        mass = residual.sum(-1, keepdim=True)
        # Zero mass happens only when p == q, where a rejection cannot occur; keep p then.
        final[r] = torch.where(mass > 0, residual / mass.clamp_min(1e-30), final[r])
    return num, sample(final, generator)


def accept(target_probs: torch.Tensor, tree: DraftTree, generator: torch.Generator | None, greedy: bool) -> Acceptance:
    """target_probs [N+1, V]: row 0 follows the root, row i+1 follows node i."""
    if tree.is_chain:
        drafts = torch.tensor(tree.tokens, dtype=torch.long, device=target_probs.device)
        probs = tree.probs[None] if tree.probs is not None else None
        num, nxt = accept_chain(target_probs[None], drafts[None], probs, generator, greedy)
        n = int(num[0])
        return Acceptance(list(range(n)), tree.tokens[:n] + [int(nxt[0])])
    return _accept_tree(target_probs, tree, generator, greedy)


def accept_one_hot(target_probs: torch.Tensor, tree: DraftTree, key: int, position: int) -> Acceptance:
    """`accept` under sampling for a tree of deterministic drafts (`tree.probs` None) whose root's
    next token is at `position` of the sequence keyed by `key`: from the root, the target's sample
    at each depth (`sampling.sample_at`), the child drafting it kept, until no child drafted it."""
    return _walk(tree, lambda node, depth: sample_at(target_probs[node + 1], key, position + depth))


def accept_greedy(best: list[int], tree: DraftTree) -> Acceptance:
    """`accept` under greedy from the target's argmax after the root and each node (`best` [N+1]):
    from the root, the child drafting the argmax is kept, then its child drafting the argmax after
    it, and so on; the first argmax no child drafted ends the step as its bonus token."""
    return _walk(tree, lambda node, depth: best[node + 1])


def _walk(tree: DraftTree, target_token: Callable[[int, int], int]) -> Acceptance:
    """From the root, the child drafting `target_token(node, depth)` (the target's token after
    `node`, `depth` nodes below the root) kept, until no child drafted it: that token ends the step."""
    node, path = -1, []
    while True:
        token = target_token(node, len(path))
        chosen = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if chosen is None:
            return Acceptance(path, [tree.tokens[i] for i in path] + [token])
        path.append(chosen)
        node = chosen


def _accept_tree(
    target_probs: torch.Tensor, tree: DraftTree, generator: torch.Generator | None, greedy: bool
) -> Acceptance:
    """Walk from the root. Among siblings, try each child in turn with the chain rule, replacing p by
    its residual after each rejection (SpecInfer's multi-draft rule); exact for any per-child q."""
    node, path = -1, []
    while True:
        p = target_probs[node + 1]
        children = tree.children(node)
        chosen = None
        if greedy:
            best = int(native.argmax(p))
            chosen = next((c for c in children if tree.tokens[c] == best), None)
            if chosen is None:
                return Acceptance(path, [tree.tokens[i] for i in path] + [best])
        else:
            for c in children:
                x = tree.tokens[c]
                q = tree.probs[c] if tree.probs is not None else None
                q_x = float(q[x]) if q is not None else 1.0
                if float(torch.rand((), generator=generator, device=p.device)) * q_x < float(p[x]):
                    chosen = c
                    break
                residual = (
                    (p - q).clamp_min(0) if q is not None else p.scatter(0, torch.tensor([x], device=p.device), 0.0)
                )
                mass = residual.sum()
                if mass > 0:
                    p = residual / mass
            if chosen is None:
                token = int(sample(p[None], generator)[0])
                return Acceptance(path, [tree.tokens[i] for i in path] + [token])
        path.append(chosen)
        node = chosen
