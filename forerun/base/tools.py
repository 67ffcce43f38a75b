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
JSON without the tags (bare or in a ```json block: what small models such as the default pair's
often write), is that call too. A forced call (tool_choice "required" or a named function) is a structured
output in this same format (`verification.grammar.tool_call_grammar`).
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
    and which the answer may or must call: "none", "auto", "required", or one function's name."""

    tools: tuple[dict, ...]
    choice: str
    parallel: bool = True  # "required" may write several calls (a named function is called once)

    @property
    def forced(self) -> bool:
        """The answer is calls and nothing else (a grammar holds it to them)."""
        return self.choice not in ("none", "auto")

    @property
    def functions(self) -> list[dict]:
        """The functions the answer may call: every one, or the one named."""
        named = [t["function"] for t in self.tools if t["function"]["name"] == self.choice]
        return named or [t["function"] for t in self.tools]


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
    return ToolChoice(checked, _choice(choice, names), parallel is not False)


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


def _choice(choice: object, names: list[str]) -> str:
    """tool_choice as a word or the named function's name (auto when not given, as OpenAI's)."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice in ("none", "auto", "required"):
            return choice
        raise FieldError("tool_choice", f"tool_choice must be none, auto, required or a function, got {_shown(choice)}")
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise FieldError(
            "tool_choice", 'tool_choice names a function as {"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise FieldError("tool_choice", f"tool_choice names {_shown(name)}, which tools does not list")
    return name


def _shown(value: object) -> str:
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
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


class CallReader:
    """An answer's text, fed as it arrives, read into content and calls. Text that may still turn
    out to open a call (a prefix of its tag) or to lie beside one (whitespace) is held until it
    cannot; so the content streamed and the content of the whole answer are the same text.

    Given the offered functions' `names`, an answer that is one call alone, without the tags (the
    JSON object bare or in a ```json block, as small models often answer), is that call: such an
    answer is held while it may still be one (it opens with `{` or a fence) and read when whole."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.calls: list[Call] = []
        self._names = frozenset(names)
        self._whole: str | None = "" if names else None  # the answer so far, while it may be a bare call
        self._pending = ""  # text not yet given out
        self._inside = False  # after a call's opening tag, before its closing one
        self._after_call = False  # whitespace here lies beside a call
        self._gap = ""  # the whitespace dropped before the open call's tag (its text if it is no call)

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content and the calls that `text` completes."""
        if self._whole is not None:
            self._whole += text
            if _bare(self._whole, self._names) is not _NOT:
                return "", []
            text, self._whole = self._whole, None
        return self._read(text)

    def finish(self) -> tuple[str, list[Call]]:
        """The content and calls still held once the answer is done: a bare call, a tag's prefix,
        trailing whitespace, or a call never closed (a cut answer: content)."""
        if self._whole is None:
            return self._rest(), []
        whole, self._whole = self._whole, None
        call = _bare(whole, self._names)
        if isinstance(call, Call):
            self.calls.append(call)
            return "", [call]
        content, calls = self._read(whole)
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
                    content.append(self._gap + CALL_OPEN + block + CALL_CLOSE)
                    self._after_call = False
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
        return rest.lstrip() if self._after_call else rest

    def _release(self, upto: int, before_call: bool = False) -> str:
        """`_pending[:upto]` given out as content, whitespace beside a call dropped."""
        text, self._pending = self._pending[:upto], self._pending[upto:]
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if not before_call:
            return text
        kept = text.rstrip()
        self._gap = text[len(kept) :]
        return kept


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


def _bare(text: str, names: frozenset[str]) -> Call | str:
    """An answer so far as one call without tags: the Call it is (a JSON object of an offered
    function's name and arguments, alone or in one ```json block), _MAYBE while it may yet be one,
    _NOT once it cannot (never one again, however the text goes on)."""
    body = text.lstrip()
    fenced = body.startswith("`")
    if fenced:
        opener = _FENCE.match(body)
        if opener is None:
            return _MAYBE if "\n" not in body and _FENCE_START.fullmatch(body) else _NOT
        body = body[opener.end() :]
    body = body.lstrip()
    if not body:
        return _MAYBE
    if body[0] != "{":
        return _NOT
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return _MAYBE
    after = body[end:].strip()
    if after and not (fenced and "```".startswith(after)):
        return _NOT
    call = _call(value)
    if call is None or call.name not in names or set(value) - {"name", "arguments", "parameters"}:
        return _NOT
    return call


_FENCE = re.compile(r"```(?:json)?[ \t]*\n")
_FENCE_START = re.compile(r"`{1,3}(?:j(?:s(?:o(?:n)?)?)?)?[ \t]*")  # a fence's opening not yet whole


def _parsed(block: str) -> Call | None:
    """The call a block's JSON makes ({"name", "arguments"}), None when it makes none."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    return _call(value)


def _call(value: object) -> Call | None:
    """The call a JSON value makes, None when it makes none."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(value["name"], json.dumps(arguments, ensure_ascii=False))
