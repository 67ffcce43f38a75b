"""Draft and target vocabularies: the check that a draft model's tokens are the target's, and a draft
distribution over a subset of tokens (a reduced head's) spread over the whole vocabulary."""

from __future__ import annotations

import torch

from forerun.base.errors import ForerunError
from forerun.models.load import LoadedModel
from forerun.models.tokenizer import Tokenizer


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Draft and target must agree token for token; say exactly where they differ. Their heads may
    have different numbers of rows (a family's sizes pad the vocabulary differently: Qwen2.5's 0.5B
    has 151,936 rows, its 7B 152,064) where both tokenizers are there to show that every token is
    the same; the draft then scores the rows both have (`shared_rows`)."""
    t_rows, d_rows = target.decoder.cfg.vocab_size, draft.decoder.cfg.vocab_size
    tokenizers = target.tokenizer is not None and draft.tokenizer is not None
    if t_rows != d_rows and not tokenizers:
        raise ForerunError(
            f"draft {draft.name} has {d_rows} vocabulary rows, target {target.name} has {t_rows}, and without "
            "both tokenizers forerun cannot tell whether their tokens agree: load both with their tokenizers, "
            "or pick a draft of the same size of vocabulary"
        )
    if not tokenizers:
        return
    if draft.tokenizer is not target.tokenizer:  # one Tokenizer: their files were the same (load_model)
        _compare_tokenizers(target.tokenizer, draft.tokenizer, target.name, draft.name)
    tokens = max(target.tokenizer.vocabulary(), default=-1) + 1
    if tokens > min(t_rows, d_rows):
        raise ForerunError(
            f"the tokenizer has {tokens} tokens, more than the {min(t_rows, d_rows)} vocabulary rows of "
            f"{draft.name if d_rows < t_rows else target.name}: pick a draft of the same model family"
        )


def shared_rows(target: LoadedModel, draft: LoadedModel) -> torch.Tensor | None:
    """Token ids [N] of the rows both heads have, where their row counts differ (None: they agree)."""
    t_rows, d_rows = target.decoder.cfg.vocab_size, draft.decoder.cfg.vocab_size
    return torch.arange(min(t_rows, d_rows)) if t_rows != d_rows else None


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


def full_vocabulary(q: torch.Tensor, vocab: torch.Tensor | None, size: int) -> torch.Tensor:
    """q [..., N] over the draft vocabulary `vocab` ([N] token ids; None: every token already) as a
    distribution over all `size` tokens [..., size], 0 outside the subset."""
    if vocab is None:
        return q
    full = torch.zeros(*q.shape[:-1], size, dtype=q.dtype, device=q.device)
    return full.index_copy_(q.dim() - 1, vocab.to(q.device), q)
