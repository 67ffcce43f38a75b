"""Tool calling: the functions a chat offers the model and how it may call them, checked; and the
calls read back from the answer's text, whole or as it streams.

The chat template shows the model the functions and how to call one. Qwen's and Hermes' templates
(the format read here, as vLLM's `hermes` parser reads it) have the model write each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Reading is one rule, whole or streamed (`CallReader`): a block that holds a call's JSON becomes a
call; all other text is the message's content, a block that does not parse among it, and whitespace
beside a call is dropped. An answer that is one call of an offered function and nothing else, its
JSON without the tags (bare or in a ```json block, as the default target writes it), is that call
too. A forced call (tool_choice "required" or a named function) is a structured output in this same
format (`verification.grammar.tool_call_grammar`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from forerun.base.errors import FieldError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # most functions one request may offer (OpenAI's limit)
_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")


@dataclass(frozen=True)
class ToolChoice:
    """The functions offered (as the chat template reads them: {"type": "function", "function": {...}})
    and which the answer may or must call: `choice` "none", "auto", "required", or "function" (the
    one function `name`)."""

    tools: tuple[dict, ...]
    choice: str
    parallel: bool = True  # "required" may write several calls (a named function is called once)
    name: str | None = None  # the function a "function" choice calls

    @property
    def forced(self) -> bool:
        """The answer is calls and nothing else (a grammar holds it to them)."""
        return self.choice in ("required", "function")

    @property
    def functions(self) -> list[dict]:
        """The functions the answer may call: every one, or the one named."""
        offered = [t["function"] for t in self.tools]
        return [f for f in offered if f["name"] == self.name] if self.choice == "function" else offered

    @property
    def described(self) -> str:
        """The choice as a message names it: 'required', or function 'get_weather'."""
        return f"function {self.name!r}" if self.choice == "function" else repr(self.choice)


def tool_choice(tools: object, choice: object = None, parallel: object = None) -> ToolChoice | None:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` checked; None when no tools are
    offered. FieldError names the field that is wrong and says what to send."""
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", f"parallel_tool_calls must be true or false, got {_shown(parallel)}")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise FieldError("tool_choice", f"tool_choice {_shown(choice)} needs tools: list the functions it may call")
        return None
    if not isinstance(tools, list):
        raise FieldError("tools", 'tools must be a list of {"type": "function", "function": {"name": ...}} objects')
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"tools lists {len(tools)} functions; give at most {MAX_TOOLS}")
    checked = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise FieldError("tools", f"tools names the function {twice!r} twice; give each function once")
    word, name = _choice(choice, names)
    return ToolChoice(checked, word, parallel is not False, name)


def _tool(tool: object, i: int) -> dict:
    """One entry of `tools`: a function with a valid name, a text description and an object schema."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        shape = '{"type": "function", "function": {"name": ..., "parameters": ...}}'
        raise FieldError("tools", f"{where} must be {shape}")
    unknown = sorted(set(tool) - {"type", "function"})
    if unknown:
        raise FieldError("tools", f"{where} has an unknown field {_shown(unknown[0])}: it takes type and function")
    function = tool["function"]
    unknown = sorted(set(function) - set(_FUNCTION_FIELDS))
    if unknown:
        fields = ", ".join(_FUNCTION_FIELDS)
        raise FieldError("tools", f"{where}.function has an unknown field {_shown(unknown[0])}: it takes {fields}")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise FieldError("tools", f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {_shown(name)}")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise FieldError("tools", f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not (isinstance(parameters, dict) and parameters.get("type", "object") == "object"):
        raise FieldError("tools", f"{where}.function.parameters must be a JSON schema of an object (its arguments)")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise FieldError("tools", f"{where}.function.strict must be true or false")
    return tool


def _choice(choice: object, names: list[str]) -> tuple[str, str | None]:
    """tool_choice as its word and the named function's name (auto when not given, as OpenAI's)."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice in ("none", "auto", "required"):
            return choice, None
        raise FieldError("tool_choice", f"tool_choice must be none, auto, required or a function, got {_shown(choice)}")
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise FieldError(
            "tool_choice", 'tool_choice names a function as {"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise FieldError("tool_choice", f"tool_choice names {_shown(name)}, which tools does not list")
    return "function", name


def _shown(value: object) -> str:
    """`value` as a message quotes it: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- reading calls ---------------------------------------------------------------------------------


@dataclass
class Call:
    """One call read from an answer: OpenAI's tool_calls entry."""

    name: str
    arguments: str  # a JSON object, as OpenAI gives it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def shaped(self, index: int | None = None) -> dict:
        """OpenAI's tool_calls entry; with `index`, a streamed delta's (which numbers the calls)."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


class CallReader:
    """An answer's text, fed as it arrives, read into content and calls. Text that may still turn
    out to open a call (a prefix of its tag) or to lie beside one (whitespace) is held until it
    cannot; so the content streamed and the content of the whole answer are the same text. A call
    is cut out of the text with the whitespace on both its sides; where text stands on both sides,
    the whitespace before the first call of the run stays between them.

    Given the offered functions' `names`, an answer that is one call alone, without the tags (the
    JSON object bare or in a ```json block, as small models often answer), is that call: such an
    answer is held while it may still be one (it opens with `{` or a fence) and read when whole."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.calls: list[Call] = []
        self._bare: _BareCall | None = _BareCall(frozenset(names)) if names else None  # while it may be one
        self._pending = ""  # text not yet given out
        self._inside = False  # after a call's opening tag, before its closing one
        self._after_call = False  # whitespace here lies beside a call
        self._gap = ""  # the whitespace dropped before the open call's tag (its text if it is no call)
        self._between = ""  # the whitespace before the latest run of calls: kept if text follows them
        self._given = False  # some content is out: text after a call needs what stood between

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content and the calls that `text` completes."""
        if self._bare is not None:
            if self._bare.feed(text) is not _NOT:
                return "", []
            text, self._bare = self._bare.text, None
        return self._read(text)

    def finish(self) -> tuple[str, list[Call]]:
        """The content and calls still held once the answer is done: a bare call, a tag's prefix,
        trailing whitespace, or a call never closed (a cut answer: content)."""
        if self._bare is None:
            return self._rest(), []
        bare, self._bare = self._bare, None
        call = bare.feed("")
        if isinstance(call, Call):
            self.calls.append(call)
            return "", [call]
        content, calls = self._read(bare.text)
        return content + self._rest(), calls

    def _read(self, text: str) -> tuple[str, list[Call]]:
        """Content and calls of `text`, read on from where the answer's text stands (tags)."""
        self._pending += text
        content, calls = [], []
        while True:
            if self._inside:
                end = self._pending.find(CALL_CLOSE)
                if end < 0:
                    break
                block, self._pending = self._pending[:end], self._pending[end + len(CALL_CLOSE) :]
                self._inside = False
                call = _parsed(block)
                if call is None:  # not a call: the block stays text, as written
                    content.append(self._out(self._gap + CALL_OPEN + block + CALL_CLOSE))
                else:
                    calls.append(call)
                    self._after_call = True
                continue
            start = self._pending.find(CALL_OPEN)
            if start < 0:
                content.append(self._release(_held(self._pending)))
                break
            content.append(self._release(start, before_call=True))
            self._pending, self._inside = self._pending[len(CALL_OPEN) :], True
        self.calls += calls
        return "".join(content), calls

    def _rest(self) -> str:
        rest = self._gap + CALL_OPEN + self._pending if self._inside else self._pending
        self._pending, self._inside = "", False
        return self._out(rest.lstrip() if self._after_call else rest)

    def _release(self, upto: int, before_call: bool = False) -> str:
        """`_pending[:upto]` given out as content, whitespace beside a call dropped."""
        text, self._pending = self._pending[:upto], self._pending[upto:]
        if self._after_call:
            text = text.lstrip()
        if not before_call:
            return self._out(text)
        kept = text.rstrip()
        self._gap = text[len(kept) :]
        out = self._out(kept)
        if not self._after_call:  # this call begins a run: text after the run gets what stood before it
            self._between = self._gap
        return out

    def _out(self, text: str) -> str:
        """`text` as content: after calls, led by the whitespace before them where content came before."""
        if not text:
            return ""
        if self._after_call and self._given:
            text = self._between + text
        self._after_call, self._given = False, True
        return text


def _held(text: str) -> int:
    """How much of `text` may be given out now: all but a trailing prefix of CALL_OPEN and the
    whitespace before it (either may yet lie beside a call)."""
    keep = len(text)
    for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(CALL_OPEN[:size]):
            keep -= size
            break
    return len(text[:keep].rstrip())


_NOT, _MAYBE = "not a call", "maybe a call"  # what an answer so far is, besides a bare call


class _BareCall:
    """Whether an answer so far is one call without tags (a JSON object of an offered function's name
    and arguments, alone or in one ```json block), decided as its text arrives: the object's
    brackets and strings are scanned once, a character at a time, and it is parsed once it closes.
    `feed` says the Call it is, _MAYBE while it may yet be one, or _NOT once it cannot be (for
    good, however the text goes on)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.text = ""
        self.fenced = False
        self.start: int | None = None  # where the object opens
        self.end: int | None = None  # just past where it closes
        self.call: Call | None = None
        self._scanned, self._depth, self._in_string, self._escaped = 0, 0, False, False

    def feed(self, text: str) -> Call | str:
        self.text += text
        if self.start is None:
            opening = self._opening()
            if opening is not None:
                return opening
        if self.end is None:
            self._scan()
            if self.end is None:
                return _MAYBE
            self.call = self._parsed()
        if self.call is None:
            return _NOT
        after = self.text[self.end :].strip()
        return _NOT if after and not (self.fenced and "```".startswith(after)) else self.call

    def _opening(self) -> str | None:
        """Finds the object's `{` after whitespace and an optional fence; _MAYBE or _NOT until then."""
        body = self.text.lstrip()
        at = len(self.text) - len(body)
        if body.startswith("`"):
            fence = _FENCE.match(body)
            if fence is None:
                return _MAYBE if "\n" not in body and _FENCE_START.fullmatch(body) else _NOT
            self.fenced = True
            at += fence.end()
            body = body[fence.end() :]
        rest = body.lstrip()
        if not rest:
            return _MAYBE
        if rest[0] != "{":
            return _NOT
        self.start = self._scanned = at + len(body) - len(rest)
        return None

    def _scan(self) -> None:
        """Reads on from where the last scan stopped until the object closes (`end`) or the text ends."""
        text = self.text
        for i in range(self._scanned, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end = i + 1
                    return
        self._scanned = len(text)

    def _parsed(self) -> Call | None:
        value = _json(self.text[self.start : self.end])
        call = _call(value)
        if call is None or call.name not in self.names or set(value) - {"name", "arguments", "parameters"}:
            return None
        return call


_FENCE = re.compile(r"```(?:json)?[ \t]*\n")
_FENCE_START = re.compile(r"`{1,3}(?:j(?:s(?:o(?:n)?)?)?)?[ \t]*")  # a fence's opening not yet whole
_NO_VALUE = object()


def _json(text: str) -> object:
    """`text`'s JSON value; _NO_VALUE when it is none (or nested past what Python parses, or holds
    NaN or Infinity, which Python reads but JSON has not: a client's parser would refuse them)."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return _NO_VALUE


def _not_json(constant: str) -> object:
    raise ValueError(f"{constant} is not JSON")


def _parsed(block: str) -> Call | None:
    """The call a block's JSON makes ({"name", "arguments"}), None when it makes none."""
    return _call(_json(block))


def _call(value: object) -> Call | None:
    """The call a JSON value makes, None when it makes none (or one that UTF-8 cannot carry: a lone
    surrogate spelled as a JSON escape)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _json(arguments)
    if not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False)
        (value["name"] + text).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        return None
    return Call(value["name"], text)
