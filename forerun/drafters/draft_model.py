"""A smaller model of the same family drafts K tokens autoregressively with its own KV cache."""
from __future__ import annotations

import warnings

import torch

from forerun.config import SamplingParams
from forerun.drafters import register
from forerun.errors import ForerunError
from forerun.kv_cache import KVCache
from forerun.models.linear import quantize_int8_
from forerun.models.load import LoadedModel, load_model
from forerun.models.tokenizer import Tokenizer
from forerun.sampling import probabilities, sample
from forerun.tree import DraftTree


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Draft and target must agree token for token; say exactly where they differ."""
    t_rows, d_rows = target.decoder.cfg.vocab_size, draft.decoder.cfg.vocab_size
    if t_rows != d_rows:
        raise ForerunError(f"draft {draft.name} has {d_rows} vocabulary rows, target {target.name} has {t_rows}; "
                           "speculation needs the same tokenizer: pick a draft of the same model family")
    if target.tokenizer is None or draft.tokenizer is None:
        return
    _compare_tokenizers(target.tokenizer, draft.tokenizer, target.name, draft.name)


def _compare_tokenizers(t: Tokenizer, d: Tokenizer, t_name: str, d_name: str) -> None:
    tv, dv = t.vocabulary(), d.vocabulary()
    for i in sorted(set(tv) | set(dv)):
        if tv.get(i) != dv.get(i):
            raise ForerunError(f"draft and target tokenizers differ at id {i}: target {t_name} has {tv.get(i)!r}, "
                               f"draft {d_name} has {dv.get(i)!r}; pick a draft with the target's tokenizer")
    if t.stop_ids != d.stop_ids:
        raise ForerunError(f"draft and target stop tokens differ: target {sorted(t.stop_ids)}, "
                           f"draft {sorted(d.stop_ids)}")


@register("draft")
class DraftModelDrafter:
    def __init__(self, target: LoadedModel, model: str | LoadedModel, dtype: str = "bfloat16",
                 device: str | None = None, quantize: str | None = None, min_confidence: float = 0.0) -> None:
        """`quantize="int8"` stores the draft's weights in int8 (half the bytes per draft token);
        `min_confidence` ends a draft early once the draft's top probability falls below it."""
        if quantize not in (None, "int8"):
            raise ForerunError(f"unknown draft quantization {quantize!r}; use int8 or leave it out")
        if isinstance(model, LoadedModel):
            self.model = model
            if quantize:
                quantize_int8_(self.model.decoder)
        else:
            self.model = load_model(model, dtype, device or str(target.decoder.device), quantization=quantize)
        check_same_vocabulary(target, self.model)
        if _num_weights(self.model.decoder) > _num_weights(target.decoder):
            warnings.warn(f"draft {self.model.name} is larger than target {target.name}: "
                          "speculation will likely be slower than plain decoding", stacklevel=2)
        self.min_confidence = min_confidence
        self.cache: KVCache | None = None
        self.fed: list[int] = []   # tokens whose keys/values sit in self.cache, in order

    def start(self, prompt_ids: list[int], target_cache: KVCache, max_len: int) -> None:
        self.cache = self.model.decoder.new_cache(max_len)
        self.fed = []

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        decoder, cache = self.model.decoder, self.cache
        # Roll back to what the context still agrees with (drops rejected drafts), then catch up.
        keep = min(_common_prefix(self.fed, context), len(context) - 1)
        cache.truncate(keep)
        self.fed = self.fed[:keep]
        pending = context[keep:]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for _ in range(k):
            ids = torch.tensor(pending, device=decoder.device)
            pos = torch.arange(len(self.fed), len(self.fed) + len(pending), device=decoder.device)
            logits = decoder(ids, pos, cache, last_only=True).logits[0]            # [1, V]
            self.fed += pending
            q = probabilities(logits, params)                                       # [1, V]
            token = int(q.argmax()) if params.greedy else int(sample(q, generator)[0])
            tokens.append(token)
            probs.append(q[0])
            pending = [token]
            if self.min_confidence and float(logits.softmax(-1).max()) < self.min_confidence:
                break
        return DraftTree.chain(tokens, None if params.greedy else torch.stack(probs))

    def observe(self, num_accepted: int, aux_logits: torch.Tensor | None = None) -> None:
        pass  # the next propose() rolls back by comparing contexts


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _num_weights(module: torch.nn.Module) -> int:
    """Weights in any format: parameters and int8 buffers alike."""
    return sum(t.numel() for t in [*module.parameters(), *module.buffers()])
