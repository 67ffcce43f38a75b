"""Structured outputs: which tokens a request's JSON schema, regular expression, choice or grammar
(or a forced tool call) allows next, after its output and after each draft path a verification scores.

llguidance's matcher follows the text a token at a time. A verification row predicts the token after
output + its path, so the matcher takes the path, gives the row its allowed tokens, and rolls back:
each row is masked as plain decoding masks that position, and the acceptance rule stays exact. A
path that holds a token the text cannot take stops there; its parent's row refuses that token, so
no kept token is ever read from the rows below it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from forerun.base.config import SamplingParams, StructuredOutputsParams
from forerun.base.errors import FieldError, ForerunError
from forerun.base.tools import CALL_CLOSE, CALL_OPEN, ToolChoice
from forerun.models.tokenizer import NO_TOOLS

# llguidance compiles a grammar recursively in native code: a schema whose references chain a
# thousand deep overflows an 8 MiB thread stack and kills the process (a 75 KB request would take a
# server down). Every compile runs on one thread of its own with this much stack (reserved, touched
# only as deep as a grammar goes), where llguidance's own size limits refuse a grammar first.
COMPILE_STACK = 512 * 1024 * 1024


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for `spec`, compiled and checked; FieldError when it cannot be one
    (llguidance's reason)."""
    return _compiled(_grammar_text, spec)


def check_grammar(spec: StructuredOutputsParams, tokenizer, vocab: int) -> None:
    """Whether `spec` can be followed with this model's tokens (FieldError if not; a model without
    a tokenizer cannot follow any). Makes the
    model's token table once (a second or two for a large vocabulary) and the grammar's matcher, so
    the engine's request that needs them later finds them made."""
    _template(spec, tokenizer, vocab)


@functools.lru_cache(maxsize=64)
def _grammar_text(spec: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher

    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    try:
        if spec.json is not None or spec.json_object:
            schema = json.loads(spec.json) if spec.json is not None else {"type": "object"}
            if spec.disable_additional_properties:
                schema = _closed(schema)
            text = LLMatcher.grammar_from_json_schema(schema, defaults=options)
        elif spec.regex is not None:
            text = LLMatcher.grammar_from_regex(spec.regex)
        elif spec.choice is not None:
            # One alternation of literals (a Lark rule of alternatives holds at most 2,000).
            text = LLMatcher.grammar_from_regex("(" + "|".join(_literal(c) for c in spec.choice) + ")")
        else:
            text = LLMatcher.grammar_from_lark(spec.grammar)
    except ValueError as exc:
        raise FieldError("structured_outputs", f"the {spec.kind} cannot be followed: {exc}") from None
    failed, messages = LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        raise FieldError("structured_outputs", f"the {spec.kind} cannot be followed: {messages[0].strip()}")
    return text


def _literal(text: str) -> str:
    """`text` as a regular expression that matches it alone: every character but ASCII letters and
    digits spelled by its code point (Rust's regex syntax)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


def _closed(schema):
    """A JSON schema whose objects take no properties beyond those they name (vLLM's
    disable_additional_properties, OpenAI's strict mode), where they say nothing of others."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def tool_call_grammar(tools: ToolChoice, tokenizer) -> StructuredOutputsParams:
    """The structured output of a forced tool call: the answer is a call of the named function (or,
    with "required", one or more calls of any offered one, one alone without `parallel`), written as
    the chat template taught the model (`base/tools.py`): the tags, then {"name": ..., "arguments":
    ...} as the template's own JSON writes it, the arguments following the function's parameters
    (closed where the function is `strict`)."""
    several = tools.choice == "required" and tools.parallel
    lines = [
        "start: call" + (' ("\\n" call)*' if several else ""),
        f'call: {_tag(CALL_OPEN, tokenizer)} "\\n" ({" | ".join(f"body{i}" for i in range(len(tools.functions)))}) '
        f'"\\n" {_tag(CALL_CLOSE, tokenizer)}',
    ]
    for i, function in enumerate(tools.functions):
        schema = {"type": "object", **(function.get("parameters") or {})}  # arguments are an object
        if function.get("strict"):
            schema = _closed(schema)
        head = json.dumps('{"name": ' + json.dumps(function["name"]) + ', "arguments": ')
        lines.append(f'body{i}: {head} args{i} "}}"')
        lines.append(f"args{i}: %json " + json.dumps({**schema, "x-guidance": _TEMPLATE_JSON}))
    return StructuredOutputsParams(grammar="\n".join(lines))


def tool_output(tools: ToolChoice, tokenizer) -> tuple[StructuredOutputsParams | None, bool]:
    """What a chat offering `tools` asks of its sampling: a forced call's structured output (None
    where the answer may be anything), and whether its text skips special tokens' (not where the
    vocabulary marks the call's tags special: the calls are read from them). The server, `forerun
    generate` and `forerun bench` all take it from here. ForerunError where the model's chat template
    does not show tools, or does not write calls forerun reads while calls may be made."""
    if not tokenizer.shows_tools:
        raise ForerunError(NO_TOOLS)
    if tools.choice != "none" and not tokenizer.writes_tool_calls:
        raise ForerunError(
            f"tool_choice {tools.described} needs the model to write tool calls, and this model's chat template "
            "does not teach it the <tool_call> blocks forerun reads (Qwen's and Hermes' format); offer the "
            "tools with tool_choice none, or leave them out"
        )
    structured = tool_call_grammar(tools, tokenizer) if tools.forced else None
    return structured, tools.choice == "none" or not tokenizer.tool_tags_special


def tool_sampling(params: SamplingParams, tools: ToolChoice, tokenizer) -> SamplingParams:
    """`params` with what `tools` ask of the sampling (`tool_output`): a forced call's structured
    output, and the call tags' text kept where the vocabulary marks them special."""
    forced, skip = tool_output(tools, tokenizer)
    return dataclasses.replace(
        params,
        structured_outputs=forced or params.structured_outputs,
        skip_special_tokens=params.skip_special_tokens and skip,
    )


# How a chat template's `tojson` writes JSON (Python's json.dumps): ", " between items, ": " after keys.
_TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _tag(text: str, tokenizer) -> str:
    """A call's tag in a Lark grammar: the token that spells it where the vocabulary has one (the
    model writes that token, and llguidance reads an added token as a token, not as its text),
    else the text."""
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    added = getattr(tokenizer.hf, "added_tokens_decoder", {})
    return f"<[{ids[0]}]>" if len(ids) == 1 and ids[0] in added else json.dumps(text)


def _template(spec: StructuredOutputsParams, tokenizer, vocab: int):
    """A matcher at the start of `spec`'s text, never advanced (each output's is a copy): made on
    the compile thread the first time, then taken from TEMPLATES without waiting for that thread
    (which may be busy with another request's long compile)."""
    if tokenizer is None:
        raise ForerunError(
            "a structured output needs the model's tokenizer to match text, and this model has none: "
            "leave out structured_outputs, or load the model with its tokenizer"
        )
    key = (spec, tokenizer, vocab)  # the tokenizer itself, not its id: a freed one's id is reused
    with _TEMPLATES_LOCK:
        matcher = _TEMPLATES.get(key)
        if matcher is not None:
            _TEMPLATES.move_to_end(key)
            return matcher
    matcher = _compiled(_new_template, spec, tokenizer, vocab)
    with _TEMPLATES_LOCK:
        _TEMPLATES[key] = matcher
        while len(_TEMPLATES) > TEMPLATES_KEPT:
            _TEMPLATES.popitem(last=False)
    return matcher


def _new_template(spec: StructuredOutputsParams, tokenizer, vocab: int):
    from llguidance import LLMatcher

    matcher = LLMatcher(_token_table(tokenizer, vocab), _grammar_text(spec), log_level=0)
    if matcher.is_error():
        raise FieldError("structured_outputs", f"the {spec.kind} cannot be followed: {matcher.get_error()}")
    return matcher


TEMPLATES_KEPT = 64  # the grammars whose starting matchers are kept, the least recently used dropped
_TEMPLATES: OrderedDict = OrderedDict()
_TEMPLATES_LOCK = threading.Lock()


def _compiler() -> ThreadPoolExecutor:
    """The one thread every compile runs on, made (once) with COMPILE_STACK of stack."""
    global _COMPILER
    with _COMPILER_LOCK:
        for stack in (COMPILE_STACK, COMPILE_STACK // 8):  # the smaller where memory limits refuse the larger
            if _COMPILER is not None:
                break
            pool = ThreadPoolExecutor(1, thread_name_prefix="forerun-grammar")
            before = threading.stack_size(stack)
            try:
                pool.submit(lambda: None).result()  # the thread is made now, with that stack
                _COMPILER = pool
            except RuntimeError:  # "can't start new thread"
                pool.shutdown(wait=False)
            finally:
                threading.stack_size(before)
        if _COMPILER is None:
            raise ForerunError("structured outputs need a thread with a large stack, and none could be started")
        return _COMPILER


_COMPILER: ThreadPoolExecutor | None = None
_COMPILER_LOCK = threading.Lock()


def _compiled(fn: Callable, *args):
    """fn(*args) on the compile thread (its errors raised here)."""
    return _compiler().submit(fn, *args).result()


class Grammar:
    """One output's place in its structured output."""

    def __init__(self, matcher, vocab: int) -> None:
        self.matcher = matcher
        self.vocab = vocab
        # Rows read since the output last grew, by path: a step's verification asks again for the
        # paths its drafter masked its own rows by (a chain's every prefix), so each is read once.
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}
        self._forced: list[int] | None = None  # `forced()` since the output last grew

    @classmethod
    def start(cls, spec: StructuredOutputsParams, tokenizer, vocab: int) -> Grammar:
        """At the start of an output. `tokenizer`: the model's (forerun.models.tokenizer.Tokenizer);
        `vocab`: the width of its logits."""
        return cls(_template(spec, tokenizer, vocab).deep_copy(), vocab)

    def allowed(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """[len(paths), vocab] bool: the tokens the text allows after the output and each path."""
        rows = torch.ones(len(paths), self.vocab, dtype=torch.bool)
        for row, path in enumerate(paths):
            key = tuple(path)
            if key not in self._rows:
                self._rows[key] = self._after(key)
            if self._rows[key] is not None:
                rows[row] = self._rows[key]
        return rows

    def _after(self, path: tuple[int, ...]) -> torch.Tensor | None:
        """The tokens allowed after the output and `path`; None where the text cannot take the path."""
        taken = self.matcher.try_consume_tokens(list(path)) if path else 0
        try:
            return self._next() if taken == len(path) else None
        finally:
            if taken:
                self.matcher.rollback(taken)

    def forced(self) -> list[int]:
        """The tokens the text takes next whatever the model says: where the grammar allows one
        continuation (a schema's fixed keys, a call's `{"name": "`), llguidance's tokens for its
        bytes, up to where a token could still merge with what follows. Empty where the text has a
        choice. A costless draft (`drafters/auto.py`), verified as any other."""
        if self._forced is None:
            self._forced = [int(t) for t in self.matcher.compute_ff_tokens()]
        return self._forced

    def advance(self, token: int) -> None:
        """The output grew by `token` (one the target's masked row gave)."""
        self._rows.clear()
        self._forced = None
        if not self.matcher.consume_token(int(token)):
            raise self._stopped(f"token {token} does not continue the structured output")

    def _next(self) -> torch.Tensor:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # bit j of byte b: token 8b + j
        if self.matcher.is_error():  # a limit of llguidance's reached on the way (the row would allow nothing)
            raise self._stopped("the structured output's grammar cannot go on")
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool))

    def _stopped(self, what: str) -> ForerunError:
        """The error for a text the matcher cannot follow further: llguidance's reason, its first line
        (the rest is its parser's state)."""
        reason = self.matcher.get_error().strip().splitlines()
        return ForerunError(f"{what}: {reason[0] if reason else 'no reason given'}")


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
