"""Logits adjusted (logit bias, penalties, min-tokens, a structured output's mask) and made
probabilities (temperature, min-p, top-k, top-p); seeded sampling.

The target and every drafter go through the same `probabilities`, so the acceptance rule compares
processed distributions and the output follows the target's processed distribution exactly. The
target's logits are first `adjusted` (stop tokens held off before min_tokens, the logit bias, then
the repetition, presence and frequency penalties over each row's own history, as vLLM orders them;
then a structured output's mask):
each verification row as if it were the next token of plain decoding. A drafter's distribution
need not be adjusted (the rule is exact for any proposal distribution); drafts that are, are kept
more often.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from forerun import native
from forerun.base.config import SamplingParams
from forerun.verification.grammar import Grammar

FLOAT32_MAX = torch.finfo(torch.float32).max


def one_hot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids [...] -> float32 rows [..., vocab], 1 at each id: the greedy distribution."""
    return torch.zeros(*ids.shape, vocab, device=ids.device).scatter_(-1, ids[..., None], 1.0)


def adjusted(
    logits: torch.Tensor,
    params: SamplingParams,
    output: Sequence[int],
    paths: Sequence[Sequence[int]],
    prompt: Sequence[int] = (),
    stop_ids: Sequence[int] = (),
    grammar: Grammar | None = None,
) -> torch.Tensor:
    """logits [N, V] (float32, a new tensor) adjusted as `params` asks, row i for the token after
    `output` + `paths[i]` (its history: the tokens generated before the one it predicts): a row
    predicting one of the first min_tokens tokens cannot give `stop_ids`; then the logit bias;
    then the repetition penalty over the history's and `prompt`'s tokens; then the presence and
    frequency penalties over the history's; then a structured output's `grammar` (at `output`)
    leaves only the tokens it allows after the history. The logits unchanged without any of these."""
    if not params.adjusts:
        return logits.float()
    logits = logits.float().clone()
    device = logits.device
    allowed = grammar.allowed(paths).to(device) if grammar is not None else None  # [N, V]
    if params.min_tokens and stop_ids:
        early = [row for row, path in enumerate(paths) if len(output) + len(path) < params.min_tokens]
        if allowed is not None:  # a finished text allows only stop tokens: it ends, min_tokens or not
            early = [row for row in early if _allows_more_than(allowed[row], stop_ids)]
        if early:
            stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
            logits[torch.tensor(early, device=device)[:, None], stops] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
        logits[:, ids] += torch.tensor([b for _, b in params.logit_bias], device=device)
    if params.penalized:
        _penalize(logits, params, output, paths, prompt)
    if allowed is not None:
        logits.masked_fill_(~allowed, float("-inf"))
    return logits


def _allows_more_than(allowed: torch.Tensor, stop_ids: Sequence[int]) -> bool:
    """Whether a row's allowed tokens [V] (bool) hold one that is not a stop token."""
    count = int(allowed.sum())
    return count > int(allowed[list(stop_ids)].sum())


def _penalize(
    logits: torch.Tensor, params: SamplingParams, output: Sequence[int], paths: Sequence[Sequence[int]], prompt
) -> None:
    """The repetition, presence and frequency penalties, in place; the output's counts made once."""
    vocab, device = logits.shape[-1], logits.device
    base = torch.bincount(torch.tensor(list(output), dtype=torch.long, device=device), minlength=vocab)
    in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
    if params.repetition_penalty != 1 and len(prompt):
        in_prompt[torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
    for row, path in zip(logits, paths):
        counts = base
        if path:
            ids = torch.tensor(list(path), dtype=torch.long, device=device)
            counts = base.index_add(0, ids, torch.ones_like(ids))
        seen = counts > 0
        if params.repetition_penalty != 1:
            either = seen | in_prompt
            r = params.repetition_penalty
            row[either] = torch.where(row[either] > 0, row[either] / r, row[either] * r)
        row -= params.frequency_penalty * counts + params.presence_penalty * seen


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (float32). Greedy gives a one-hot at the argmax."""
    logits = logits.float()
    if params.greedy:
        return one_hot(native.argmax(logits), logits.shape[-1])
    # A temperature past float32's range would become infinity there, and a masked token's -inf / inf
    # NaN, which spoils the whole row; at float32's largest every finite logit / T is 0 all the same.
    # A logit pushed to +inf (a repetition penalty near 0 dividing it) is float32's largest, so the
    # softmax gives those tokens the row (inf - inf would be NaN); -inf stays -inf.
    logits = (logits / min(params.temperature, FLOAT32_MAX)).clamp(max=FLOAT32_MAX)
    if params.min_p > 0:  # tokens less likely than min_p x the likeliest, before top-k and top-p
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Keep a token while the mass before it is below top_p: the smallest set reaching top_p.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        # The likeliest token always stays: a top_p below float32's smallest number (1e-46) compares
        # as 0, and 0 >= 0 would drop every token.
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [N, V] (need not sum to 1) -> token ids [N], each drawn with probability p / sum(p).

    Inverse CDF in float64: one uniform per row and a binary search. torch.multinomial draws an
    exponential per vocabulary entry (~4 ms for 152k on two cores), this costs a cumulative sum. A
    one-hot row gives its hot index.
    """
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    return sample_with(probs, u)


def sample_with(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample` with its uniforms given: probs [N, V], u [N, 1] float64 in [0, 1) -> token ids [N]."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    picked = torch.searchsorted(cdf, u.to(cdf.device) * cdf[:, -1:], right=True).squeeze(-1)  # [N]
    # u * total < total, so a row always lands inside; the clamp guards rounding at the very top.
    return picked.clamp_(max=probs.shape[-1] - 1)


_MASK = (1 << 64) - 1


def position_uniform(key: int, position: int) -> float:
    """A uniform in [0, 1) for the token at `position` of a sequence whose draws are keyed by `key`
    (splitmix64's mix of the two; 53 random bits). The token at a position is drawn with this one
    number however it is reached: by plain decoding, or as the target's sample that a deterministic
    draft must equal (`accept.accept_one_hot`), so a seeded request writes the same text with or
    without such a drafter."""
    return (_mix64(key + (position + 1) * 0x9E3779B97F4A7C15) >> 11) * 2.0**-53


def _mix64(z: int) -> int:
    """splitmix64's finalizer: every output bit depends on every bit of z (taken mod 2**64)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def sample_at(probs: torch.Tensor, key: int, position: int) -> int:
    """The token drawn from one row `probs` [V] for `position` of the sequence keyed by `key`."""
    u = torch.tensor([[position_uniform(key, position)]], dtype=torch.float64)
    return int(sample_with(probs[None], u)[0])


@dataclass(frozen=True)
class PositionDraws:
    """What a seeded request's drafter draws with: the draft token `depth` tokens below the root is
    drawn from its distribution with the uniform of position `first + depth` (`position_uniform`),
    the number the target's own draw at that position takes. The target keeps a draft when its draw
    equals it (`accept.accept_one_hot`), so a seeded request writes plain decoding's text whatever
    was drafted, and a draft distribution near the target's draws the same token most of the time
    (the two inverse CDFs over one uniform)."""

    key: int
    first: int  # the position of the root's next token


# What a drafter draws its tokens with: the request's generator, or a seeded request's positions.
Draws = torch.Generator | PositionDraws | None


def draw_tokens(probs: torch.Tensor, source: Draws, depths: Sequence[int]) -> list[int]:
    """One token from each row of `probs` [N, V], row i at `depths[i]` below the root: with the
    position's uniform for a seeded request's `PositionDraws`, else from the generator."""
    if isinstance(source, PositionDraws):
        return [sample_at(row, source.key, source.first + depth) for row, depth in zip(probs, depths)]
    return sample(probs, source).tolist()


def draw_key(seed: int | None, generator: torch.Generator) -> int:
    """What keys a request's position draws: its seed, else a number from its (randomly seeded) generator."""
    if seed is not None:
        return seed & _MASK
    return int(torch.randint(0, 1 << 62, (1,), generator=generator, device=generator.device))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        # A CPU generator (mt19937) reads only the low 32 bits of its seed: the seed is mixed first,
        # so that seeds differing only in their high bits draw differently.
        gen.manual_seed(_mix64(seed))
    return gen
