"""A thinking model's reasoning read apart from its answer, as vLLM's `--reasoning-parser` reads it:
the model writes its reasoning between `<think>` and `</think>` before the answer, and a chat
response gives that as `reasoning` and `reasoning_content` and the rest as `content`, whole or
streamed alike.

Two parsers, named as vLLM names them:
- `qwen3`: the reasoning is what a `<think>` at the start of the answer (after any whitespace)
  opens, up to `</think>`; an answer that does not open with `<think>` is all content (Qwen3 with
  thinking turned off, `chat_template_kwargs: {"enable_thinking": false}`).
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the answer starts inside it:
  the reasoning is everything up to `</think>` (a `<think>` at its start left out); an answer without
  `</think>` is all reasoning.
An answer cut inside its reasoning (by max_tokens) is reasoning up to the cut. What a reader gives
out depends on the text alone, not on how it arrived: a possible start of a tag is held until it is
one or cannot be.
"""

from __future__ import annotations

from forerun.base.errors import ForerunError

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def check_parser(name: str | None) -> str | None:
    """`name` where it is a parser's (or None), else a clear error naming them."""
    if name is not None and name not in PARSERS:
        raise ForerunError(f"--reasoning-parser {name!r} is none of {', '.join(PARSERS)}")
    return name


class ReasoningReader:
    """One answer's text, fed as it arrives, split into reasoning and content."""

    def __init__(self, parser: str) -> None:
        self.parser = check_parser(parser)
        self.state = "start"  # start: not yet known whether it opens with <think>; inside; after
        self.held = ""  # text not given out yet

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` adds and that can no longer change."""
        self.held += text
        reasoning = ""
        while self.state == "start":
            lead = self.held.lstrip()
            if lead.startswith(OPEN):
                self.held, self.state = lead[len(OPEN) :], "inside"
            elif OPEN.startswith(lead):
                return "", ""  # whitespace, or part of <think>: not known yet
            else:
                self.state = "inside" if self.parser == "deepseek_r1" else "after"
        if self.state == "inside":
            at = self.held.find(CLOSE)
            if at < 0:
                keep = _tag_start(self.held, CLOSE)
                reasoning, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return reasoning, ""
            reasoning, self.held, self.state = self.held[:at], self.held[at + len(CLOSE) :], "after"
        content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held, once the answer is whole: (reasoning, content)."""
        held, self.held = self.held, ""
        reasoning = self.state == "inside" or (self.state == "start" and self.parser == "deepseek_r1")
        return (held, "") if reasoning else ("", held)


def split(parser: str, text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    reader = ReasoningReader(parser)
    reasoning, content = reader.feed(text)
    rest_reasoning, rest_content = reader.finish()
    return reasoning + rest_reasoning, content + rest_content


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
