"""What a chat template can show the model, found as llama.cpp's server reports it (/props'
`chat_template_caps`): the template is rendered with probe conversations and each capability is read
from whether the probe's marker reaches the text. llama.cpp watches instead which values its own
template engine reads; the two agree where a template prints what it reads (on the embedded target's
template they give the same answer: `tests/test_model_card.py`), and a value read but never printed
(a condition on it alone) counts here as not shown. A probe the template refuses (its
`raise_exception`, or an error on a value of the wrong shape) counts as that capability missing, as
in llama.cpp.
"""

from __future__ import annotations

import json

# Capabilities a template has until a probe shows otherwise, and those it lacks until one shows it has them.
ASSUMED = ("supports_tools", "supports_tool_calls", "supports_system_role", "supports_parallel_tool_calls")
SHOWN = ("supports_preserve_reasoning", "supports_reasoning_effort", "supports_typed_content")
OFFERED, CALLED, SECOND = "fr_probe_offered", "fr_probe_called", "fr_probe_called_again"
ARGUMENT = "FR_PROBE_ARGUMENT"
THINKING = {"enable_thinking": True}
PRESERVING = THINKING | {
    "preserve_thinking": True,
    "clear_thinking": False,
    "truncate_history_thinking": False,
    "drop_thinking": False,
}


def template_caps(render) -> dict[str, bool]:
    """llama.cpp's `chat_template_caps` of the template `render` applies: `render(messages, tools,
    variables)` gives the template's text, or raises where the template refuses them."""

    def text(messages: list[dict], tools: list[dict] | None = None, variables: dict | None = None) -> str | None:
        try:
            return render(messages, tools, variables or {})
        except Exception:  # a template's own refusal or its error on a probe: the capability is missing
            return None

    caps = dict.fromkeys(ASSUMED, True) | dict.fromkeys(SHOWN, False)
    caps["supports_object_arguments"] = False
    shown = text([_user("FR_PROBE_STRING")])
    caps["supports_string_content"] = shown is not None and "FR_PROBE_STRING" in shown
    typed = text([{"role": "user", "content": [{"type": "text", "text": "FR_PROBE_TYPED"}]}])
    # A template printing the list as it is shows the marker inside the list's own text: not typed content.
    caps["supports_typed_content"] = typed is not None and "FR_PROBE_TYPED" in typed and "'text'" not in typed
    system = text([{"role": "system", "content": "FR_PROBE_SYSTEM"}, _user("hi")])
    caps["supports_system_role"] = system is not None and "FR_PROBE_SYSTEM" in system

    calls = text(_tool_conversation([CALLED], {"arg": ARGUMENT}), [_tool()])
    if calls is not None:
        caps["supports_tools"] = OFFERED in calls
        caps["supports_tool_calls"] = CALLED in calls
        # Arguments printed as the mapping's own text (its repr, not JSON) are not taken as an object.
        caps["supports_object_arguments"] = caps["supports_tool_calls"] and ARGUMENT in calls and "'arg'" not in calls
    if not caps["supports_object_arguments"]:
        calls = text(_tool_conversation([CALLED], json.dumps({"arg": ARGUMENT})), [_tool()])
        if calls is None:
            caps["supports_tools"] = caps["supports_tool_calls"] = False
        else:
            caps["supports_tools"] = OFFERED in calls
            caps["supports_tool_calls"] = CALLED in calls
    arguments = {"arg": ARGUMENT} if caps["supports_object_arguments"] else json.dumps({"arg": ARGUMENT})
    parallel = text(_tool_conversation([CALLED, SECOND], arguments), [_tool()])
    caps["supports_parallel_tool_calls"] = parallel is not None and SECOND in parallel

    earlier = {"role": "assistant", "content": "an answer", "reasoning_content": "FR_PROBE_REASONING"}
    last = {"role": "assistant", "content": "another"}
    history = text([_user("hi"), earlier, _user("again"), last], None, PRESERVING)
    caps["supports_preserve_reasoning"] = history is not None and "FR_PROBE_REASONING" in history
    low, high = (text([_user("hi")], None, THINKING | _effort(level)) for level in ("low", "high"))
    caps["supports_reasoning_effort"] = low is not None and high is not None and low != high
    return dict(sorted(caps.items()))


def _user(content: str) -> dict:
    return {"role": "user", "content": content}


def _effort(level: str) -> dict:
    return {"reasoning_effort": level, "reasoning_strength": level}


def _tool() -> dict:
    parameters = {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}
    return {"type": "function", "function": {"name": OFFERED, "description": "a probe", "parameters": parameters}}


def _tool_conversation(names: list[str], arguments) -> list[dict]:
    """A user's turn, the assistant calling each of `names` with `arguments`, the first call's result,
    an answer and another user's turn (llama.cpp's probe)."""
    calls = [
        {"id": f"call{i:05d}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, name in enumerate(names, 1)
    ]
    return [
        _user("hi"),
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "a result", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "the result was 'a result'"},
        _user("again"),
    ]
