"""One request's output as it grows: stop tokens, stop strings, max_tokens, and streamable text."""

from __future__ import annotations

import warnings

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.models.tokenizer import Tokenizer
from forerun.verification.grammar import Grammar
from forerun.verification.verify import Past


class Sequence:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        stop_ids: frozenset[int],
        grammar: Grammar | None = None,
    ) -> None:
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.tokenizer = tokenizer
        # The model's stop tokens (none with ignore_eos), and the request's own (`stop_token_ids`).
        self.stop_ids = (frozenset() if params.ignore_eos else stop_ids) | frozenset(params.stop_token_ids)
        self.finish_reason: str | None = None
        # vLLM's: the stop string or the request's stop token id that ended it (None: anything else)
        self.stop_reason: str | int | None = None
        self.grammar = grammar  # a structured output's place, at output_ids
        self.text = ""  # decoded output, cut before a stop string (after it, with include_stop_str_in_output)
        self._streamed = 0  # characters of `text` already handed out
        self._stops_from = 0  # text before min_tokens' last token: a stop string must end past it
        # The output decoded a token at a time (None: decoded whole after every token); a trailing
        # part of a character waits in it, and the finished text is one whole decode.
        self._stream = tokenizer.stream(params.skip_special_tokens) if tokenizer is not None else None
        if params.stop and tokenizer is None:
            raise ForerunError(
                "stop strings need a tokenizer to match text, and this model has none: "
                "leave out stop, or load the model with its tokenizer"
            )

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        """len(context), without building it: the position of the next token."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def past(self) -> Past | None:
        """What verification needs of this sequence where its logits are adjusted (bias, penalties)."""
        if not self.params.adjusts:
            return None
        return Past(self.prompt_ids, self.output_ids, tuple(self.stop_ids), self.grammar)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> bool:
        """Add one token; returns True when it ends the sequence (then nothing more may be appended)."""
        self.output_ids.append(token)
        if self.grammar is not None:
            self.grammar.advance(token)
        own = token in self.params.stop_token_ids
        if token in self.stop_ids and not own:
            self.finish_reason = "stop"
            self._whole_text(self.output_ids[:-1])  # the model's stop token is no text
        elif self.tokenizer is not None:
            if self._stream is not None:
                self.text += self._stream.step(token)
            else:
                self.text = self.tokenizer.decode(self.output_ids, self.params.skip_special_tokens)
            self._check_stop_strings()
        if own and self.finish_reason is None:  # the request's stop token: its text kept, as in vLLM
            self.finish_reason, self.stop_reason = "stop", token
            self._whole_text(self.output_ids)
        if self.finish_reason is None and len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
            self._whole_text(self.output_ids)
        return self.finished

    def _whole_text(self, ids: list[int]) -> None:
        """A streamed output's finished text as one decode of `ids` (a last part of a character
        shows as the whole decode renders it); text cut at a stop string is final as it is."""
        if self._stream is None:
            return  # decoded whole already
        whole = self.tokenizer.decode(ids, self.params.skip_special_tokens)
        if not whole.startswith(self.text[: self._streamed]):
            # Streamed text is never taken back; a tokenizer whose stream strays is not streamed again.
            warnings.warn(
                "the incremental decode differed from a whole decode; decoding whole from now on", stacklevel=3
            )
            self.tokenizer.streams = False
        self.text = whole

    def _check_stop_strings(self) -> None:
        # Only the tail can hold a new match: the text before it was checked at the last token.
        longest = max((len(s) for s in self.params.stop), default=0)
        if len(self.output_ids) < self.params.min_tokens:
            self._stops_from = len(self.text)  # no stop string yet, nor one that ends in this text
            return
        tail_from = max(0, self._streamed - longest)
        # A match must end past the text written before min_tokens: each string from its own start.
        found = ((self.text.find(s, max(tail_from, self._stops_from - len(s) + 1)), s) for s in self.params.stop)
        hits = [(i, len(s), s) for i, s in found if i >= 0]
        if hits:
            at, length, stop = min(hits)  # the first to start (and of those, to end)
            self.text = self.text[: at + (length if self.params.include_stop_str_in_output else 0)]
            self.finish_reason, self.stop_reason = "stop", stop

    def take_text(self) -> str:
        """Text not handed out yet that can no longer change: unfinished UTF-8 and a possible
        stop-string prefix stay back until the sequence ends."""
        end = len(self.text)
        if not self.finished:
            if self.text.endswith("\ufffd"):
                end = len(self.text.rstrip("\ufffd"))
            for s in self.params.stop:
                for n in range(min(len(s) - 1, end), 0, -1):
                    if self.text[:end].endswith(s[:n]):
                        end -= n
                        break
        end = max(end, self._streamed)
        piece = self.text[self._streamed : end]
        self._streamed = end
        return piece
