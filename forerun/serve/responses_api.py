"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it, over the chat route's work.

A Responses body is read into the chat body that asks for the same answer (`translate`): the input
items become messages (instructions first, as a system turn; a function call joins the assistant
turn before it; its output is a tool turn; a reasoning item's text is the next assistant turn's
`reasoning_content`, which Qwen3's template shows), function tools and `text.format` become chat's tools
and response_format, `max_output_tokens` chat's `max_completion_tokens`. The chat route's checks,
sampling and engine then run it unchanged, so its speculation, tool calls, structured outputs and
reasoning parser hold here too; what comes back is shaped as a Responses object (`Translated.shaped`)
or streamed as its typed events (`Translated.events`: response.created, output items opened, text
and argument deltas, items done, response.completed or response.incomplete).

A response asked with `store` (the default) is kept in this server's memory with its conversation
(forerun/serve/response_store.py): a `previous_response_id` naming it puts that conversation, its
answer last, before the new input (its instructions left out, as OpenAI leaves them). `conversation`,
`background`, hosted tools and images are refused by name. A refusal from the chat route's checks
names the Responses field the client sent (`max_output_tokens`, `input`, `text.format`).
"""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from forerun.serve.inflight import InFlight
from forerun.serve.requests import SERVICE_TIERS, BadRequest
from forerun.serve.response_store import ResponseStore
from forerun.serve.responses import error_body
from forerun.serve.scheduler import Failed

# Fields a Responses body may hold: its own, and chat's sampling fields that vLLM also takes here.
OWN = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "top_logprobs",
    "include",
    "store",
    "metadata",
    "user",
    "service_tier",
    "truncation",
    "reasoning",
    "previous_response_id",
    "background",
    "conversation",
    "prompt",
    "max_tool_calls",
}
PASSED_ON = {
    "seed",
    "top_k",
    "min_p",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "chat_template_kwargs",
    "structured_outputs",
}
FIELDS = OWN | PASSED_ON
# Responses fields forerun cannot honour: taken only as these values (they ask for nothing).
UNHONOURED = {
    "conversation": "this server keeps no conversations; send the whole conversation as input, or name a "
    "stored response as previous_response_id",
    "background": "responses run in the foreground here; leave it out or set it false",
    "prompt": "this server has no stored prompt templates; send the text as input",
    "max_tool_calls": "leave it out",
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What a refusal of the chat body names, as the Responses body names it.
RENAMED = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}
# Chat's shapes in a refusal's words, as Responses writes them.
RESHAPED = (
    (re.compile(r"tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r'\{"type": "function", "function": \{"name": \.\.\.\}\}'), '{"type": "function", "name": ...}'),
    (re.compile(r'"json_schema": \{"name": \.\.\., "schema": \.\.\.\}'), '"name" and "schema"'),
)
ITEM_FIELDS = {
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")


def translate(body: dict, store: ResponseStore) -> Translated:
    """The chat body that asks what the Responses `body` asks, with what the answer repeats of it;
    a `previous_response_id` is read from `store`, where the answer is kept unless `store` is false."""
    for name in body:
        if name not in FIELDS:
            raise BadRequest(f"unknown field {name[:60]!r}: /v1/responses takes {', '.join(sorted(FIELDS))}", name)
    for name, why in UNHONOURED.items():
        if body.get(name) not in (None, False):
            raise BadRequest(f"{name} is not supported: {why}", name)
    _check_settings(body)
    chat = {
        name: body[name] for name in PASSED_ON | {"model", "temperature", "top_p", "user", "metadata"} if name in body
    }
    previous = body.get("previous_response_id")
    given = [] if previous is not None and body.get("input") is None else messages(body.get("input"), None)
    history = _history(previous, store) + given
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string", "instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + history
    chat["stream"] = False if body.get("stream") is None else body["stream"]  # a non-bool refused by chat's check
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    for name in ("parallel_tool_calls", "service_tier"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    chat.update(_format(body.get("text")))
    top = body.get("top_logprobs")
    if top is not None or LOGPROBS_INCLUDE in (body.get("include") or []):
        chat["logprobs"], chat["top_logprobs"] = True, 0 if top is None else top
    kept = store if body.get("store") is not False else None
    return Translated(chat, _repeated(body, kept is not None), history, kept)


def _check_settings(body: dict) -> None:
    """The fields taken with some values only: include, truncation, reasoning, store, stream_options."""
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or any(x != LOGPROBS_INCLUDE for x in include)):
        raise BadRequest(
            f'include takes ["{LOGPROBS_INCLUDE}"] only (this server keeps nothing else to include)', "include"
        )
    if body.get("truncation") not in (None, "disabled"):
        raise BadRequest(
            'truncation must be "disabled": an input longer than the context is refused, not cut', "truncation"
        )
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or any(v is not None for v in reasoning.values())):
        raise BadRequest(
            "reasoning settings (effort, summary) are not supported: a model reasons as its chat template says "
            "(chat_template_kwargs, such as Qwen3's enable_thinking); leave it out",
            "reasoning",
        )
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise BadRequest("store must be true or false", "store")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_obfuscation"}):
        raise BadRequest('stream_options takes {"include_obfuscation": bool} only', "stream_options")
    if body.get("service_tier") is not None and body["service_tier"] not in SERVICE_TIERS:
        raise BadRequest(f"service_tier must be one of {', '.join(SERVICE_TIERS)}", "service_tier")


def _history(previous: object, store: ResponseStore) -> list[dict]:
    """The stored conversation a previous_response_id names, its answer last (its instructions
    left out, as OpenAI leaves them)."""
    if previous is None:
        return []
    if not isinstance(previous, str) or not previous:
        raise BadRequest("previous_response_id must be a response's id", "previous_response_id")
    stored = store.get(previous)
    if stored is None:  # OpenAI's status and code, which clients read to send the whole conversation instead
        raise BadRequest(
            f"Previous response with id {previous[:80]!r} not found: never stored here (store false, or another "
            f"server), deleted, or forgotten (this server keeps its last {store.max_responses}); send the whole "
            "conversation as input",
            "previous_response_id",
            code="previous_response_not_found",
        )
    if stored.response["status"] == "failed":
        raise BadRequest(f"response {previous[:80]!r} failed: it cannot be continued", "previous_response_id")
    return [dict(message) for message in stored.messages]


def messages(given: object, instructions: object) -> list[dict]:
    """Chat's messages for a Responses `input` (a string, or a list of message, function_call,
    function_call_output and reasoning items) after `instructions`. A reasoning item's text goes to
    the assistant turn after it as `reasoning_content`, as chat takes an answer's reasoning back."""
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string", "instructions")
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise BadRequest("input must be a string or a non-empty list of items (messages, function calls)", "input")
    out = [{"role": "system", "content": instructions}] if instructions else []
    thought = ""  # a reasoning item's text, for the assistant turn the next item lands in
    for i, item in enumerate(given):
        kind = item.get("type") if isinstance(item, dict) else False
        kind = "message" if kind is None else kind  # left out or null
        if not isinstance(kind, str) or kind not in ITEM_FIELDS:
            raise BadRequest(
                f"input[{i}] must be a message, function_call, function_call_output or reasoning item", f"input[{i}]"
            )
        unknown = set(item) - ITEM_FIELDS[kind]
        if unknown:
            name = sorted(unknown)[0]
            raise BadRequest(f"input[{i}] ({kind}) has an unknown field {name[:40]!r}", f"input[{i}].{name[:40]}")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise BadRequest(f"input[{i}].role must be one of {', '.join(ROLES)}", f"input[{i}].role")
            out.append({"role": item["role"], "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            _add_call(out, item, i)
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"input[{i}].output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": output})
        if kind == "reasoning":
            thought += _reasoning(item, i)
        else:
            if thought and out[-1]["role"] == "assistant":
                out[-1].setdefault("reasoning_content", thought)
            thought = ""
    return out


def _reasoning(item: dict, i: int) -> str:
    """A reasoning item's text: its reasoning_text parts (else its summary's), joined."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise BadRequest(f"input[{i}] (reasoning): content and summary must be lists of text parts", f"input[{i}]")
    return "".join(p["text"] for p in parts)


def _text(content: object, where: str) -> str:
    """A message's content: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of input_text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise BadRequest(f"{where}[{j}] must be an input_text part ({kind!r}: this server reads text only)", where)
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, name: str, i: int) -> str:
    if not isinstance(item.get(name), str) or not item[name]:
        raise BadRequest(f"input[{i}].{name} must be a non-empty string", f"input[{i}].{name}")
    return item[name]


def _add_call(out: list[dict], item: dict, i: int) -> None:
    """A function_call item as a call of the assistant turn before it (a new turn if none)."""
    arguments = item.get("arguments") if item.get("arguments") != "" else "{}"  # a call without arguments
    if not isinstance(arguments, str):
        raise BadRequest(f"input[{i}].arguments must be a JSON object (as text)", f"input[{i}].arguments")
    try:
        ok = isinstance(json.loads(arguments), dict)
    except (ValueError, RecursionError):
        ok = False
    if not ok:
        raise BadRequest(f"input[{i}].arguments must be a JSON object (as text)", f"input[{i}].arguments")
    call = {"id": _string(item, "call_id", i), "type": "function", "function": {"name": _string(item, "name", i)}}
    call["function"]["arguments"] = arguments
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": None})
    out[-1].setdefault("tool_calls", []).append(call)


def _tools(tools: object) -> list:
    """Function tools as chat's {"type": "function", "function": {...}} entries; other kinds refused."""
    if not isinstance(tools, list):
        raise BadRequest('tools must be a list of {"type": "function", "name", "parameters"} objects', "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadRequest(
                f"tools[{i}] must be a function tool ({kind!r}: this server runs no hosted tools)", "tools"
            )
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice: object) -> object:
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, str):
        return choice
    raise BadRequest(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}', "tool_choice"
    )


def _format(text: object) -> dict:
    """`text.format` as chat's response_format (nothing for plain text)."""
    if text is None:
        return {}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise BadRequest('text must be {"format": {...}}', "text")
    if text.get("verbosity") not in (None, "medium"):
        raise BadRequest("text.verbosity is not supported: a model writes as long as it writes; leave it out", "text")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        schema = {k: v for k, v in fmt.items() if k in ("name", "schema", "strict", "description")}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise BadRequest('text.format.type must be "text", "json_object" or "json_schema"', "text.format")


def _repeated(body: dict, stored: bool) -> dict:
    """What a Responses object repeats of its request, with OpenAI's defaults."""
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",  # the one tier served, whatever was asked
        "store": stored,
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs"),
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "user": body.get("user"),
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Translated:
    """A Responses request read as chat's, and how its answer goes back."""

    chat: dict
    repeated: dict
    history: list[dict] = field(default_factory=list)  # the conversation without instructions, to store
    store: ResponseStore | None = None  # where the answer is kept (None: store false)
    id: str = field(default_factory=lambda: _item_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def renamed(self, exc: BadRequest) -> BadRequest:
        """A refusal of the chat body as one of the Responses body: its field names."""
        message, param = exc.message, exc.param
        for pattern, own in RESHAPED:
            message = pattern.sub(own, message)
        for chat_name, own in RENAMED.items():
            message = message.replace(chat_name, own)
            if param is not None and param.startswith(chat_name):
                param = own + param[len(chat_name) :]
        return BadRequest(message, param, exc.status, exc.kind, exc.code)

    def response(self, status: str, output: list, usage: dict | None, extra: dict | None = None) -> dict:
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.chat.get("model"),
            "output": output,
            "usage": usage,
            **self.repeated,
        }
        return out | (extra or {})

    @property
    def body(self) -> dict:
        """The chat body that runs."""
        return self.chat

    def shaped(self, completion: dict, run: InFlight) -> dict:
        """Chat's whole answer (one choice) as a Responses object."""
        choice = completion["choices"][0]
        message = choice["message"]
        status, output = _status(choice["finish_reason"]), []
        reasoning, content = message.get("reasoning_content"), message.get("content") or ""
        if reasoning:
            output.append(_reasoning_item(reasoning))
        calls = message.get("tool_calls") or []
        if content or not (calls or reasoning):  # an answer of nothing at all: one empty message
            logprobs = own_logprobs((choice.get("logprobs") or {}).get("content"), content, reasoning)
            output.append(
                _message_item(content, logprobs, "incomplete" if status == "incomplete" and not calls else "completed")
            )
        output += [_call_item(call) for call in calls]
        usage = _usage(completion["usage"], reasoning, run.reply.tokenizer)
        stats = completion.get("speculative_decoding_stats")
        extra = {"speculative_decoding_stats": stats} if stats is not None else None
        return self._kept(self.response(status, output, usage, extra))

    def _kept(self, response: dict) -> dict:
        """`response`, stored with its conversation where the request asked (store, the default)."""
        if self.store is not None:
            self.store.put(response, [*self.history, assistant_turn(response["output"])])
        return response

    async def events(self, run: InFlight) -> AsyncIterator[str]:
        """The answer as Responses' typed server-sent events, ending in response.completed (or
        response.incomplete at the token limit; an error event and response.failed if the engine fails)."""
        # Text read apart (reasoning, tool calls) is not cut where the tokens are: deltas then carry no
        # logprobs, and the message's whole list comes with its done events.
        read_apart = run.reply.reasoning is not None or self.chat.get("tools") not in (None, [])
        items = _StreamedItems(read_apart)
        yield items.event("response.created", response=self.response("in_progress", [], None))
        yield items.event("response.in_progress", response=self.response("in_progress", [], None))
        try:
            reason = None
            while not run.done:
                index, event = await run.events.get()
                chunk, failure = chat_chunk(run, index, event)
                if failure is not None:
                    yield items.error(failure)
                    failed = self._kept(self.response("failed", items.output, None, items.failed(failure)))
                    yield items.event("response.failed", response=failed)
                    return
                for entry in (chunk or {}).get("choices", []):
                    for text in items.feed(entry["delta"], (entry.get("logprobs") or {}).get("content")):
                        yield text
                    reason = entry["finish_reason"] or reason
            status = _status(reason)
            for text in items.finish(status):
                yield text
            usage = _usage(run.reply.usage(run.choices), items.reasoning_text, run.reply.tokenizer)
            final = self._kept(self.response(status, items.output, usage))
            yield items.event(f"response.{status}", response=final)
        finally:
            run.cancel()  # the client went away mid-stream: free the sequences


def assistant_turn(output: list[dict]) -> dict:
    """Chat's assistant message for a response's output items: its reasoning, text and calls."""
    reasoning = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    turn = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = reasoning
    return turn


def chat_chunk(run: InFlight, index: int, event) -> tuple[dict | None, BadRequest | None]:
    """Chat's chunk for an engine event, or the failure to tell the client instead."""
    if isinstance(event, Failed):
        return None, run.failure(event)
    choice = run.take(index, event)
    try:
        return run.reply.chunk(choice, run.stats_of(choice)), None
    except Exception as exc:  # noqa: BLE001 - told to the client as an error event, not a cut stream
        return None, run.unshaped(exc)


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def own_logprobs(entries: list | None, text: str, after: str | None = None) -> list:
    """Of chat's logprob entries for every generated token, those of the tokens that wrote `text`, the
    message's part of an answer whose reasoning (`after`) or calls are read apart: the tokens whose
    bytes overlap the first place `text` stands in the answer's bytes past the reasoning; none where
    it does not stand whole."""
    if not entries or not text:
        return []
    pieces = [bytes(entry.get("bytes") or []) for entry in entries]
    ends = list(itertools.accumulate(len(piece) for piece in pieces))
    spans = [(end - len(piece), end) for piece, end in zip(pieces, ends)]
    answer = b"".join(pieces)
    begin = 0
    if after:
        thought = after.encode("utf-8")
        begin = answer.find(thought) + len(thought) if thought in answer else 0
    goal = text.encode("utf-8")
    start = answer.find(goal, begin)
    if start < 0:
        return []
    return [entry for entry, (a, b) in zip(entries, spans) if a < start + len(goal) and b > start]


def _usage(usage: dict, reasoning: str | None, tokenizer) -> dict:
    """Chat's usage as Responses' (reasoning tokens: the reasoning text's tokens, counted again)."""
    thought = len(tokenizer.hf.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": min(thought, usage["completion_tokens"])},
        "total_tokens": usage["total_tokens"],
    }


def _message_item(text: str, logprobs: list | None, status: str, item_id: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    content = [] if status == "in_progress" else [part]
    return {
        "type": "message",
        "id": item_id or _item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _reasoning_item(text: str, item_id: str | None = None) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id or _item_id("rs"), "summary": [], "content": content}


def _call_item(call: dict, status: str = "completed") -> dict:
    function = call["function"]
    arguments = function["arguments"] if status == "completed" else ""
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call["id"],
        "name": function["name"],
        "arguments": arguments,
        "status": status,
    }


def _error_fields(exc: BadRequest) -> tuple[str, str, str | None]:
    """(code, message, param) of a failure as Responses' events give it (the type where no code)."""
    error = error_body(exc)["error"]
    return error["code"] or error["type"], error["message"], error["param"]


class _StreamedItems:
    """The output items of a streamed answer, opened as their first delta arrives and closed when
    another kind begins or the answer ends, with the events each step sends."""

    def __init__(self, read_apart: bool) -> None:
        """`read_apart`: the answer's text is read into reasoning or calls, so a chunk's logprobs are
        not its content delta's: deltas carry none, the message's done events its own (own_logprobs)."""
        self.output: list[dict] = []  # the closed items, in order
        self.sequence = 0
        self.open: dict | None = None  # the item receiving deltas: {"kind", "id", "text"}
        self.reasoning_text = ""
        self.read_apart = read_apart
        self.entries: list = []  # every generated token's logprobs so far

    def failed(self, exc: BadRequest) -> dict:
        """A failed response's error field."""
        code, message, _ = _error_fields(exc)
        return {"error": {"code": code, "message": message}}

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def error(self, exc: BadRequest) -> str:
        code, message, param = _error_fields(exc)
        return self.event("error", code=code, message=message, param=param)

    def feed(self, delta: dict, logprobs: list | None) -> list[str]:
        out = []
        self.entries += logprobs or []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"], None)
            self.reasoning_text += delta["reasoning_content"]
        if delta.get("content"):
            out += self._text("message", delta["content"], None if self.read_apart else logprobs)
        for call in delta.get("tool_calls") or []:
            out += self._close() + self._call(call)
        return out

    def finish(self, status: str) -> list[str]:
        """Close the open item (a message cut by the token limit as `incomplete`); an answer with no
        item at all gets an empty message."""
        if self.open is None and not self.output:
            return self._open("message") + self._close(status)
        return self._close(status)

    def _text(self, kind: str, text: str, logprobs: list | None) -> list[str]:
        out = [] if self.open is not None and self.open["kind"] == kind else self._close() + self._open(kind)
        item = self.open
        item["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        if kind == "reasoning":
            return out + [self.event("response.reasoning_text.delta", **where, delta=text)]
        return out + [self.event("response.output_text.delta", **where, delta=text, logprobs=logprobs or [])]

    def _open(self, kind: str) -> list[str]:
        self.open = {"kind": kind, "id": _item_id("msg" if kind == "message" else "rs"), "text": ""}
        index = len(self.output)
        if kind == "reasoning":
            item = _reasoning_item("", self.open["id"])
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = _message_item("", None, "in_progress", self.open["id"])
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self.event("response.output_item.added", output_index=index, item=item)
        where = {"item_id": self.open["id"], "output_index": index, "content_index": 0}
        return [added, self.event("response.content_part.added", **where, part=part)]

    def _close(self, status: str = "completed") -> list[str]:
        """Close the open item: `status` is the response's where the answer ends with it."""
        if self.open is None:
            return []
        kind, text, item_id = self.open["kind"], self.open["text"], self.open["id"]
        where = {"item_id": item_id, "output_index": len(self.output), "content_index": 0}
        if kind == "reasoning":
            item = _reasoning_item(text, item_id)
            done = self.event("response.reasoning_text.done", **where, text=text)
            part = {"type": "reasoning_text", "text": text}
        else:
            logprobs = own_logprobs(self.entries, text, self.reasoning_text)
            item = _message_item(text, logprobs, status, item_id)
            done = self.event("response.output_text.done", **where, text=text, logprobs=logprobs)
            part = item["content"][0]
        out = [done, self.event("response.content_part.done", **where, part=part)]
        out.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.open = None
        return out

    def _call(self, call: dict) -> list[str]:
        item = _call_item(call)
        index = len(self.output)
        where = {"item_id": item["id"], "output_index": index}
        out = [
            self.event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
        ]
        out.append(self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]))
        out.append(self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return out
