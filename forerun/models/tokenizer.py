"""Tokenizer and chat template (from transformers), plus every token id that ends generation."""

from __future__ import annotations

from collections.abc import Sequence

from forerun.base.errors import ForerunError

# Special tokens that end a turn or a document in the common families; llama.cpp stops on the same.
_STOP_TEXTS = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>", "<|EOT|>"}


class Tokenizer:
    def __init__(self, hf_tokenizer, extra_stop_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        stops = {int(i) for i in extra_stop_ids}
        if hf_tokenizer.eos_token_id is not None:
            stops.add(int(hf_tokenizer.eos_token_id))
        # Only special (added) tokens count: "</s>" can be an ordinary piece of text in a BPE vocabulary.
        for token_id, token in getattr(hf_tokenizer, "added_tokens_decoder", {}).items():
            if str(token) in _STOP_TEXTS:
                stops.add(int(token_id))
        self.stop_ids: frozenset[int] = frozenset(stops)
        self._pieces: dict[int, str] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        """One token's own text, special tokens included (logprobs name tokens by it)."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.hf.decode([token_id], skip_special_tokens=False)
        return text

    def apply_chat(self, messages: list[dict]) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise ForerunError("this model has no chat template; pass a plain prompt instead of messages (drop --chat)")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.hf.encode(text, add_special_tokens=False))

    def vocabulary(self) -> dict[int, str]:
        """id -> token string, for comparing two tokenizers."""
        return {i: t for t, i in self.hf.get_vocab().items()}
