"""What a client sends to `forerun serve`: the body read, every field checked, the prompts tokenized.

A request is read and checked before the engine sees it. Anything wrong raises BadRequest (HTTP
4xx in OpenAI's error shape, naming the field and saying what to send instead): a field of the
wrong type or range, a field of the other route, a field forerun cannot honour (`best_of`,
`functions`, ...) set to anything but its neutral value, a name no API knows, text that is not valid
Unicode, token ids outside the vocabulary, a body nested too deeply to parse, a chat the template
rejects. What /openapi.json says of a request is in forerun/serve/schemas.py; the checks are here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from starlette.requests import ClientDisconnect

from forerun.base.chat import chat_turns
from forerun.base.config import SEED_RANGE, SamplingParams, StructuredOutputsParams, is_finite, is_whole
from forerun.base.errors import FieldError, ForerunError
from forerun.base.prompts import in_vocabulary, valid_unicode
from forerun.base.tools import ToolChoice, tool_choice
from forerun.models.tokenizer import Tokenizer, check_template_kwargs
from forerun.serve.structured import FIELDS as STRUCTURED_FIELDS
from forerun.serve.structured import structured_output
from forerun.verification import grammar

MAX_LOGPROBS = 20  # most alternatives a position's logprobs may list
MAX_N = 16  # most samples one request may ask for
MAX_PROMPTS = 16  # most prompts one completions request may batch (their samples run as one group)
MAX_STOP = 64  # most stop strings one request may give
MAX_LOGIT_BIAS = 300  # most tokens a logit_bias may name (OpenAI's limit; each step adds every one)
MAX_STOP_CHARS = 1024  # longest stop string
CHARS_PER_TOKEN = 16  # a prompt longer than max_model_len x this is refused before tokenizing
# A completion's max_tokens when the request gives none (OpenAI's and vLLM's); chat's is the room left.
COMPLETION_MAX_TOKENS = 16
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # OpenAI's; taken, one tier served

# Fields each route takes; others are refused by name (a typo or a feature forerun lacks).
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "ignore_eos",
    "user",
    "store",
    "metadata",
    "service_tier",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "skip_special_tokens",
    "prediction",
    *STRUCTURED_FIELDS,
}
_COMPLETIONS = _COMMON | {"prompt", "echo", "suffix"}
_CHAT = _COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
}
# Fields of OpenAI's or vLLM's API that forerun cannot honour, with the values that ask for nothing.
NEUTRAL: dict[str, tuple] = {
    "best_of": (None, 1),
    "tools": (None, []),  # chat's; a completion takes them only as these
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "length_penalty": (None, 1),
    "use_beam_search": (None, False),
}


class BadRequest(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code


class ClientGone(Exception):
    """The client hung up before its body arrived: nobody to answer."""


@dataclass
class Limits:
    """What the server allows a request."""

    max_model_len: int  # prompt plus max_tokens may not exceed it
    vocab_size: int  # token ids in a prompt must be below it
    max_body_bytes: int
    max_n: int = MAX_N
    max_prompts: int = MAX_PROMPTS

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * CHARS_PER_TOKEN


@dataclass
class Checked:
    """A request whose fields are all checked; its prompts still to tokenize."""

    chat: bool
    # Completions: text or token ids, one per prompt of the batch (choice p * n + i is prompt p's
    # sample i); chat: its turns, one prompt.
    prompts: list[str | list[int] | list[dict]]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per position; None: no logprobs
    echo: bool  # completions: the prompt leads the text (and its logprobs)
    body: dict = field(repr=False)
    structured: StructuredOutputsParams | None = None  # what the whole text must be (`serve.structured`)
    tools: ToolChoice | None = None  # chat: the functions offered and how they may be called
    skip_special_tokens: bool = True  # vLLM's: the text leaves out special tokens' (off to read their tool calls)
    suffix: str | None = None  # completions: the text after the gap each prompt's answer fills in
    # OpenAI's predicted output: text much of the answer is expected to be (its tokens once tokenized)
    prediction: str | tuple[int, ...] | None = None
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every streamed chunk has the usage so far
    truncate: int | None = None  # vLLM's truncate_prompt_tokens: each prompt's last this many tokens are kept
    cut: list[bool] = field(default_factory=list)  # once tokenized: which prompts truncate cut


# --- the body --------------------------------------------------------------------------------------


async def read_json(request, max_bytes: int, timeout: float) -> dict:
    """The body as a JSON object: 413 past `max_bytes`, 408 when it takes over `timeout` seconds to
    arrive, ClientGone when the client hangs up mid-body."""
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > max_bytes:
                    raise BadRequest(f"request body is over the limit of {max_bytes} bytes", None, 413)
    except TimeoutError:
        raise BadRequest(f"the request body did not arrive within {timeout:g} s", None, 408) from None
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    except ValueError:  # Python reads no integer of over sys.get_int_max_str_digits() digits
        raise BadRequest(
            "the request body is not valid JSON here: it holds an integer of thousands of digits; "
            "no field takes one, so send a number that fits its field"
        ) from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply to read; send a flat JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def not_served(model: str, names: tuple[str, ...]) -> BadRequest:
    """404 for a model this server does not serve, as OpenAI and vLLM answer it (`names`: the
    served model's name, then its aliases)."""
    also = f" (also as {', '.join(map(repr, names[1:]))})" if names[1:] else ""
    return BadRequest(
        f"model {shown(model)} is not served here; this server serves {names[0]!r}{also}",
        "model",
        status=404,
        code="model_not_found",
    )


def check(body: dict, chat: bool, names: tuple[str, ...], limits: Limits) -> Checked:
    """Every field of a completions (`chat` False) or chat request, before any tokenizing; `names`:
    the served model's name and aliases, one of which `model` must be."""
    _check_names(body, chat)
    _check_ignored(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        got = "" if model is None or model == "" else f", not {type(model).__name__}"
        raise BadRequest(f"'model' is required as a string{got}: the name /v1/models lists", "model")
    if model not in names:
        raise not_served(model, names)
    n = _samples(body, limits)
    stream = flag(body, "stream")
    include_usage, continuous_usage = _include_usage(body.get("stream_options"), stream)
    truncate = _truncation(body, limits)
    if chat:
        logprobs = integer(body, "top_logprobs", 0 if flag(body, "logprobs") else None)
        if logprobs is not None and not flag(body, "logprobs"):
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        name, echo, suffix = "top_logprobs", False, None
        prompts: list[str | list[int] | list[dict]] = [_chat_turns(body, limits)]
        _template_options(body, prompts[0])
        _template_kwargs(body)
    else:
        logprobs, name, echo = integer(body, "logprobs", None), "logprobs", flag(body, "echo")
        prompts = _completion_prompts(body, limits, truncate is not None)
        suffix = _suffix(body, echo, truncate is not None, limits)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be between 0 and {MAX_LOGPROBS}, got {logprobs}", name)
    try:
        structured = structured_output(body)
    except FieldError as exc:
        raise BadRequest(str(exc), exc.field) from None
    tools = _tools(body, structured) if chat else None
    if (structured is not None or (tools is not None and tools.forced)) and flag(body, "ignore_eos"):
        raise BadRequest("ignore_eos would write past the end of a structured output; leave it out", "ignore_eos")
    skip = body.get("skip_special_tokens") is None or flag(body, "skip_special_tokens")
    prediction = _prediction(body.get("prediction"), limits)
    return Checked(
        chat,
        prompts,
        n,
        stream,
        include_usage,
        logprobs,
        echo,
        body,
        structured,
        tools,
        skip,
        suffix,
        prediction,
        continuous_usage,
        truncate,
    )


def _samples(body: dict, limits: Limits) -> int:
    """n, and best_of only as n (forerun does not rank samples by likelihood)."""
    n = integer(body, "n", 1)
    if not 1 <= n <= limits.max_n:
        raise BadRequest(f"n must be between 1 and {limits.max_n}, got {n}", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise BadRequest(
            "best_of is not supported (it would rank samples by likelihood); leave it out or set it equal to n",
            "best_of",
        )
    return n


def _truncation(body: dict, limits: Limits) -> int | None:
    """vLLM's truncate_prompt_tokens: a prompt's last k tokens kept (-1: as many as the context holds)."""
    keep = integer(body, "truncate_prompt_tokens", None)
    if keep is None:
        return None
    if keep == -1:
        return limits.max_model_len
    if not 1 <= keep <= limits.max_model_len:
        raise BadRequest(
            f"truncate_prompt_tokens keeps a prompt's last k tokens: k from 1 to this server's context of "
            f"{limits.max_model_len}, or -1 for all it holds; got {keep}",
            "truncate_prompt_tokens",
        )
    return keep


def _prediction(value: object, limits: Limits) -> str | None:
    """OpenAI's predicted output, `{"type": "content", "content": text or text parts}`, as its text."""
    if value is None:
        return None
    shape = 'prediction must be {"type": "content", "content": the text expected, or a list of text parts}'
    if not isinstance(value, dict) or value.get("type") != "content" or set(value) - {"type", "content"}:
        raise BadRequest(f"{shape}, got {shown(value)}", "prediction")
    content = value.get("content")
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) and len(part) == 2
        for part in content
    ):
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise BadRequest(f"{shape}, got content {shown(content)}", "prediction")
    return text(content, "prediction", limits.max_prompt_chars)


def _suffix(body: dict, echo: bool, truncated: bool, limits: Limits) -> str | None:
    """A completion's suffix: the prompts are the text before a gap and this the text after it, and
    the answer fills the gap (a code model's fill-in-the-middle; `Tokenizer.infill`)."""
    suffix = body.get("suffix")
    if suffix is None:
        return None
    if not isinstance(suffix, str):
        raise BadRequest(f"suffix must be a string (the text after the gap), got {shown(suffix)}", "suffix")
    if echo:
        raise BadRequest("echo cannot be given with suffix: the answer fills a gap, not the prompt's end", "echo")
    if truncated:
        raise BadRequest(
            "truncate_prompt_tokens cannot go with suffix: cutting the prompt's start would cut the "
            "fill-in-the-middle markers; shorten the prompt instead",
            "truncate_prompt_tokens",
        )
    return text(suffix, "suffix", limits.max_prompt_chars)


def _tools(body: dict, structured: StructuredOutputsParams | None) -> ToolChoice | None:
    """Chat's tools, tool_choice and parallel_tool_calls; a forced call is a structured output of
    its own, so it takes no other."""
    try:
        tools = tool_choice(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except FieldError as exc:
        raise BadRequest(str(exc), exc.field) from None
    if tools is not None and tools.forced and structured is not None:
        other = next(name for name in STRUCTURED_FIELDS if body.get(name) is not None)
        raise BadRequest(
            f"tool_choice {tools.described} makes the answer a tool call, and {other} makes it something else; "
            "give one of them",
            "tool_choice",
        )
    return tools


def _template_kwargs(body: dict) -> dict | None:
    """vLLM's chat_template_kwargs: more variables for the chat template (Qwen3's enable_thinking)."""
    try:
        return check_template_kwargs(body.get("chat_template_kwargs")) or None
    except ForerunError as exc:
        raise BadRequest(str(exc), "chat_template_kwargs") from None


def _template_options(body: dict, turns: list[dict]) -> tuple[bool, bool]:
    """Chat's (add_generation_prompt, continue_final_message), as vLLM takes them: the assistant's turn
    opened (the default), or the last message, the assistant's, left open for the answer to go on."""
    open_turn = flag(body, "add_generation_prompt") if body.get("add_generation_prompt") is not None else True
    continue_final = flag(body, "continue_final_message")
    if continue_final and open_turn:
        raise BadRequest(
            "continue_final_message continues the last message, so it needs add_generation_prompt: false",
            "continue_final_message",
        )
    if continue_final and turns[-1]["role"] != "assistant":
        raise BadRequest(
            f"continue_final_message continues the last message, which must be the assistant's, not "
            f"{turns[-1]['role']!r}",
            "continue_final_message",
        )
    return open_turn, continue_final


def _check_ignored(body: dict) -> None:
    """Fields taken and ignored (they change nothing here) still have OpenAI's types."""
    for name in ("user", "service_tier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadRequest(f"{name} must be a string, got {shown(body[name])}", name)
    if body.get("service_tier") is not None and body["service_tier"] not in SERVICE_TIERS:
        raise BadRequest(
            f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {shown(body['service_tier'])}",
            "service_tier",
        )
    flag(body, "store")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise BadRequest('metadata must be an object of strings, such as {"key": "value"}', "metadata")


def _include_usage(options, stream: bool) -> tuple[bool, bool]:
    """stream_options' include_usage and vLLM's continuous_usage_stats (every chunk carries the usage
    so far; only beside include_usage); refused without `stream` (as OpenAI and vLLM do) and by name
    when it holds anything else."""
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise BadRequest('stream_options must be an object such as {"include_usage": true}', "stream_options")
    if options and not stream:
        raise BadRequest("stream_options is only allowed with stream: true; leave it out", "stream_options")
    for name, value in options.items():
        if name not in ("include_usage", "continuous_usage_stats"):
            raise BadRequest(
                f"stream_options has an unknown field {shown(name)}: it takes include_usage and continuous_usage_stats",
                "stream_options",
            )
        if value is not None and not isinstance(value, bool):
            raise BadRequest(f"stream_options.{name} must be true or false, got {shown(value)}", "stream_options")
    include, continuous = bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))
    if continuous and not include:
        raise BadRequest(
            "stream_options.continuous_usage_stats puts the usage in every chunk beside include_usage's last "
            "one: add include_usage: true",
            "stream_options",
        )
    return include, continuous


def _check_names(body: dict, chat: bool) -> None:
    taken = _CHAT if chat else _COMPLETIONS
    for name, value in body.items():
        if name in taken:
            continue
        if name in NEUTRAL and (name == "best_of" or any(value == neutral for neutral in NEUTRAL[name])):
            continue  # asks for nothing (best_of is checked against n)
        other = "/v1/completions" if chat else "/v1/chat/completions"
        if name in (_COMPLETIONS if chat else _CHAT):
            raise BadRequest(f"{name} belongs to {other}, not this route", name)
        if name in NEUTRAL:
            raise BadRequest(f"{name} is not supported by this server; leave it out", name)
        raise BadRequest(f"unknown field {shown(name)}: this route takes {', '.join(sorted(taken))}", name)


PROMPT_KINDS = (
    "prompt must be a string, a list of token ids, or a batch: a list of strings or token-id lists (all of one kind)"
)


def _completion_prompts(body: dict, limits: Limits, truncated: bool = False) -> list[str | list[int]]:
    """The prompts of a completions request: one (a string, a list of token ids, or a batch of one,
    as the client libraries send it) or a batch (a list of strings, or of token-id lists, as OpenAI
    and vLLM take it), every one checked before any runs; a refusal names the prompt of a batch.
    `truncated`: token ids beyond the context are taken (truncate_prompt_tokens keeps the last ones)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_whole(t) for t in prompt)):
        return [_one_prompt(prompt, limits, truncated)]
    if not isinstance(prompt, list):
        raise BadRequest(PROMPT_KINDS, "prompt")
    if not prompt:
        raise BadRequest("prompt is empty: give at least one token", "prompt")
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise BadRequest(PROMPT_KINDS, "prompt")
    if len(prompt) > limits.max_prompts:
        raise BadRequest(
            f"prompt is a batch of {len(prompt)} prompts; send at most {limits.max_prompts} in one request", "prompt"
        )
    prompts = []
    for index, one in enumerate(prompt):
        with naming_prompt(index, len(prompt)):
            prompts.append(_one_prompt(one, limits, truncated))
    return prompts


def _one_prompt(prompt, limits: Limits, truncated: bool = False) -> str | list[int]:
    """One prompt of a completions request: text within the characters' cap, or token ids of the
    vocabulary within the context."""
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty: give at least one character", "prompt")
        return text(prompt, "prompt", limits.max_prompt_chars)
    if isinstance(prompt, list) and prompt and all(is_whole(t) for t in prompt):
        try:
            ids = in_vocabulary(prompt, limits.vocab_size)
        except ForerunError as exc:
            raise BadRequest(str(exc), "prompt") from None
        if len(ids) > limits.max_model_len and not truncated:
            raise BadRequest(
                f"the prompt's {len(ids)} tokens are over this server's context of {limits.max_model_len}", "prompt"
            )
        return ids
    if isinstance(prompt, list) and not prompt:
        raise BadRequest("prompt is empty: give at least one token", "prompt")
    raise BadRequest(PROMPT_KINDS, "prompt")


@contextmanager
def naming_prompt(index: int, count: int) -> Iterator[None]:
    """A refusal of prompt `index` of a batch of `count` names it: "prompt[3]: ..." (a prompt alone
    keeps its message)."""
    try:
        yield
    except BadRequest as exc:
        if count == 1:
            raise
        raise BadRequest(f"prompt[{index}]: {exc.message}", exc.param, exc.status, exc.kind, exc.code) from None


def _chat_turns(body: dict, limits: Limits) -> list[dict]:
    try:
        turns = chat_turns(body.get("messages"))
    except ForerunError as exc:
        raise BadRequest(str(exc), "messages") from None
    for turn in turns:
        text(turn["content"], "messages", limits.max_prompt_chars)
    # what the template writes beside the texts: the functions offered and the calls made
    written = [body.get("tools") or [], *(t.get("tool_calls") or [] for t in turns)]
    chars = sum(len(t["content"]) for t in turns) + sum(len(json.dumps(w)) for w in written if w)
    if chars > limits.max_prompt_chars:
        raise BadRequest(
            f"the messages (and tools) hold {chars} characters, over this server's limit of "
            f"{limits.max_prompt_chars} ({CHARS_PER_TOKEN} per token of context); shorten them",
            "messages",
        )
    return turns


def sampling(
    checked: Checked, prompt_tokens: list[int], limits: Limits, fit: bool = False
) -> list[list[SamplingParams]]:
    """Per prompt (of `prompt_tokens` tokens each), one SamplingParams per choice: the same for every
    prompt but max_tokens' default (a completion's 16, chat's the room left, each within its prompt's
    room), and with a seed, sample i of every prompt seeded seed + i (as vLLM does). With `fit`, a
    max_tokens past the context's room is that room (it is a most, as llama.cpp reads it), not refused."""
    body = checked.body
    temperature, top_p = number(body, "temperature", 1.0), number(body, "top_p", 1.0)
    top_k = integer(body, "top_k", 0)
    if top_k == -1:
        top_k = 0  # vLLM's "off"
    if top_k < 0:
        raise BadRequest(f"top_k must be >= 0 (0 or -1 keep every token), got {top_k}", "top_k")
    max_tokens = []
    for index, length in enumerate(prompt_tokens):
        with naming_prompt(index, len(prompt_tokens)):
            max_tokens.append(_max_tokens(checked, length, limits, fit)[0])
    seed = integer(body, "seed", None)
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1] - (checked.n - 1):
        raise BadRequest(f"seed must be in [-2**63, 2**64 - n), got {seed}", "seed")
    stop = _stop_strings(body.get("stop"))
    stop_token_ids = _stop_token_ids(body.get("stop_token_ids"), limits.vocab_size)
    adjustments = _adjustments(body, limits.vocab_size)
    prompt_logprobs = checked.logprobs if checked.echo and checked.logprobs is not None else None
    try:
        return [
            [
                SamplingParams(
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    max_tokens=most,
                    stop=tuple(stop),
                    seed=None if seed is None else seed + i,
                    ignore_eos=flag(body, "ignore_eos"),
                    stop_token_ids=stop_token_ids,
                    include_stop_str_in_output=flag(body, "include_stop_str_in_output"),
                    logprobs=checked.logprobs,
                    prompt_logprobs=prompt_logprobs,
                    structured_outputs=checked.structured,
                    skip_special_tokens=checked.skip_special_tokens,
                    prediction=checked.prediction,
                    **adjustments,
                )
                for i in range(checked.n)
            ]
            for most in max_tokens
        ]
    except FieldError as exc:  # SamplingParams' own ranges, the field named
        raise BadRequest(str(exc), exc.field) from None
    except ForerunError as exc:
        raise BadRequest(str(exc), None) from None


def _adjustments(body: dict, vocab_size: int) -> dict:
    """logit_bias (token ids as strings, each in the vocabulary, to a number), the penalties,
    min_p and min_tokens, read as SamplingParams' fields (which check their ranges)."""
    fields = {name: number(body, name, 0.0) for name in ("presence_penalty", "frequency_penalty", "min_p")}
    fields["repetition_penalty"] = number(body, "repetition_penalty", 1.0)
    fields["min_tokens"] = integer(body, "min_tokens", 0)
    bias = body.get("logit_bias")
    if bias is None:
        return fields
    if not isinstance(bias, dict):
        raise BadRequest('logit_bias must be an object of token id to bias, such as {"50256": -100}', "logit_bias")
    fields["logit_bias"] = {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias names {len(bias)} tokens; give at most {MAX_LOGIT_BIAS}", "logit_bias")
    for key, value in bias.items():
        # JSON's keys are strings; a token id has at most as many digits as the vocabulary's size
        whole = key.isascii() and key.isdigit() and len(key) <= len(str(vocab_size))
        token = int(key) if whole else None
        if token is None or token >= vocab_size:
            raise BadRequest(
                f"logit_bias key {shown(key)} is no token id of this model (whole numbers below {vocab_size})",
                "logit_bias",
            )
        try:
            value = number(bias, key, None)
        except BadRequest:
            value = None
        if value is None:
            raise BadRequest(f"logit_bias values must be numbers in [-100, 100], got {shown(bias[key])}", "logit_bias")
        fields["logit_bias"][token] = value
    return fields


def _stop_token_ids(ids, vocab_size: int) -> tuple[int, ...]:
    """vLLM's stop_token_ids: token ids of this model, at most MAX_LOGIT_BIAS of them."""
    if ids is None:
        return ()
    if not isinstance(ids, list) or any(not is_whole(t) for t in ids):
        raise BadRequest("stop_token_ids must be a list of token ids, such as [151643]", "stop_token_ids")
    if len(ids) > MAX_LOGIT_BIAS:
        raise BadRequest(f"stop_token_ids lists {len(ids)} tokens; give at most {MAX_LOGIT_BIAS}", "stop_token_ids")
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise BadRequest(
            f"stop_token_ids names {outside[0]}, no token id of this model (whole numbers below {vocab_size})",
            "stop_token_ids",
        )
    return tuple(ids)


def _stop_strings(stop) -> tuple[str, ...]:
    """The stop strings, at most MAX_STOP of at most MAX_STOP_CHARS each: every step looks for each
    one in the text of every running request, so a long list would slow them all."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise BadRequest(f"stop lists {len(stop)} strings; give at most {MAX_STOP}", "stop")
    if any(not s for s in stop):
        raise BadRequest("stop strings must not be empty", "stop")
    for s in stop:
        if len(s) > MAX_STOP_CHARS:
            raise BadRequest(f"a stop string is {len(s)} characters; give at most {MAX_STOP_CHARS}", "stop")
        text(s, "stop", MAX_STOP_CHARS)
    return tuple(stop)


def _max_tokens(checked: Checked, prompt_tokens: int, limits: Limits, fit: bool = False) -> tuple[int, str]:
    """The most tokens to generate and the field that said so. `echo` with max_tokens 0 scores the
    prompt alone (evaluation harnesses): one token is generated and left out of the answer. `fit`:
    one past the context's room is the room (where there is any)."""
    body = checked.body
    room = limits.max_model_len - prompt_tokens
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = integer(body, name, None)
    if max_tokens is None or fit:
        if room < 1:
            where = "messages" if checked.chat else "prompt"
            raise BadRequest(
                f"the prompt's {prompt_tokens} tokens fill this server's context of {limits.max_model_len}, "
                f"leaving no room to generate; shorten the {where}",
                where,
            )
        default = room if checked.chat else min(COMPLETION_MAX_TOKENS, room)
        max_tokens = default if max_tokens is None else min(max_tokens, room)
    scoring = max_tokens == 0 and checked.echo
    if scoring:
        max_tokens = 1
    elif max_tokens < 1:
        raise BadRequest(f"{name} must be >= 1{'' if checked.chat else ' (0 only with echo)'}, got {max_tokens}", name)
    if scoring and room < 1:
        raise BadRequest(
            f"echo with {name} 0 scores a prompt of at most {limits.max_model_len - 1} tokens on this "
            f"server (its context is {limits.max_model_len}), and this one has {prompt_tokens}; shorten the prompt",
            "prompt",
        )
    if prompt_tokens + max_tokens > limits.max_model_len:
        raise BadRequest(
            f"the prompt ({prompt_tokens} tokens) plus {name} ({max_tokens}) is "
            f"{prompt_tokens + max_tokens} tokens, over this server's context of "
            f"{limits.max_model_len}; shorten the prompt or lower {name}",
            name,
        )
    return max_tokens, name


def scores_prompt_only(checked: Checked) -> bool:
    """echo with max_tokens 0: the answer is the prompt and its logprobs, nothing generated."""
    return checked.echo and checked.body.get("max_tokens") == 0


def tokenize(checked: Checked, tokenizer: Tokenizer | None, limits: Limits) -> list[list[int]]:
    """Each prompt's token ids (a prediction's too), and a structured output checked against the
    model's tokens (a forced tool call's made here, and its tags' text kept where the vocabulary marks
    them special: `grammar.tool_output`). Slow for long prompts (and a first structured output): the
    server runs it on a worker thread."""
    _tool_output(checked, tokenizer)
    if checked.prediction is not None:
        checked.prediction = _prediction_ids(checked.prediction, tokenizer, limits.max_model_len)
    prompts = checked.prompts
    ids = []
    for index, prompt in enumerate(prompts):
        with naming_prompt(index, len(prompts)):
            one = _tokenize_one(checked, prompt, tokenizer)
        checked.cut.append(checked.truncate is not None and len(one) > checked.truncate)
        ids.append(one[-checked.truncate :] if checked.cut[-1] else one)
    _check_structured(checked, tokenizer, limits)
    return ids


def _tool_output(checked: Checked, tokenizer: Tokenizer | None) -> None:
    """A forced tool call's structured output, made from the request's tools (`grammar.tool_output`)."""
    if checked.tools is not None and tokenizer is not None:
        try:
            forced, skip = grammar.tool_output(checked.tools, tokenizer)
        except ForerunError as exc:
            raise BadRequest(str(exc), "tools") from None
        checked.structured = forced or checked.structured
        checked.skip_special_tokens = checked.skip_special_tokens and skip


def _check_structured(checked: Checked, tokenizer: Tokenizer | None, limits: Limits) -> None:
    """The request's structured output checked against the model's tokens (400 where it cannot be followed)."""
    if checked.structured is not None:
        name = next((name for name in STRUCTURED_FIELDS if checked.body.get(name) is not None), "tool_choice")
        try:
            grammar.check_grammar(checked.structured, tokenizer, limits.vocab_size)
        except ForerunError as exc:
            if checked.tools is not None and checked.tools.forced:
                raise _faulty_tool(checked.tools, exc) from None
            raise BadRequest(f"{name}: {exc}", name) from None


def _faulty_tool(tools: ToolChoice, exc: ForerunError) -> BadRequest:
    """A forced call that cannot be followed, refused naming the function whose parameters are at
    fault where one alone is."""
    called = {function["name"] for function in tools.functions}
    for i, tool in enumerate(tools.tools):
        function = tool["function"]
        if function["name"] not in called:
            continue
        try:
            grammar.grammar_text(StructuredOutputsParams(json=function.get("parameters") or {"type": "object"}))
        except ForerunError as fault:
            reason = str(fault).removeprefix("the json cannot be followed: ")
            return BadRequest(
                f"tools[{i}] ({function['name']!r}): its parameters cannot be followed: {reason}", "tools"
            )
    return BadRequest(f"tool_choice: {exc}", "tool_choice")


def _tokenize_one(checked: Checked, prompt: str | list[int] | list[dict], tokenizer) -> list[int]:
    chat = checked.chat
    if checked.suffix is not None and (checked.suffix or _infills(tokenizer)):
        return _infill(prompt, checked.suffix, tokenizer)
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        return list(prompt)
    if tokenizer is None:
        raise BadRequest(
            "this model has no tokenizer: send prompt as a list of token ids to /v1/completions",
            "messages" if chat else "prompt",
        )
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else _templated(checked, prompt, tokenizer.apply_chat)
    if not ids:
        raise BadRequest("the prompt encodes to no tokens", "prompt")
    return ids


def chat_text(checked: Checked, tokenizer: Tokenizer, limits: Limits) -> str:
    """A checked chat request's prompt as text: its messages in the chat template, as it would run,
    after the checks `tokenize` makes of its tools and structured output against the vocabulary."""
    if checked.truncate is not None:
        raise BadRequest(
            "truncate_prompt_tokens cuts the prompt's tokens, not its text: leave it out here", "truncate_prompt_tokens"
        )
    _tool_output(checked, tokenizer)
    text = _templated(checked, checked.prompts[0], tokenizer.chat_text)
    _check_structured(checked, tokenizer, limits)
    return text


def _templated(checked: Checked, turns: list[dict], template: Callable[..., list[int] | str]) -> list[int] | str:
    """`template` (the tokenizer's apply_chat or chat_text) over a chat request's turns, with its
    options and tools; a template that rejects them a 400 naming messages."""
    tools = checked.tools.tools if checked.tools is not None else None
    try:
        options, kwargs = _template_options(checked.body, turns), _template_kwargs(checked.body)
        return template(turns, *options, tools=tools, template_kwargs=kwargs)
    except ForerunError as exc:
        raise BadRequest(str(exc), "messages") from None
    except Exception as exc:  # noqa: BLE001 - a template that rejects these turns
        raise BadRequest(f"the chat template rejected these messages: {exc}", "messages") from None


def _prediction_ids(prediction: str, tokenizer: Tokenizer | None, limit: int) -> tuple[int, ...]:
    """A prediction's tokens, made here (off the event loop, once), at most `limit` of them."""
    if tokenizer is None:
        raise BadRequest("this model has no tokenizer, so it cannot read a prediction; leave it out", "prediction")
    ids = tuple(tokenizer.hf.encode(prediction, add_special_tokens=False))
    if len(ids) > limit:
        raise BadRequest(f"the prediction's {len(ids)} tokens are over {limit}; shorten it", "prediction")
    return ids


def _infills(tokenizer: Tokenizer | None) -> bool:
    return tokenizer is not None and tokenizer.infill_markers is not None


def _infill(prefix: str | list[int], suffix: str, tokenizer: Tokenizer | None) -> list[int]:
    """A prompt with a suffix: the model's fill-in-the-middle prompt for the gap between them."""
    if tokenizer is None:
        raise BadRequest("this model has no tokenizer, so it cannot read a suffix; leave out suffix", "suffix")
    try:
        return tokenizer.infill(prefix, suffix)
    except ForerunError as exc:
        raise BadRequest(str(exc), "suffix") from None


# --- values ----------------------------------------------------------------------------------------


def shown(value, most: int = 80) -> str:
    """`value` as an error message quotes it: its repr, cut to `most` characters (a client's
    field may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."


def number(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_finite(value):
        got = f"an integer of {len(str(abs(value)))} digits" if is_whole(value) else shown(value)
        raise BadRequest(f"{name} must be a finite number, got {got}", name)
    return float(value)


def integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_whole(value):
        raise BadRequest(f"{name} must be a whole number, got {shown(value)}", name)
    return int(value)


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {shown(value)}", name)
    return value


def text(value: str, name: str, max_chars: int) -> str:
    """`value` if it is valid Unicode within `max_chars` characters."""
    if len(value) > max_chars:
        raise BadRequest(
            f"{name} is {len(value)} characters, over this server's limit of {max_chars} "
            f"({CHARS_PER_TOKEN} per token of context); shorten it",
            name,
        )
    try:
        return valid_unicode(value, name)
    except ForerunError as exc:
        raise BadRequest(str(exc), name) from None
