"""Log probabilities of tokens as the target gives them: log_softmax of its raw logits in float32
(before temperature, top-k and top-p, as vLLM reports them by default), with the likeliest
alternatives at each position."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PROMPT_ROWS = 256  # prompt rows scored at a time: a long prompt's [T, vocab] never exists at once


@dataclass
class TokenLogprob:
    token_id: int  # the token at this position
    logprob: float  # its log probability under the target
    top: list[tuple[int, float]]  # the N likeliest (token id, log probability) here, likeliest first


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """logits [T, vocab], raw, the row that predicted each of `token_ids` [T]; `top` alternatives each."""
    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # [T, vocab]
    ids = torch.tensor(token_ids, device=logp.device)
    chosen = logp.gather(-1, ids[:, None]).squeeze(-1).tolist()  # [T]
    if top:
        values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [T, top], sorted
        tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprob(t, p, alts) for t, p, alts in zip(token_ids, chosen, tops)]


def prompt_logprobs(
    score: Callable[[int, int], torch.Tensor], prompt_ids: list[int], top: int
) -> list[TokenLogprob | None]:
    """The prompt's log probabilities: entry 0 None (nothing predicts the first token), entry i from
    the row after token i-1. `score(a, b)` gives the raw logits [b - a, vocab] of rows [a, b)."""
    out: list[TokenLogprob | None] = [None]
    for a in range(0, len(prompt_ids) - 1, PROMPT_ROWS):
        b = min(a + PROMPT_ROWS, len(prompt_ids) - 1)
        out += token_logprobs(score(a, b), prompt_ids[a + 1 : b + 1], top)
    return out
