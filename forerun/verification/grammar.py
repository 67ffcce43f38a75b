"""Structured outputs: which tokens a request's JSON schema, regular expression, choice or grammar
allows next, after its output and after each draft path a verification scores.

llguidance's matcher follows the text a token at a time. A verification row predicts the token after
output + its path, so the matcher takes the path, gives the row its allowed tokens, and rolls back:
each row is masked as plain decoding masks that position, and the acceptance rule stays exact. A
path that holds a token the text cannot take stops there; its parent's row refuses that token, so
no kept token is ever read from the rows below it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import numpy as np
import torch

from forerun.base.config import StructuredOutputsParams
from forerun.base.errors import FieldError, ForerunError

# As vLLM's guidance backend: JSON takes whitespace wherever JSON allows it, so the model keeps its
# own layout (and a drafter's guesses keep matching it).
_JSON_OPTIONS = {"whitespace_flexible": True}


@functools.lru_cache(maxsize=64)
def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for `spec`; FieldError when it cannot be one (its message llguidance's)."""
    from llguidance import LLMatcher

    try:
        if spec.json is not None:
            text = LLMatcher.grammar_from_json_schema(spec.json, defaults=_JSON_OPTIONS)
        elif spec.json_object:
            text = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        elif spec.regex is not None:
            text = LLMatcher.grammar_from_regex(spec.regex)
        elif spec.choice is not None:
            # JSON's string literals are Lark's: each choice spelled exactly, quotes and newlines escaped.
            text = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        else:
            text = LLMatcher.grammar_from_lark(spec.grammar)
    except ValueError as exc:
        raise FieldError("structured_outputs", f"the {spec.kind} cannot be followed: {exc}") from None
    failed, messages = LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        raise FieldError("structured_outputs", f"the {spec.kind} cannot be followed: {messages[0].strip()}")
    return text


def check(spec: StructuredOutputsParams, tokenizer, vocab: int) -> None:
    """Whether `spec` can be followed with this model's tokens (FieldError if not); makes the
    model's token table once (a second or two for a large vocabulary), so the engine's first
    request that needs it does not wait for it."""
    Grammar.start(spec, tokenizer, vocab)


class Grammar:
    """One output's place in its structured output."""

    def __init__(self, matcher, vocab: int) -> None:
        self.matcher = matcher
        self.vocab = vocab

    @classmethod
    def start(cls, spec: StructuredOutputsParams, tokenizer, vocab: int) -> Grammar:
        """At the start of an output. `tokenizer`: the model's (forerun.models.tokenizer.Tokenizer);
        `vocab`: the width of its logits."""
        from llguidance import LLMatcher

        if tokenizer is None:
            raise ForerunError(
                "a structured output needs the model's tokenizer to match text, and this model has none: "
                "leave out structured_outputs, or load the model with its tokenizer"
            )
        matcher = LLMatcher(_token_table(tokenizer, vocab), grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise FieldError("structured_outputs", f"the {spec.kind} cannot be followed: {matcher.get_error()}")
        return cls(matcher, vocab)

    def allowed(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """[len(paths), vocab] bool: the tokens the text allows after the output and each path."""
        rows = torch.ones(len(paths), self.vocab, dtype=torch.bool)
        for row, path in enumerate(paths):
            taken = self.matcher.try_consume_tokens(list(path)) if path else 0
            if taken == len(path):
                rows[row] = self._next()
            if taken:
                self.matcher.rollback(taken)
        return rows

    def advance(self, token: int) -> None:
        """The output grew by `token` (one the target's masked row gave)."""
        if not self.matcher.consume_token(int(token)):
            raise ForerunError(f"token {token} does not continue the structured output: {self.matcher.get_error()}")

    def _next(self) -> torch.Tensor:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # bit j of byte b: token 8b + j
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool))


@functools.lru_cache(maxsize=8)
def _token_table(tokenizer, vocab: int):
    """llguidance's view of the model's tokens: read from the tokenizers library's own description
    where llguidance knows its decoder (byte-level BPE, byte fallback), else from each token's bytes;
    the model's stop tokens end the text."""
    import llguidance
    import llguidance.hf

    stops = sorted(tokenizer.stop_ids)
    try:
        return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab, eos_token=stops)
    except ValueError:  # a decoder llguidance does not read: give it the bytes
        pass
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens(tokenizer)), n_vocab=vocab, eos_token=stops)


class _Tokens:
    """A tokenizer as llguidance's TokenizerWrapper reads one: every token's bytes, and text's tokens."""

    def __init__(self, tokenizer) -> None:
        self.hf = tokenizer.hf
        self.eos_token_id = min(tokenizer.stop_ids) if tokenizer.stop_ids else None
        self.bos_token_id = None
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(getattr(self.hf, "all_special_ids", []))

    def __call__(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))
