"""What every drafter over one draft model shares with the others over it (a server has one per
lane): made once per draft model, target and draft vocabulary, and kept while both models live."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from forerun.base.errors import ForerunError
from forerun.drafters.draft_vocab import draft_vocabulary, reduced_head
from forerun.drafters.vocabulary import check_same_vocabulary, shared_rows
from forerun.models.decoder import Decoder
from forerun.models.load import LoadedModel
from forerun.policy.pass_costs import PassCosts


@dataclass
class DraftSetup:
    """One draft model's set-up for one target and draft vocabulary."""

    vocab: torch.Tensor | None  # [N] token ids the draft scores (None: every token)
    head: nn.Module | None  # the draft's LM head cut to `vocab` (None: its own head)
    # (seconds per token of a catch-up pass, seconds of a one-token pass) as first timed.
    timed: tuple[float, float] | None = None
    pooled_costs: PassCosts | None = None  # seconds of a draft forward pooled by r lanes


# Per draft decoder, then target decoder: its set-ups by draft vocabulary size (None: the whole
# vocabulary). A pair is entered only once its vocabularies are checked to agree.
_SETUPS: weakref.WeakKeyDictionary[Decoder, weakref.WeakKeyDictionary[Decoder, dict[int | None, DraftSetup]]] = (
    weakref.WeakKeyDictionary()
)


def draft_setup(target: LoadedModel, draft: LoadedModel, draft_vocab: int | None) -> DraftSetup:
    """The set-up every drafter of `draft` for `target` shares; checks the vocabularies the first time."""
    if draft_vocab is not None and draft_vocab < 1:
        raise ForerunError(
            f"--draft-vocab must be at least 1 token, got {draft_vocab}; leave it out to score the whole vocabulary"
        )
    by_target = _SETUPS.setdefault(draft.decoder, weakref.WeakKeyDictionary())
    setups = by_target.get(target.decoder)
    if setups is None:
        check_same_vocabulary(target, draft)
        setups = by_target[target.decoder] = {}
    if draft_vocab not in setups:
        vocab = draft_vocabulary(target, draft_vocab) if draft_vocab else None  # [N] token ids
        shared = shared_rows(target, draft)  # heads of different sizes: the rows both have
        if shared is not None:
            vocab = shared if vocab is None else vocab[vocab < len(shared)]
        # The draft model keeps its full head; drafters with a reduced vocabulary score with its rows
        # (its own head where those are all its rows).
        rows = draft.decoder.cfg.vocab_size
        whole = vocab is not None and len(vocab) == rows and bool((vocab == torch.arange(rows)).all())
        head = reduced_head(draft.decoder.lm_head, vocab) if vocab is not None and not whole else None
        setups[draft_vocab] = DraftSetup(vocab, head)
    return setups[draft_vocab]
