"""A conversation as given (OpenAI's {"role", "content"} messages) checked and put in the form a chat
template reads: the server's requests and the Python API's `LLM.chat` check it the same way."""

from __future__ import annotations

from forerun.base.errors import ForerunError

ROLES = {"system", "user", "assistant", "tool", "developer"}  # developer: OpenAI's newer name for system


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
        if not isinstance(content, str):
            raise ForerunError(f"messages[{i}].content must be a string (or a list of text parts)")
        turns.append({"role": "system" if role == "developer" else role, "content": content})
    return turns


def _text_parts(parts: list, i: int) -> str:
    """A message's content given as parts: their texts, joined."""
    if not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
        raise ForerunError(f"messages[{i}].content: only text parts are supported")
    for j, p in enumerate(parts):
        if not isinstance(p.get("text"), str):
            raise ForerunError(f"messages[{i}].content[{j}].text must be a string")
    return "".join(p["text"] for p in parts)
