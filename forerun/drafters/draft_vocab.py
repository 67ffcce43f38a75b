"""A draft's LM head over the tokens the target writes: cheaper per draft token, and still exact.

A vocabulary-sized LM head is a large share of a small draft's bytes (the 0.5B Qwen draft: 141 MB of
~500 MB in int8). Scoring only the N tokens the target most often chooses cuts that share by
vocab / N. The rule stays lossless: tokens outside the subset get draft probability 0, and the
target decides every token; only acceptance can drop, when the target writes a token the draft
could not propose.

The subset comes from the target's own choices: it reads held-out Spec-Bench prompts (the last
prompts of each category; `forerun bench --limit-per-category` reports on the first ones) and its
top-8 next tokens at every position are counted. Stop tokens are always in. The rest, up to N, are
the lowest token ids (BPE vocabularies number their tokens in merge order, roughly by frequency).
The choice is cached per target and size under FORERUN_HOME/draft-vocab/.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn
from tqdm import tqdm

from forerun.base.files import write_json
from forerun.base.paths import cache_dir
from forerun.models.gguf_format import GGUFLinear
from forerun.models.linear import Int8Linear, Linear
from forerun.models.load import LoadedModel, model_identity
from forerun.models.w8a8 import W8A8Linear

TOP = 8  # next-token choices counted per position
HELD_OUT_PER_CATEGORY = 2
MAX_PROMPT_TOKENS = 256
MAX_POSITIONS = 2048  # tokens read in all (~30 s for a 1.5B model in w8a8 on two cores)


def draft_vocabulary(target: LoadedModel, size: int, progress: bool = True) -> torch.Tensor | None:
    """Sorted token ids [size] the draft scores, or None when `size` covers the whole vocabulary
    (measured once per model and size, with a progress bar unless `progress` is False)."""
    vocab = target.decoder.cfg.vocab_size
    if size >= vocab:
        return None
    if size < 1:
        raise ValueError(f"a draft vocabulary needs at least one token, got {size}")
    identity = model_identity(target)
    path = cache_dir("draft-vocab") / f"{identity}-{size}.json" if identity else None
    if path is not None and path.is_file():
        try:
            ids = json.loads(path.read_text())["token_ids"]
            if len(ids) == size and all(0 <= i < vocab for i in ids):
                return torch.tensor(ids, dtype=torch.long)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache is measured again
    counts = target_choice_counts(target, calibration_prompts(target), progress)
    ids = choose(counts, size, sorted(target.tokenizer.stop_ids) if target.tokenizer else [])
    if path is not None:
        write_json(path, {"size": size, "top": TOP, "token_ids": ids.tolist()})
    return ids


def calibration_prompts(target: LoadedModel) -> list[list[int]]:
    """Token ids of held-out Spec-Bench prompts (chat-formatted when the target has a template)."""
    from forerun.base.prompts import SPEC_BENCH, load_prompts

    by_category: dict[str, list] = {}
    for prompt in load_prompts(SPEC_BENCH):
        by_category.setdefault(prompt.category, []).append(prompt)
    held_out = [p for prompts in by_category.values() for p in prompts[-HELD_OUT_PER_CATEGORY:]]
    tok = target.tokenizer
    if tok is None:
        return []
    chat = bool(getattr(tok.hf, "chat_template", None))
    encoded = [tok.apply_chat([{"role": "user", "content": p.text}]) if chat else tok.encode(p.text) for p in held_out]
    return [ids[:MAX_PROMPT_TOKENS] for ids in encoded]


def target_choice_counts(target: LoadedModel, prompts: list[list[int]], progress: bool = True) -> torch.Tensor:
    """How often each token is among the target's top-8 next tokens over `prompts`: [vocab]."""
    decoder = target.decoder
    counts = torch.zeros(decoder.cfg.vocab_size, dtype=torch.long)
    budget = MAX_POSITIONS
    with tqdm(
        total=min(budget, sum(map(len, prompts))),
        desc="choosing the draft vocabulary",
        unit="tok",
        file=sys.stderr,
        leave=False,
        disable=not progress,
    ) as bar:
        for ids in prompts:
            ids = ids[:budget]
            if not ids:
                break
            cache = decoder.new_cache(len(ids))
            logits = decoder.forward_ids(ids, cache).logits[0]  # [T, vocab]
            chosen = logits.topk(min(TOP, logits.shape[-1]), dim=-1).indices.flatten()
            counts.index_add_(0, chosen.cpu(), torch.ones_like(chosen, device="cpu"))
            budget -= len(ids)
            bar.update(len(ids))
    return counts


def choose(counts: torch.Tensor, size: int, always: list[int]) -> torch.Tensor:
    """`always`, then the most counted tokens, ties (and the uncounted) by lowest id; sorted [size]."""
    order = torch.argsort(-counts, stable=True)  # most counted first
    picked = list(dict.fromkeys([*always, *order.tolist()]))[:size]
    return torch.tensor(sorted(picked), dtype=torch.long)


# --- the reduced head ---------------------------------------------------------------------------------


def _rows_linear(head: Linear, ids: torch.Tensor) -> nn.Module:
    out = Linear(head.weight.shape[1], len(ids), bias=head.bias is not None)
    out.weight = nn.Parameter(head.weight.detach()[ids].clone(), requires_grad=False)
    if head.bias is not None:
        out.bias = nn.Parameter(head.bias.detach()[ids].clone(), requires_grad=False)
    return out


def _rows_int8(head: Int8Linear, ids: torch.Tensor) -> nn.Module:
    out = Int8Linear.__new__(Int8Linear)
    nn.Module.__init__(out)
    out.register_buffer("qweight", head.qweight[ids].clone())
    out.register_buffer("scale", head.scale[ids].clone())
    out.bias = None if head.bias is None else head.bias[ids].clone()
    return out


def _rows_w8a8(head: W8A8Linear, ids: torch.Tensor) -> nn.Module:
    return W8A8Linear(head.qweight()[ids], head.scale[ids], None if head.bias is None else head.bias[ids])


_ROWS = {
    Linear: _rows_linear,
    Int8Linear: _rows_int8,
    W8A8Linear: _rows_w8a8,
    GGUFLinear: lambda head, ids: head.take_rows(ids.cpu()),
}


def reduced_head(head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A copy of `head` scoring only the tokens `ids` (its output column j is token ids[j])."""
    try:
        return _ROWS[type(head)](head, ids.to(_device_of(head)))
    except KeyError:
        raise TypeError(f"cannot take rows of a {type(head).__name__} head") from None


def _device_of(module: nn.Module) -> torch.device:
    return next(iter([*module.parameters(), *module.buffers()]), torch.empty(0)).device
