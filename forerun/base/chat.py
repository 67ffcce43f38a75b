"""A conversation as given (OpenAI's {"role", "content"} messages) checked and put in the form a chat
template reads: the server's requests and the Python API's `LLM.chat` check it the same way."""

from __future__ import annotations

import json

from forerun.base.errors import ForerunError

ROLES = {"system", "user", "assistant", "tool", "developer"}  # developer: OpenAI's newer name for system
# A message's fields beside role and content that go on to the chat template as given (OpenAI's
# participant name, a tool result's call id, an answer's reasoning as vLLM's reasoning parsers give
# it: Qwen3's template shows the reasoning of the turns since the last user message).
PASSED = ("name", "tool_call_id", "reasoning_content")
REASONING = ("reasoning_content",)  # passed where it holds text, dropped where empty
RENAMED = {"reasoning": "reasoning_content"}  # vLLM's newer name for an answer's reasoning
# Fields of an answer's message that a client sends back with the conversation: taken while they
# are empty (null, "" or []), refused by name when they ask for something (forerun gives none of them).
EMPTY_ONLY = ("function_call", "refusal", "audio", "annotations")


def chat_turns(messages: object) -> list[dict]:
    """[{"role", "content": str}] from `messages`; content given as text parts is joined, and a
    developer turn is a system turn. A clear error names the message and field that are wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ForerunError('messages must be a non-empty list of {"role", "content"} objects')
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ForerunError(f"messages[{i}] must be an object with a 'role' and a 'content'")
        role = m["role"]
        if role not in ROLES:
            raise ForerunError(f"messages[{i}].role {role[:40]!r} is not one of {', '.join(sorted(ROLES))}")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = _text_parts(content, i)
        calls = _tool_calls(m.get("tool_calls"), i)
        if calls and role != "assistant":
            raise ForerunError(f"messages[{i}] is the {role}'s: only an assistant's message holds tool_calls")
        if content is None and calls:  # an answer that only called tools, as OpenAI sends it back
            content = ""
        if not isinstance(content, str):
            raise ForerunError(f"messages[{i}].content must be a string (or a list of text parts)")
        turn = {"role": "system" if role == "developer" else role, "content": content}
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn | _other_fields(m, i))
    return turns


def _tool_calls(calls: object, i: int) -> list[dict] | None:
    """An assistant message's tool_calls as the chat template reads them: each call's arguments
    (OpenAI's JSON text) as the object they spell, as vLLM hands them on."""
    if calls in (None, []):
        return None
    shape = 'tool_calls must be a list of {"id", "type": "function", "function": {"name", "arguments"}}'
    if not isinstance(calls, list):
        raise ForerunError(f"messages[{i}].{shape}")
    read = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id", ""), str)
        ):
            raise ForerunError(f"messages[{i}].{shape}; tool_calls[{j}] is not")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (ValueError, RecursionError):  # not JSON, or nested past what Python parses
            arguments = None
        if not isinstance(arguments, dict):
            raise ForerunError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object (as text)")
        read.append({**call, "function": {**function, "arguments": arguments}})
    return read


def _other_fields(message: dict, i: int) -> dict:
    """A message's fields beside role and content: PASSED ones (strings) for the template (an
    answer's `reasoning` as `reasoning_content`), EMPTY_ONLY ones and empty reasoning dropped; any
    other refused by name."""
    passed = {}
    for given, value in message.items():
        name = RENAMED.get(given, given)
        if name in ("role", "content", "tool_calls") or (name in EMPTY_ONLY + REASONING and value in (None, "", [])):
            continue
        if name in EMPTY_ONLY:
            raise ForerunError(
                f"messages[{i}].{name} is not supported (this server takes text and tool calls only); "
                "leave it out or send it empty"
            )
        if name not in PASSED:
            raise ForerunError(
                f"messages[{i}] has an unknown field {name[:40]!r}: a message takes role, content, {', '.join(PASSED)}"
            )
        if not isinstance(value, str):
            raise ForerunError(f"messages[{i}].{given} must be a string")
        if passed.get(name, value) != value:  # both names, as an answer gives them back: the same text
            raise ForerunError(f"messages[{i}] gives a reasoning and a reasoning_content that differ: send one")
        passed[name] = value
    return passed


def _text_parts(parts: list, i: int) -> str:
    """A message's content given as parts: their texts, joined."""
    if not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
        raise ForerunError(f"messages[{i}].content: only text parts are supported")
    for j, p in enumerate(parts):
        if not isinstance(p.get("text"), str):
            raise ForerunError(f"messages[{i}].content[{j}].text must be a string")
    return "".join(p["text"] for p in parts)
