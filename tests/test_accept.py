"""The acceptance rule on hand-made distributions, exact outcomes first, then the output distribution.

The distribution tests draw many samples through the rule and compare the emitted tokens with the
target's distribution, within a total-variation bound derived from the sample size. Wrong rules
written here (always accept; recover from p instead of the residual; an off-by-one target row) must
fail the same checks, so the checks are known to have teeth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from forerun.base.config import SamplingParams
from forerun.verification.accept import Acceptance, accept, accept_chain, accept_greedy
from forerun.verification.sampling import probabilities
from forerun.verification.tree import DraftTree

B = 256  # rows per batched exact-table case: an outcome that must always happen is checked 256 times


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def batched(target: torch.Tensor, drafts: list[int], q: torch.Tensor | None):
    """The same chain B times: target [B, K+1, V], drafts [B, K], q [B, K, V] or None."""
    d = torch.tensor(drafts)[None].expand(B, -1)
    return target[None].expand(B, -1, -1), d, (q[None].expand(B, -1, -1) if q is not None else None)


def run_chain(target, drafts, q, seed=0, greedy=False):
    p, d, qq = batched(target, drafts, q)
    return accept_chain(p, d, qq, torch.Generator().manual_seed(seed), greedy)


# --- exact outcomes -----------------------------------------------------------------------------


def test_drafts_the_target_likes_at_least_as_much_are_all_kept_and_a_bonus_follows():
    # p(x) >= q(x) at every draft: kept with probability 1; bonus from the last row, a one-hot at 3.
    target = t([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.7, 0.0], [0.0, 0.0, 0.0, 1.0]])
    q = t([[0.6, 0.4, 0.0, 0.0], [0.3, 0.3, 0.4, 0.0]])
    num, nxt = run_chain(target, [1, 2], q)
    assert num.tolist() == [2] * B and nxt.tolist() == [3] * B


def test_a_first_position_rejection_emits_only_the_recovered_token():
    # p(0) = 0 rejects draft 0; the residual max(0, p - q) = [0, 0, .3, 0] leaves only token 2.
    target = t([[0.0, 0.5, 0.3, 0.2], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    q = t([[0.3, 0.5, 0.0, 0.2], [1.0, 0.0, 0.0, 0.0]])
    num, nxt = run_chain(target, [0, 0], q)
    assert num.tolist() == [0] * B and nxt.tolist() == [2] * B


def test_a_middle_rejection_keeps_the_prefix_and_ignores_later_drafts():
    target = t(
        [
            [0.0, 1.0, 0.0, 0.0],  # draft 1 certain
            [0.2, 0.0, 0.3, 0.5],  # draft 1 impossible -> reject; residual [0, 0, 0, .5] -> 3
            [0.0, 0.0, 1.0, 0.0],  # never looked at
            [0.0, 0.0, 1.0, 0.0],
        ]
    )
    q = t([[0.0, 1.0, 0.0, 0.0], [0.2, 0.5, 0.3, 0.0], [0.0, 0.0, 1.0, 0.0]])
    num, nxt = run_chain(target, [1, 1, 2], q)
    assert num.tolist() == [1] * B and nxt.tolist() == [3] * B


@pytest.mark.parametrize("seed", range(5))
def test_a_draft_with_zero_target_probability_is_always_rejected(seed):
    # The draft likes token 0 a lot; the target never emits it.
    target = t([[0.0, 0.25, 0.25, 0.5], [0.25, 0.25, 0.25, 0.25]])
    q = t([[0.97, 0.01, 0.01, 0.01]])
    num, nxt = run_chain(target, [0], q, seed)
    assert num.tolist() == [0] * B
    assert 0 not in nxt.tolist()
    num, nxt = run_chain(target, [0], None, seed)  # the same for a one-hot (deterministic) draft
    assert num.tolist() == [0] * B and 0 not in nxt.tolist()


def test_a_draft_impossible_under_both_draft_and_target_is_rejected():
    # q(x) = 0 too (a draft proposed outside its own distribution): min(1, p/q) = min(1, 0/0) must not keep it.
    target = t([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    q = t([[0.0, 1.0, 0.0]])
    num, nxt = run_chain(target, [0], q)
    assert num.tolist() == [0] * B and set(nxt.tolist()) == {2}  # residual max(0, p - q) = [0, 0, .5]


def test_a_draft_the_draft_model_gave_zero_but_the_target_likes_is_kept():
    target = t([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    q = t([[0.0, 0.0, 1.0]])
    num, nxt = run_chain(target, [1], q)
    assert num.tolist() == [1] * B and nxt.tolist() == [0] * B


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.6)]
)
def test_a_draft_outside_the_targets_top_k_or_top_p_is_rejected_and_never_recovered(params):
    # Target logits rank tokens 1 > 0 > 2 > 3 with probabilities [.3, .5, .15, .05]:
    # top_k=2 and top_p=0.6 both keep {1, 0}. The draft (processed the same way) proposed 2.
    target_logits = t([[0.3, 0.5, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]).log()
    target = probabilities(target_logits, params)  # [2, 4]
    assert target[0, 2] == 0 and target[0, 3] == 0
    q = probabilities(t([[0.1, 0.1, 0.7, 0.1]]).log(), params)  # draft likes token 2
    num, nxt = run_chain(target, [2], q)
    assert num.tolist() == [0] * B
    assert set(nxt.tolist()) <= {0, 1}


@pytest.mark.parametrize(
    "drafts,expected_num,expected_next",
    [
        ([3, 1, 0], 3, 2),  # all match the argmaxes [3, 1, 0], bonus = argmax of row 3
        ([3, 1, 2], 2, 0),  # third differs: corrected to the argmax 0
        ([0, 1, 0], 0, 3),  # first differs: later matches do not count
        ([3, 0, 0], 1, 1),
    ],
)
def test_greedy_keeps_the_longest_prefix_matching_the_argmax(drafts, expected_num, expected_next):
    target = probabilities(
        t([[0.1, 0.2, 0.3, 0.9], [0.0, 2.0, 1.0, 0.5], [5.0, 1.0, 2.0, 3.0], [0.0, 0.0, 4.0, 1.0]]), SamplingParams()
    )
    num, nxt = accept_chain(target[None], torch.tensor([drafts]), None, None, greedy=True)
    assert (num.item(), nxt.item()) == (expected_num, expected_next)


def test_greedy_batch_rows_are_independent():
    target = torch.eye(4)[torch.tensor([[3, 1, 0, 2], [0, 0, 0, 0]])]  # [2, 4, 4] one-hots
    drafts = torch.tensor([[3, 1, 0], [0, 1, 0]])
    num, nxt = accept_chain(target, drafts, None, None, greedy=True)
    assert num.tolist() == [3, 1] and nxt.tolist() == [2, 0]


def test_deterministic_draft_certain_under_the_target_is_kept():
    target = t([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    num, nxt = run_chain(target, [2, 1], None)
    assert num.tolist() == [2] * B
    assert set(nxt.tolist()) == {0, 1, 2}  # the bonus samples the last row


def test_deterministic_draft_rejection_recovers_from_the_target_without_the_draft():
    target = t([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    num, nxt = run_chain(target, [1], None)
    # Token 1 is kept with probability 0.5; when rejected, only token 2 remains.
    rejected = num == 0
    assert 0.35 < rejected.float().mean() < 0.65
    assert set(nxt[rejected].tolist()) == {2} and set(nxt[~rejected].tolist()) == {0}


def test_seeded_acceptance_is_reproducible():
    target = torch.rand(64, 4, 6, generator=torch.Generator().manual_seed(1)).softmax(-1)
    q = torch.rand(64, 3, 6, generator=torch.Generator().manual_seed(2)).softmax(-1)
    drafts = torch.randint(0, 6, (64, 3), generator=torch.Generator().manual_seed(3))
    a = accept_chain(target, drafts, q, torch.Generator().manual_seed(9), False)
    b = accept_chain(target, drafts, q, torch.Generator().manual_seed(9), False)
    c = accept_chain(target, drafts, q, torch.Generator().manual_seed(10), False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not (torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]))


def test_accept_on_a_chain_tree_reports_path_and_tokens():
    tree = DraftTree.chain([1, 1, 2], t([[0.0, 1.0, 0.0, 0.0], [0.2, 0.5, 0.3, 0.0], [0.0, 0.0, 1.0, 0.0]]))
    target = t([[0.0, 1.0, 0.0, 0.0], [0.2, 0.0, 0.3, 0.5], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    for seed in range(20):
        out = accept(target, tree, torch.Generator().manual_seed(seed), greedy=False)
        assert out == Acceptance(path=[0], tokens=[1, 3])
    greedy = accept(probabilities(target, SamplingParams()), DraftTree.chain([1, 3, 2]), None, greedy=True)
    assert greedy == Acceptance(path=[0, 1, 2], tokens=[1, 3, 2, 2])


# A small tree over V = 5:       root
#                              /   |   \
#                            n0   n1    n2        (tokens 0, 1, 2)
#                           /  \    \
#                         n3   n4    n5           (tokens 3, 4, 4)
TREE_TOKENS, TREE_PARENTS = [0, 1, 2, 3, 4, 4], [-1, -1, -1, 0, 0, 1]


def test_greedy_tree_follows_the_argmax_through_the_branches():
    rows = [1, 3, 4, 0, 2, 3, 1]  # argmax after root, n0, n1, n2, n3, n4, n5
    target = torch.eye(5)[rows]
    out = accept(target, DraftTree(TREE_TOKENS, TREE_PARENTS), None, greedy=True)
    assert out == Acceptance(path=[1, 5], tokens=[1, 4, 1])  # root->n1 (1), n1->n5 (4), bonus 1
    rows[0] = 3  # no child of the root matches
    assert accept(torch.eye(5)[rows], DraftTree(TREE_TOKENS, TREE_PARENTS), None, True) == Acceptance([], [3])
    rows[0], rows[1] = 0, 3  # n0 then n3 (a leaf): bonus after n3
    assert accept(torch.eye(5)[rows], DraftTree(TREE_TOKENS, TREE_PARENTS), None, True) == Acceptance([0, 3], [0, 3, 2])


@pytest.mark.parametrize("seed", range(40))
def test_greedy_acceptance_from_the_argmax_alone_is_the_rules_on_the_one_hot_rows(seed):
    # What the engine runs under greedy (the argmax of each row, no one-hot rows) against the rule.
    gen = torch.Generator().manual_seed(seed)
    n, vocab = int(torch.randint(1, 9, (1,), generator=gen)), 4
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
    tree = DraftTree([int(x) for x in torch.randint(0, vocab, (n,), generator=gen)], parents)
    best = [int(x) for x in torch.randint(0, vocab, (n + 1,), generator=gen)]
    assert accept_greedy(best, tree) == accept(torch.eye(vocab)[best], tree, None, greedy=True)


def test_stochastic_tree_tries_siblings_in_turn_with_the_residual():
    # Root row: p = [0, .6, .4, 0, 0]. n0 (token 0) has p = 0: rejected. The residual after
    # q0 = [.5, .5, 0, 0, 0] is [0, .1, .4, 0, 0] / .5; n1 (token 1, q1 = [0, 1, 0, 0, 0]) is kept
    # with probability p'(1) = .2, else the residual [0, 0, .4, 0, 0] makes n2 (token 2) certain.
    q = torch.zeros(6, 5)
    q[0] = t([0.5, 0.5, 0, 0, 0])
    q[1] = t([0, 1.0, 0, 0, 0])
    q[2] = t([0, 0, 1.0, 0, 0])
    q[3:] = t([0.2, 0.2, 0.2, 0.2, 0.2])
    target = torch.zeros(7, 5)
    target[0] = t([0, 0.6, 0.4, 0, 0])
    target[1:] = torch.eye(5)[[0, 4, 3, 0, 0, 3]]  # after n1, token 4 (n5) is certain; after n5 -> 3
    tree = DraftTree(TREE_TOKENS, TREE_PARENTS, q)
    outcomes = {}
    for seed in range(400):
        out = accept(target, tree, torch.Generator().manual_seed(seed), greedy=False)
        outcomes[tuple(out.path)] = out.tokens
    assert outcomes == {(1, 5): [1, 4, 3], (2,): [2, 3]}


def test_stochastic_tree_recovers_from_the_residual_when_every_child_is_rejected():
    target = torch.zeros(7, 5)
    target[0] = t([0, 0, 0, 0.5, 0.5])  # no child of the root (tokens 0, 1, 2) is possible
    for q in (None, torch.full((6, 5), 0.2), t([[0, 0, 0, 0.5, 0.5]] * 6)):  # one-hot, uniform, q(x) = 0
        tree = DraftTree(TREE_TOKENS, TREE_PARENTS, q)
        seen = {tuple(accept(target, tree, torch.Generator().manual_seed(s), False).tokens) for s in range(50)}
        assert seen == {(3,), (4,)}


# --- the output distribution --------------------------------------------------------------------
#
# The target is a Markov chain over V tokens: p_1 after the prompt, then next-token tables M_t[prev].
# Exactness means the first two emitted tokens (y1, y2) follow p_1(y1) M_2[y1](y2). When a step emits
# only y1 (first draft rejected), y2 belongs to the next step; we draw it from M_2[y1] directly, which
# is what the next step gives if the rule is exact for the first token (checked on its own).

V, K = 8, 3
N_CHAIN = 200_000
N_TREE = 20_000


def random_dists(shape: tuple[int, ...], gen: torch.Generator, sharp: float = 1.5) -> torch.Tensor:
    """Random distributions over V tokens [*shape, V]; token 0 is impossible everywhere."""
    probs = (torch.randn(*shape, V, generator=gen) * sharp).softmax(-1)
    probs[..., 0] = 0.0
    return probs / probs.sum(-1, keepdim=True)


def tv_bound(cells: int, n: int, z: float = 4.0) -> float:
    """Total variation between an n-sample histogram over `cells` cells and the truth stays below this
    but for probability exp(-z^2): E[TV] <= 0.5 sqrt(cells / n) (Cauchy-Schwarz over the cells), and one
    sample moves TV by at most 1/n, so McDiarmid gives P(TV > E[TV] + z / sqrt(2n)) <= exp(-z^2)."""
    return 0.5 * math.sqrt(cells / n) + z / math.sqrt(2 * n)


def tv(samples: torch.Tensor, truth: torch.Tensor) -> float:
    """TV distance between the histogram of integer `samples` and the distribution `truth` [cells]."""
    hist = torch.bincount(samples, minlength=truth.numel()).float() / samples.numel()
    return 0.5 * float((hist - truth.flatten()).abs().sum())


@dataclass
class MarkovTarget:
    p1: torch.Tensor  # [V] after the prompt
    m: torch.Tensor  # [K, V, V] m[t-2][prev] = distribution of token t given token t-1 (t = 2..K+1)

    @classmethod
    def random(cls, gen: torch.Generator) -> MarkovTarget:
        return cls(random_dists((), gen), random_dists((K, V), gen))

    def rows(self, drafts: torch.Tensor) -> torch.Tensor:
        """Target distributions for chains of drafts [B, K]: [B, K+1, V]."""
        b = drafts.shape[0]
        later = [self.m[i][drafts[:, i]] for i in range(drafts.shape[1])]  # K x [B, V]
        return torch.stack([self.p1.expand(b, V)] + later, dim=1)

    def joint(self) -> torch.Tensor:
        """p_1(y1) M_2[y1](y2) flattened to [V * V] (cell y1 * V + y2)."""
        return (self.p1[:, None] * self.m[0]).flatten()

    def complete_pairs(self, first: torch.Tensor, second: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Cells y1 * V + y2, drawing y2 from M_2[y1] where the step emitted only y1 (second == -1)."""
        missing = second < 0
        drawn = torch.multinomial(self.m[0][first[missing]], 1, generator=gen).squeeze(-1)
        second = second.clone()
        second[missing] = drawn
        return first * V + second


def always_accept(target_probs, draft_tokens, draft_probs, generator, greedy):
    """Negative control: keeps every draft, then a bonus from the target. Not exact."""
    b, k = draft_tokens.shape
    bonus = torch.multinomial(target_probs[:, k], 1, generator=generator).squeeze(-1)
    return torch.full((b,), k), bonus


def recover_from_target(target_probs, draft_tokens, draft_probs, generator, greedy):
    """Negative control: the right acceptance test, but a rejection resamples p instead of the residual."""
    b, k = draft_tokens.shape
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1) if draft_probs is not None else 1.0
    kept = torch.rand(b, k, generator=generator) * q_x < p_x
    num = kept.long().cumprod(-1).sum(-1)
    final = target_probs[torch.arange(b), num]
    return num, torch.multinomial(final, 1, generator=generator).squeeze(-1)


def stale_row(target_probs, draft_tokens, draft_probs, generator, greedy):
    """Negative control for the second token only: exact, except that after an accepted draft the
    next token comes from the target row before it (an off-by-one in the row index)."""
    num, nxt = accept_chain(target_probs, draft_tokens, draft_probs, generator, greedy)
    stale = target_probs[torch.arange(len(num)), (num - 1).clamp_min(0)]
    return num, torch.where(num >= 1, torch.multinomial(stale, 1, generator=generator).squeeze(-1), nxt)


def chain_samples(rule, deterministic: bool, n: int = N_CHAIN, seed: int = 0):
    """Run `rule` once on n chains; returns the target and the first two emitted tokens as cells."""
    gen = torch.Generator().manual_seed(seed)
    target = MarkovTarget.random(gen)
    if deterministic:
        # A prompt-lookup-like guess [2, 5, 1]; make it plausible so later positions get exercised.
        guesses = torch.tensor([2, 5, 1])
        target.p1[2] += 0.5
        target.m[0, 2, 5] += 0.6
        target.m[1, 5, 1] += 0.6
        target.p1 /= target.p1.sum()
        target.m /= target.m.sum(-1, keepdim=True)
        drafts, q = guesses[None].expand(n, -1), None
    else:
        # Draft model: also Markov, with its own tables; drafts are sampled from it position by position.
        q1, qm = random_dists((), gen, sharp=2.0), random_dists((K - 1, V), gen, sharp=2.0)
        cols = [torch.multinomial(q1, n, replacement=True, generator=gen)]
        dists = [q1.expand(n, V)]
        for i in range(K - 1):
            dists.append(qm[i][cols[-1]])
            cols.append(torch.multinomial(dists[-1], 1, generator=gen).squeeze(-1))
        drafts, q = torch.stack(cols, dim=1), torch.stack(dists, dim=1)  # [n, K], [n, K, V]
    num, nxt = rule(target.rows(drafts), drafts, q, gen, False)
    first = torch.where(num >= 1, drafts[:, 0], nxt)
    second = torch.where(num >= 2, drafts[:, 1], torch.where(num == 1, nxt, torch.full_like(nxt, -1)))
    return target, first, target.complete_pairs(first, second, gen), num


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-drafts", "one-hot-drafts"])
def test_chain_rule_emits_exactly_the_target_distribution(deterministic):
    target, first, pairs, num = chain_samples(accept_chain, deterministic)
    assert (num > 0).float().mean() > 0.2 and (num < K).float().mean() > 0.2  # both branches exercised
    assert tv(first, target.p1) < tv_bound(V, N_CHAIN)
    assert tv(pairs, target.joint()) < tv_bound(V * V, N_CHAIN)


@pytest.mark.parametrize("rule", [always_accept, recover_from_target])
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-drafts", "one-hot-drafts"])
def test_wrong_rules_fail_the_same_distribution_check(rule, deterministic):
    target, first, pairs, _ = chain_samples(rule, deterministic)
    assert tv(first, target.p1) > tv_bound(V, N_CHAIN), "the check cannot tell this wrong rule apart"


def test_the_joint_check_catches_a_rule_wrong_only_after_the_first_token():
    target, first, pairs, _ = chain_samples(stale_row, deterministic=False)
    assert tv(first, target.p1) < tv_bound(V, N_CHAIN)
    assert tv(pairs, target.joint()) > tv_bound(V * V, N_CHAIN)


def test_rejection_rate_matches_the_total_variation_of_p_and_q():
    # P(first draft kept) = sum_x min(p(x), q(x)) = 1 - TV(p, q): the rule keeps as much as it can.
    gen = torch.Generator().manual_seed(5)
    p, q = random_dists((2,), gen), random_dists((1,), gen)
    n = N_CHAIN
    drafts = torch.multinomial(q[0], n, replacement=True, generator=gen)[:, None]
    num, _ = accept_chain(p[None].expand(n, -1, -1), drafts, q[None].expand(n, -1, -1), gen, False)
    expected = float(torch.minimum(p[0], q[0]).sum())
    assert abs(num.float().mean().item() - expected) < 4 * 0.5 / math.sqrt(n)


# A tree for the distribution test: two children of the root, and a child under the first.
TREE_PARENTS_DIST = [-1, -1, 0]


def tree_samples(rule, deterministic: bool, n: int = N_TREE, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    target = MarkovTarget.random(gen)
    q_root, q_next = random_dists((), gen, sharp=2.0), random_dists((V,), gen, sharp=2.0)
    if deterministic:  # two distinct fixed guesses under the root, one under the first
        tokens = torch.tensor([2, 5, 1]).expand(n, -1)
    else:  # siblings drawn independently from the same q, grandchild from q_next
        ab = torch.multinomial(q_root, 2 * n, replacement=True, generator=gen).view(n, 2)
        c = torch.multinomial(q_next[ab[:, 0]], 1, generator=gen)
        tokens = torch.cat([ab, c], dim=1)  # [n, 3]
    rows = torch.stack(
        [target.p1.expand(n, V), target.m[0][tokens[:, 0]], target.m[0][tokens[:, 1]], target.m[1][tokens[:, 2]]], dim=1
    )  # [n, 4, V]
    firsts, seconds = [], []
    for i, toks in enumerate(tokens.tolist()):
        probs = None if deterministic else torch.stack([q_root, q_root, q_next[toks[0]]])
        out = rule(rows[i], DraftTree(toks, TREE_PARENTS_DIST, probs), gen)
        firsts.append(out.tokens[0])
        seconds.append(out.tokens[1] if len(out.tokens) > 1 else -1)
    first, second = torch.tensor(firsts), torch.tensor(seconds)
    return target, first, target.complete_pairs(first, second, gen)


def tree_rule(rows, tree, gen):
    assert not tree.is_chain
    return accept(rows, tree, gen, greedy=False)


def tree_always_first_child(rows, tree, gen):
    """Negative control: follow first children to a leaf, then a bonus from the target."""
    path, node = [], -1
    while tree.children(node):
        node = tree.children(node)[0]
        path.append(node)
    bonus = int(torch.multinomial(rows[node + 1], 1, generator=gen))
    return Acceptance(path, [tree.tokens[i] for i in path] + [bonus])


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-drafts", "one-hot-drafts"])
def test_tree_rule_emits_exactly_the_target_distribution(deterministic):
    target, first, pairs = tree_samples(tree_rule, deterministic)
    assert tv(first, target.p1) < tv_bound(V, N_TREE)
    assert tv(pairs, target.joint()) < tv_bound(V * V, N_TREE)


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-drafts", "one-hot-drafts"])
def test_a_wrong_tree_rule_fails_the_same_distribution_check(deterministic):
    target, first, pairs = tree_samples(tree_always_first_child, deterministic, n=N_TREE // 4)
    assert tv(first, target.p1) > tv_bound(V, N_TREE // 4)
