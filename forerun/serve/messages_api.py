"""Anthropic's Messages API (`POST /v1/messages` and `/v1/messages/count_tokens`), as vLLM and
llama.cpp serve it, over the chat route's work.

A Messages body is read into the chat body that asks for the same answer (`translate`): `system`
becomes a system turn; a user message's `tool_result` blocks become tool turns (before the text
beside them, as the results answer the calls before); an assistant message's `tool_use` blocks its
tool calls and its `thinking` blocks its `reasoning_content`; a conversation that ends with the
assistant's text is continued from that text (Anthropic's prefill, chat's continue_final_message).
`tools` and `tool_choice` become chat's functions and choice, `stop_sequences` chat's `stop`,
`thinking` the template's `enable_thinking` (Qwen3's; a budget is taken, not enforced: the reasoning
runs within max_tokens; `display: "omitted"` sends its blocks empty), `output_config.format` chat's
JSON-schema response_format; a max_tokens past the context's room is that room (`sampling`'s `fit`).
Fields that tune Anthropic's service (`IGNORED`, `output_config.effort`) are taken and ignored;
code-execution containers and server tools are refused. The chat route's
checks, sampling and engine then run it unchanged, so its speculation, tool calls and reasoning
parser hold here too; what comes back is shaped as a Message (`Translated.shaped`: thinking, text
and tool_use blocks, the stop reason and usage with the prefix cache's tokens as cache reads) or
streamed as its events (`Translated.events`: message_start, a ping, each block's start, deltas and
stop, message_delta, message_stop). Errors come in Anthropic's shape (`refused`), naming the field
as the Messages body names it.

Claude Code's system prompt opens with a billing line whose `cch=` stamp changes on every request
and means nothing to a model; its value is blanked (`BILLING`), as llama.cpp does, so the prefix
cache reaches past it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from forerun.serve.inflight import InFlight
from forerun.serve.requests import BadRequest
from forerun.serve.responses import error_body
from forerun.serve.responses_api import PASSED_ON, chat_chunk

OWN = {
    "model",
    "messages",
    "max_tokens",
    "system",
    "metadata",
    "stop_sequences",
    "stream",
    "temperature",
    "top_k",
    "top_p",
    "tools",
    "tool_choice",
    "thinking",
    "service_tier",
    "output_config",
    "cache_control",
    "speed",
    "inference_geo",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
    "container",
}
# Fields that tune Anthropic's own service, taken and ignored: caching breakpoints (the prefix cache
# works unasked), the fast mode (speculation always runs), region, cache diagnostics, accounts.
# Each one's shape: the values taken, or the type.
IGNORED = {
    "cache_control": dict,
    "speed": ("standard", "fast"),
    "inference_geo": str,
    "diagnostics": dict,
    "user_profile_id": str,
    "workspace_id": str,
}
# vLLM's sampling fields, as chat and the Responses route take them (`stop` is stop_sequences here).
FIELDS = OWN | (PASSED_ON - {"stop"})
COUNT_FIELDS = {
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "chat_template_kwargs",
}
COUNT_FIELDS |= set(IGNORED)
THINKING = ("enabled", "adaptive", "between_tools", "disabled")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
SERVICE_TIERS = ("auto", "standard_only")
# Anthropic's error type for each status forerun answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# What a refusal of the chat body names, as the Messages body names it.
RENAMED = (
    (re.compile(r"\Astop\b"), "stop_sequences"),  # chat's stop checks name the field first
    (re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"\Auser\b"), "metadata.user_id"),
    (re.compile(r"\bresponse_format\b"), "output_config.format"),
)
BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
# Claude Code's billing line: `cch=` is a per-request stamp (blanked so the prompt's prefix repeats).
BILLING = re.compile(r"\A(x-anthropic-billing-header:[^\n]*?\bcch=)[0-9a-zA-Z]+;")


def translate(body: dict) -> Translated:
    """The chat body that asks what the Messages `body` asks, and how its answer goes back."""
    _check_names(body, FIELDS, "/v1/messages")
    limit = body.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise BadRequest("max_tokens is required: the most tokens to write (0: read the prompt only)", "max_tokens")
    chat = _conversation(body)  # chat_template_kwargs there, with `thinking`
    chat |= {name: body[name] for name in PASSED_ON - {"stop", "chat_template_kwargs"} if name in body}
    for name in ("temperature", "top_p", "top_k"):
        if name in body:
            chat[name] = body[name]
    # max_tokens 0 reads the prompt into the prefix cache (Anthropic's pre-warming): one token is
    # written, for the engine's sake, and not answered.
    chat["max_tokens"] = max(limit, 1)
    chat["stream"] = False if body.get("stream") is None else body["stream"]  # a non-bool refused by chat's check
    if body.get("stop_sequences") is not None:
        chat["stop"] = _stop_sequences(body["stop_sequences"])
    user = _user(body.get("metadata"))
    if user is not None:
        chat["user"] = user
    if body.get("service_tier") not in (None, *SERVICE_TIERS):
        raise BadRequest(f"service_tier must be one of {', '.join(SERVICE_TIERS)}", "service_tier")
    if body.get("container") is not None:
        raise BadRequest("container is not supported: this server runs no code-execution containers", "container")
    display = body["thinking"].get("display") if isinstance(body.get("thinking"), dict) else None
    return Translated(chat, body["model"], show_thinking=display != "omitted", warm_only=limit == 0)


def count_body(body: dict) -> dict:
    """The chat body of a count_tokens request (the prompt a Messages request would run)."""
    _check_names(body, COUNT_FIELDS, "/v1/messages/count_tokens")
    return _conversation(body)


def _check_names(body: dict, fields: set[str], route: str) -> None:
    """No field but `fields`; `model` a name; the fields taken and ignored of their shapes."""
    for name in body:
        if name not in fields:
            raise BadRequest(f"unknown field {name[:60]!r}: {route} takes {', '.join(sorted(fields))}", name)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("model is required: the name /v1/models lists", "model")
    for name, shape in IGNORED.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(shape, tuple) and value not in shape:
            raise BadRequest(f"{name} must be one of {', '.join(shape)} (taken and ignored here)", name)
        if isinstance(shape, type) and not isinstance(value, shape):
            kind = "an object" if shape is dict else "a string"
            raise BadRequest(f"{name} must be {kind} (taken and ignored here)", name)


def _conversation(body: dict) -> dict:
    """Chat's model, messages, tools, tool choice, template flags and output format for the Messages
    body's conversation."""
    messages = _messages(body.get("messages"), body.get("system"))
    chat: dict = {"model": body["model"], "messages": messages}
    last = body["messages"][-1]
    if last["role"] == "assistant":  # Anthropic's prefill: the answer continues the assistant's text
        if messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls"):
            raise BadRequest(
                "the last message is the assistant's tool_use: send its tool_result in a user message",
                f"messages[{len(body['messages']) - 1}]",
            )
        chat |= {"add_generation_prompt": False, "continue_final_message": True}
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat |= _tool_choice(body["tool_choice"], bool(chat.get("tools")))
    kwargs = _thinking(body.get("thinking"), body.get("chat_template_kwargs"))
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    chat |= _output_config(body.get("output_config"))
    if "response_format" in chat and chat.get("tool_choice") not in (None, "auto", "none"):
        raise BadRequest(
            "output_config.format asks for text in a schema, tool_choice for a tool call: give one", "tool_choice"
        )
    return chat


def _messages(given: object, system: object) -> list[dict]:
    """Chat's messages for a Messages `messages` list after `system`. Each is checked here, so a
    refusal names the Messages field (chat's checks then find nothing to refuse in them)."""
    if not isinstance(given, list) or not given:
        raise BadRequest('messages must be a non-empty list of {"role", "content"} objects', "messages")
    out = []
    if system is not None:  # each block's billing stamp blanked, as llama.cpp does
        out.append({"role": "system", "content": _text(system, "system", lambda text: BILLING.sub(r"\1;", text))})
    for i, message in enumerate(given):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise BadRequest(f'{where} must be {{"role": "user" or "assistant", "content"}} (system apart)', where)
        unknown = set(message) - {"role", "content"}
        if unknown:
            name = sorted(unknown)[0]
            raise BadRequest(f"{where} has an unknown field {name[:40]!r}", f"{where}.{name[:40]}")
        out += _turns(message["role"], message.get("content"), where)
    return out


def _turns(role: str, content: object, where: str) -> list[dict]:
    """One Messages message as chat turns: a user's tool results (tool turns) then its text; an
    assistant's text with its calls and reasoning."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
    texts, turns, calls, thought = [], [], [], ""
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _kind(block, at, BLOCKS[role])
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "tool_result":
            result = block.get("content", "")
            text = "" if result is None else _text(result, f"{at}.content")
            turns.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at), "content": text})
        elif kind == "tool_use":
            calls.append(_call(block, at))
        elif kind == "thinking":
            thought += _string(block, "thinking", at, empty=True)
    if role == "user":
        return turns + ([{"role": "user", "content": "".join(texts)}] if texts or not turns else [])
    turn = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    if thought:
        turn["reasoning_content"] = thought
    return [turn]


def _kind(block: object, at: str, kinds: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str) or kind not in kinds:
        shown = kind if isinstance(kind, str) else None
        raise BadRequest(f"{at} must be a {', '.join(kinds)} block ({shown!r}: this server reads text only)", at)
    return kind


def _text(content: object, where: str, each=lambda text: text) -> str:
    """A string, or text blocks joined (`each` applied to each)."""
    if isinstance(content, str):
        return each(content)
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text blocks", where)
    texts = []
    for j, block in enumerate(content):
        _kind(block, f"{where}[{j}]", ("text",))
        texts.append(each(_string(block, "text", f"{where}[{j}]")))
    return "".join(texts)


def _string(block: dict, name: str, at: str, empty: bool = False) -> str:
    value = block.get(name)
    may_be_empty = empty or name == "text"
    if not isinstance(value, str) or not (value or may_be_empty):
        raise BadRequest(f"{at}.{name} must be a {'' if may_be_empty else 'non-empty '}string", f"{at}.{name}")
    return value


def _call(block: dict, at: str) -> dict:
    """A tool_use block as chat's tool call."""
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise BadRequest(f"{at}.input must be an object", f"{at}.input")
    function = {"name": _string(block, "name", at), "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": _string(block, "id", at), "type": "function", "function": function}


def _tools(tools: object) -> list:
    """Client tools as chat's function entries; Anthropic's server tools refused."""
    if not isinstance(tools, list):
        raise BadRequest('tools must be a list of {"name", "description", "input_schema"} objects', "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom") if isinstance(tool, dict) else None
        if kind not in ("custom", None):
            raise BadRequest(f"tools[{i}] is a {kind!r} tool: this server runs client tools only", f"tools[{i}]")
        if not isinstance(tool, dict) or not isinstance(tool.get("input_schema"), dict):
            raise BadRequest(f'tools[{i}] must be {{"name", "description", "input_schema"}}', f"tools[{i}]")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for name in ("description", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object, tools: bool) -> dict:
    """Anthropic's tool_choice as chat's tool_choice (and parallel_tool_calls); `tools`: whether
    the request offers any."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    named = kind == "tool" and isinstance(choice.get("name"), str)
    if kind not in ("auto", "any", "none", "tool") or (kind == "tool" and not named):
        raise BadRequest('tool_choice must be {"type": "auto", "any", "none" or "tool" (with "name")}', "tool_choice")
    if kind in ("any", "tool") and not tools:
        raise BadRequest(f'tool_choice {{"type": "{kind}"}} asks for a tool call: give tools to call', "tool_choice")
    function = {"type": "function", "function": {"name": choice["name"]}} if named else None
    out = {"tool_choice": function or {"any": "required"}.get(kind, kind)}
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise BadRequest("tool_choice.disable_parallel_tool_use must be true or false", "tool_choice")
        out["parallel_tool_calls"] = not parallel
    return out


def _thinking(thinking: object, kwargs: object) -> dict | None:
    """The chat template's variables with `thinking` as its enable_thinking."""
    if thinking is None:
        return kwargs  # checked by chat's check
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object of the template's variables", "chat_template_kwargs")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in THINKING:
        raise BadRequest(f'thinking must be {{"type": one of {", ".join(THINKING)}}}', "thinking")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise BadRequest("thinking.budget_tokens must be a positive integer", "thinking.budget_tokens")
    if thinking.get("display") not in (None, "summarized", "omitted"):
        raise BadRequest('thinking.display must be "summarized" or "omitted"', "thinking.display")
    enable = kind != "disabled"
    if (kwargs or {}).get("enable_thinking", enable) != enable:
        raise BadRequest("thinking and chat_template_kwargs.enable_thinking differ: give one", "thinking")
    return {**(kwargs or {}), "enable_thinking": enable}


def _output_config(config: object) -> dict:
    """`output_config` as chat's fields: its `format` (a JSON schema) as response_format; `effort`
    taken and ignored (a model here thinks as its template and `thinking` say)."""
    if config is None:
        return {}
    if not isinstance(config, dict) or set(config) - {"effort", "format"}:
        raise BadRequest('output_config must be {"effort", "format"}', "output_config")
    if config.get("effort") not in (None, *EFFORTS):
        raise BadRequest(f"output_config.effort must be one of {', '.join(EFFORTS)}", "output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise BadRequest(
            'output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config.format"
        )
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


def _stop_sequences(given: object) -> list:
    if not isinstance(given, list) or not all(isinstance(s, str) for s in given):
        raise BadRequest("stop_sequences must be a list of strings", "stop_sequences")
    return given


def _user(metadata: object) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise BadRequest('metadata must be {"user_id": ...}', "metadata")
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise BadRequest("metadata.user_id must be a string", "metadata.user_id")
    return user


def refused(exc: BadRequest) -> JSONResponse:
    """A refusal in Anthropic's error shape (its type from the status)."""
    return JSONResponse(anthropic_error(exc), status_code=exc.status)


def anthropic_error(exc: BadRequest) -> dict:
    message = error_body(exc)["error"]["message"]
    kind = ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def renamed(exc: BadRequest) -> BadRequest:
    """A refusal of the chat body as one of the Messages body: its field names."""

    def named(text: str | None) -> str | None:
        if text is None:
            return None
        for pattern, own in RENAMED:
            text = pattern.sub(own, text)
        return text

    return BadRequest(named(exc.message), named(exc.param), exc.status, exc.kind, exc.code)


@dataclass
class Translated:
    """A Messages request read as chat's, and how its answer goes back."""

    chat: dict
    model: str
    show_thinking: bool = True  # false: thinking blocks come back empty (thinking.display "omitted")
    warm_only: bool = False  # max_tokens 0: the prompt read, nothing answered
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")

    @property
    def body(self) -> dict:
        """The chat body that runs."""
        return self.chat

    def renamed(self, exc: BadRequest) -> BadRequest:
        return renamed(exc)

    def message(self, content: list, stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def shaped(self, completion: dict, run: InFlight) -> dict:
        """Chat's whole answer (one choice) as a Message: thinking, then text, then tool_use blocks
        (the order the stream sends them in)."""
        if self.warm_only:
            return self.message([], ("max_tokens", None), usage(completion["usage"], warm_only=True))
        choice = completion["choices"][0]
        message = choice["message"]
        reasoning, text = message.get("reasoning_content"), message.get("content") or ""
        calls = message.get("tool_calls") or []
        content = [_thinking_block(reasoning if self.show_thinking else "")] if reasoning else []
        if text or not (calls or reasoning):  # an answer of nothing at all: one empty text block
            content.append({"type": "text", "text": text})
        content += [_tool_use(call) for call in calls]
        out = self.message(
            content, _stop(choice["finish_reason"], choice["stop_reason"], bool(calls)), usage(completion["usage"])
        )
        if completion.get("speculative_decoding_stats") is not None:
            out["speculative_decoding_stats"] = completion["speculative_decoding_stats"]
        return out

    async def events(self, run: InFlight) -> AsyncIterator[str]:
        """The answer as Anthropic's server-sent events, ending in message_delta and message_stop
        (an error event if the engine fails)."""
        blocks = _Blocks(self.show_thinking, self.warm_only)
        opening = {"input_tokens": sum(len(ids) for ids in run.reply.prompt_ids), "output_tokens": 0}
        yield _event("message_start", message=self.message([], (None, None), opening))
        yield _event("ping")
        try:
            reason = stopped = None
            while not run.done:
                index, event = await run.events.get()
                chunk, failure = chat_chunk(run, index, event)
                if failure is not None:
                    yield _event("error", error=anthropic_error(failure)["error"])
                    return
                for entry in (chunk or {}).get("choices", []):
                    for text in blocks.feed(entry["delta"]):
                        yield text
                    reason, stopped = entry["finish_reason"] or reason, entry["stop_reason"] or stopped
            for text in blocks.finish():
                yield text
            stop_reason, sequence = _stop(reason, stopped, bool(blocks.calls))
            delta = {"stop_reason": stop_reason, "stop_sequence": sequence}
            figures = usage(run.reply.usage(run.choices), self.warm_only)
            yield _event("message_delta", delta=delta, usage=figures)
            yield _event("message_stop")
        finally:
            run.cancel()  # the client went away mid-stream: free the sequences


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


def _stop(finish_reason: str | None, stop_reason: object, called: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for chat's finish_reason and vLLM's stop_reason, and
    whether the answer called tools (a forced call ends as "stop" in chat, as "tool_use" here)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called or finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def usage(usage: dict, warm_only: bool = False) -> dict:
    """Chat's usage as Anthropic's: the prompt's tokens from the prefix cache are cache reads, the
    rest input tokens (`warm_only`: the token written for the engine's sake not counted)."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": 0 if warm_only else usage["completion_tokens"],
    }


def _thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call: dict) -> dict:
    function = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": function["name"], "input": json.loads(function["arguments"])}


class _Blocks:
    """The content blocks of a streamed answer, opened as their first delta arrives and stopped when
    another kind begins or the answer ends, with the events each step sends. Calls are sent last, as
    the whole answer lists them: text written after a call joins the text block before it."""

    def __init__(self, show_thinking: bool, warm_only: bool) -> None:
        self.show_thinking, self.warm_only = show_thinking, warm_only
        self.count = 0  # blocks opened so far: the next one's index
        self.open: str | None = None  # the kind of the block receiving deltas
        self.calls: list[dict] = []  # the answer's calls, sent once it ends

    def feed(self, delta: dict) -> list[str]:
        out = []
        if self.warm_only:
            return out
        if delta.get("reasoning_content"):
            out += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("text", delta["content"])
        self.calls += delta.get("tool_calls") or []
        return out

    def finish(self) -> list[str]:
        """Stop the open block and send the calls; an answer with no block at all gets an empty
        text block (max_tokens 0: none)."""
        if self.warm_only:
            return []
        out = self._start("text") + self._stop() if self.count == 0 and not self.calls else self._stop()
        for call in self.calls:
            block = _tool_use(call)
            out.append(_event("content_block_start", index=self.count, content_block={**block, "input": {}}))
            arguments = {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
            out.append(_event("content_block_delta", index=self.count, delta=arguments))
            out.append(_event("content_block_stop", index=self.count))
            self.count += 1
        return out

    def _text(self, kind: str, text: str) -> list[str]:
        out = [] if self.open == kind else self._stop() + self._start(kind)
        if kind == "thinking" and not self.show_thinking:
            return out  # the block alone, empty, as Anthropic omits it
        delta = {"type": f"{kind}_delta", kind: text}  # thinking_delta or text_delta
        return out + [_event("content_block_delta", index=self.count - 1, delta=delta)]

    def _start(self, kind: str) -> list[str]:
        block = _thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
        self.open = kind
        self.count += 1
        return [_event("content_block_start", index=self.count - 1, content_block=block)]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.count - 1)]
