"""What /openapi.json and /docs say about the generation and token routes: the requests as pydantic models.

The models describe a request; they check nothing. Every check is in forerun/serve/requests.py,
which refuses what these would let through and names the field, so the routes read the raw body and
only point the schema here (`request_body`).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from forerun.base.config import SEED_RANGE
from forerun.base.tools import MAX_TOOLS
from forerun.serve.requests import MAX_LOGPROBS, MAX_N, MAX_PROMPTS, NEUTRAL, SERVICE_TIERS


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="the name /v1/models lists")
    max_tokens: int | None = Field(
        None, ge=1, description="most tokens to generate (default: 16 for a completion, the context's room for chat)"
    )
    temperature: float | None = Field(None, ge=0, description="0 (or below 1e-5) is greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 keep every token")
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1] - MAX_N)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=MAX_N, description="samples of the prompt (seeds seed, seed+1, ...)")
    stream: bool | None = None
    stream_options: dict | None = Field(
        None, description='{"include_usage": true}, and vLLM\'s "continuous_usage_stats": true for usage in every chunk'
    )
    ignore_eos: bool | None = None
    user: str | None = None
    store: bool | None = Field(None, description="taken and ignored: nothing is stored")
    metadata: dict[str, str] | None = Field(None, description="taken and ignored")
    service_tier: Literal[SERVICE_TIERS] | None = Field(None, description="taken and ignored: one tier")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) to a bias in [-100, 100]")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0, description="no stop token or stop string before this many tokens")
    stop_token_ids: list[int] | None = Field(None, description="vLLM's: tokens that end generation, their text kept")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="vLLM's: keep each prompt's last k tokens (-1: as many as the context holds)"
    )
    include_stop_str_in_output: bool | None = Field(
        None, description="vLLM's: the stop string that ended the text stays in it (default false)"
    )
    skip_special_tokens: bool | None = Field(
        None, description="vLLM's: false keeps special tokens' text (default true)"
    )
    prediction: dict | None = Field(
        None,
        description='OpenAI\'s predicted output, {"type": "content", "content": text or text parts}: text much '
        "of the answer is expected to be (a file an edit rewrites); drafted from, so only the speed changes",
    )
    response_format: dict | None = Field(
        None,
        description='{"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema": '
        '{"name": ..., "schema": {a JSON schema}}}: the text follows it',
    )
    structured_outputs: dict | None = Field(
        None,
        description="vLLM's: one of json (a JSON schema), regex, choice (a list of strings), grammar (Lark), "
        "json_object (true), with disable_any_whitespace, disable_additional_properties and whitespace_pattern; "
        "the text follows it",
    )
    guided_json: dict | str | None = Field(None, description="vLLM's older structured_outputs.json")
    guided_regex: str | None = Field(None, description="vLLM's older structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="vLLM's older structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="vLLM's older structured_outputs.grammar")


class CompletionRequest(_Request):
    prompt: (
        str
        | list[int]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(description="text, or token ids; or a batch of either (choice p * n + i: prompt p's sample i)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="alternatives listed per token")
    echo: bool | None = Field(None, description="the prompt leads the text (max_tokens 0: the prompt alone)")
    suffix: str | None = Field(
        None,
        description="the text after the gap: each prompt is the text before it, and the answer fills it in "
        "(a code model's fill-in-the-middle tokens; not with echo)",
    )


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object, as text")


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # an answer's empty fields sent back (base/chat.py EMPTY_ONLY)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = Field(
        None, description="text, or text parts (joined); null beside tool_calls"
    )
    name: str | None = Field(None, description="passed to the chat template")
    tool_call_id: str | None = Field(None, description="a tool result's call; passed to the chat template")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's calls, as its answer gave them")
    reasoning_content: str | None = Field(
        None, description="an answer's reasoning, as given back; passed to the template"
    )
    reasoning: str | None = Field(None, description="vLLM's newer name for reasoning_content")


class Function(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="a forced call's arguments take no property the schema does not name")


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class NamedTool(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(
        None, max_length=MAX_TOOLS, description="functions the chat template shows the model; calls read back"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = Field(
        None, description="auto (the default with tools): the model may call; required or a named function: it must"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: a required call is one call")
    add_generation_prompt: bool | None = Field(None, description="open the assistant's turn (default true)")
    continue_final_message: bool | None = Field(
        None, description="leave the last (assistant) message open to continue it; needs add_generation_prompt false"
    )
    chat_template_kwargs: dict | None = Field(
        None, description="vLLM's: more variables for the chat template, such as Qwen3's {\"enable_thinking\": false}"
    )


class InputText(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputItem(BaseModel):
    model_config = ConfigDict(extra="allow")  # an earlier answer's items sent back (id, status, ...)
    type: Literal["message", "function_call", "function_call_output", "reasoning"] | None = Field(
        None, description="message when left out or null; a reasoning item's text goes to the assistant turn after it"
    )
    role: Literal["system", "developer", "user", "assistant"] | None = Field(None, description="a message's")
    content: str | list[InputText] | None = Field(None, description="a message's text, or text parts (joined)")
    call_id: str | None = Field(None, description="a function call's, and its output's")
    name: str | None = Field(None, description="a function call's function")
    arguments: str | None = Field(None, description="a function call's arguments: a JSON object, as text")
    output: str | list[InputText] | None = Field(None, description="a function call's result")


class FunctionTool(Function):
    type: Literal["function"]


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="json_schema's JSON schema")
    strict: bool | None = None
    description: str | None = None


class ResponsesText(BaseModel):
    format: TextFormat | None = None


class _VllmSampling(BaseModel):
    """vLLM's sampling fields that its other APIs (Responses, Messages) take as chat does."""

    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1] - MAX_N, description="vLLM's, as in chat")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    structured_outputs: dict | None = Field(None, description="vLLM's: json, regex, choice or grammar, as in chat")


class ResponsesRequest(_VllmSampling):
    """OpenAI's Responses API, read as the chat request it amounts to (forerun/serve/responses_api.py)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="the name /v1/models lists")
    input: str | list[InputItem] | None = Field(
        None, description="the user's text, or the conversation's items in order (may be left out after a stored one)"
    )
    instructions: str | None = Field(None, description="a system turn before the input")
    max_output_tokens: int | None = Field(
        None, ge=1, description="most tokens to generate (default: the context's room)"
    )
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = Field(None, description="Responses' typed events: response.created ... response.completed")
    stream_options: dict | None = Field(None, description='{"include_obfuscation": ...}: taken and ignored')
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS, description="function tools only")
    tool_choice: Literal["none", "auto", "required"] | dict | None = Field(
        None, description='auto, none, required or {"type": "function", "name": ...}'
    )
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = Field(None, description="text.format: text, json_object or json_schema")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="with it, output_text carries logprobs")
    include: list[Literal["message.output_text.logprobs"]] | None = None
    store: bool | None = Field(
        None, description="keep the response in this server's memory (default true): previous_response_id, GET"
    )
    metadata: dict[str, str] | None = Field(None, description="repeated in the response")
    user: str | None = None
    service_tier: Literal[SERVICE_TIERS] | None = Field(None, description="taken and ignored: one tier")
    truncation: Literal["disabled"] | None = Field(None, description="an input over the context is refused")
    reasoning: dict | None = Field(None, description="not supported: taken only as null or with null settings")
    previous_response_id: str | None = Field(
        None, description="a stored response (store, the default): its conversation goes before the input"
    )
    background: Literal[False] | None = None
    conversation: None = Field(None, description="not supported: name a stored response as previous_response_id")
    prompt: None = Field(None, description="not supported: no stored prompt templates")
    max_tool_calls: None = None
    top_k: int | None = Field(None, ge=-1, description="vLLM's, as in chat")
    stop: str | list[str] | None = None
    chat_template_kwargs: dict | None = Field(None, description="more variables for the chat template, as in chat")


class MessageBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations, signature: taken
    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: str | None = Field(None, description="a text block's")
    id: str | None = Field(None, description="a tool_use block's call id")
    name: str | None = Field(None, description="a tool_use block's tool")
    input: dict | None = Field(None, description="a tool_use block's arguments")
    tool_use_id: str | None = Field(None, description="a tool_result block's call")
    content: str | list[MessageBlock] | None = Field(None, description="a tool_result block's text")
    thinking: str | None = Field(None, description="a thinking block's reasoning, passed to the template")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[MessageBlock]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control: taken
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict = Field(description="a JSON schema of the input object")
    type: Literal["custom"] | None = Field(None, description="client tools only: no server tools")
    strict: bool | None = Field(None, description="a forced call's input takes no property the schema does not name")


class _MessagesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="the name /v1/models lists")
    messages: list[Message] = Field(min_length=1, description="ending with the assistant's: its text is continued")
    system: str | list[MessageBlock] | None = Field(None, description="a system turn before the messages")
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: dict | None = Field(None, description='{"type": "auto", "any", "none" or "tool", "name"}')
    thinking: dict | None = Field(
        None,
        description='{"type": "enabled", "adaptive", "between_tools" or "disabled", "display"}: the template\'s '
        "enable_thinking; a budget taken, not enforced",
    )
    chat_template_kwargs: dict | None = Field(None, description="more variables for the chat template, as in chat")
    cache_control: dict | None = Field(None, description="taken and ignored: the prefix cache works unasked")
    output_config: dict | None = Field(
        None, description='{"format": {"type": "json_schema", "schema"}} for JSON; "effort" taken and ignored'
    )
    speed: Literal["standard", "fast"] | None = Field(None, description="taken and ignored: speculation always runs")
    inference_geo: str | None = Field(None, description="taken and ignored")
    diagnostics: dict | None = Field(None, description="taken and ignored")
    user_profile_id: str | None = Field(None, description="taken and ignored")
    workspace_id: str | None = Field(None, description="taken and ignored")


class CountTokensRequest(_MessagesBody):
    """Anthropic's /v1/messages/count_tokens: the prompt's tokens (forerun/serve/messages_api.py)."""


class MessagesRequest(_MessagesBody, _VllmSampling):
    """Anthropic's Messages API, read as the chat request it amounts to (forerun/serve/messages_api.py)."""

    max_tokens: int = Field(ge=1, description="most tokens to generate")
    metadata: dict | None = Field(None, description='{"user_id": ...}: chat\'s user')
    stop_sequences: list[str] | None = None
    stream: bool | None = Field(None, description="Anthropic's events: message_start ... message_stop")
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=-1)
    top_p: float | None = Field(None, gt=0, le=1)
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="taken and ignored: one tier")
    container: None = Field(None, description="not supported: no code-execution containers")


class LlamaCompletionRequest(BaseModel):
    """llama.cpp's /completion (forerun/serve/llamacpp_api.py): its defaults where a field is left out."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="taken and ignored: the served model answers")
    prompt: str | list[int] = Field(description="text (BOS first where the model adds one) or token ids")
    n_predict: int | None = Field(
        None, ge=-1, description="most tokens to write (-1, the default: to the context's end; 0: none)"
    )
    max_tokens: int | None = Field(None, ge=-1, description="n_predict's other name, read where n_predict is left out")
    temperature: float | None = Field(None, ge=0, description="default 0.8")
    top_k: int | None = Field(None, ge=-1, description="default 40")
    top_p: float | None = Field(None, gt=0, le=1, description="default 0.95")
    min_p: float | None = Field(None, ge=0, le=1, description="default 0.05")
    stop: list[str] | None = None
    stream: bool | None = Field(None, description="data: chunks of new content, then one with stop true")
    seed: int | None = Field(None, ge=-1, description="-1 (the default): a random one")
    ignore_eos: bool | None = None
    logit_bias: list[list[int | float | bool]] | dict[str, float] | None = Field(
        None, description="[[token id, bias or false], ...] or {token id: bias}"
    )
    json_schema: dict | None = Field(None, description="the answer follows this JSON schema")
    return_tokens: bool | None = Field(None, description="the answer's token ids beside its text")
    response_fields: list[str] | None = Field(None, description='only these fields, keys or paths ("timings/prompt_n")')
    cache_prompt: bool | None = Field(None, description="taken and ignored: forerun's prefix cache is always on")
    id_slot: int | None = Field(None, description="taken and ignored")
    samplers: list[str] | None = Field(
        None, description="which of temperature, top_k, top_p and min_p apply (one left out is off); no infill sampler"
    )
    n_cmpl: int | None = Field(None, ge=1, le=MAX_N, description="completions of the prompt: a list of answers")
    t_max_prompt_ms: int | None = Field(None, description="taken and ignored: no time limit")
    t_max_predict_ms: int | None = Field(None, description="taken and ignored: no time limit")
    n_indent: int | None = Field(None, description="taken and ignored: no stop on a dedent")
    n_keep: int | None = Field(None, description="taken and ignored")
    n_probs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="completion_probabilities: n likeliest")
    typical_p: Literal[1] | None = None
    dynatemp_range: Literal[0] | None = None
    mirostat: Literal[0] | None = None
    xtc_probability: Literal[0] | None = None
    dry_multiplier: Literal[0] | None = None
    grammar: Literal[""] | None = Field(None, description="not supported: use json_schema")
    repeat_penalty: Literal[1] | None = Field(None, description="not supported: 1 only")
    presence_penalty: Literal[0] | None = None
    frequency_penalty: Literal[0] | None = None
    post_sampling_probs: Literal[False] | None = None


class ExtraFile(BaseModel):
    filename: str | None = Field(None, description='default "tmp"')
    text: str


class LlamaInfillRequest(LlamaCompletionRequest):
    """llama.cpp's /infill: the gap between input_prefix and input_suffix, other files before it."""

    prompt: str | None = Field(None, description="text after the prefix, where the answer goes on from")
    input_prefix: str | None = Field(None, description="the code before the gap")
    input_suffix: str | None = Field(None, description="the code after the gap")
    input_extra: list[ExtraFile] | None = Field(None, description="other files, written before the prefix")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="the served model's name, or left out")
    prompt: str | None = Field(None, description="text; or send messages")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="a chat, in the chat template")
    add_generation_prompt: bool | None = Field(None, description="messages: open the assistant's turn (default true)")
    continue_final_message: bool | None = Field(None, description="messages: leave the last message open")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="messages: functions the template shows")
    chat_template_kwargs: dict | None = Field(None, description="messages: more variables for the chat template")
    add_special_tokens: bool | None = Field(
        None,
        description="the tokens the tokenizer puts around a text (BOS); default true for a prompt, false for messages",
    )
    return_token_strs: bool | None = Field(None, description="each token's text beside its id")
    content: str | list[str | int] | None = Field(
        None, description="llama.cpp's body: text, or texts and token ids in order (instead of prompt or messages)"
    )
    add_special: bool | None = Field(None, description="with content: BOS first where the model has one (false)")
    parse_special: bool | None = Field(None, description="with content: special tokens' text read as them (true)")
    with_pieces: bool | None = Field(None, description="with content: each id with its piece")


class ApplyTemplateRequest(ChatCompletionRequest):
    """llama.cpp's /apply-template: a chat request's body, whose `model` may be left out."""

    model: str | None = Field(None, description="the served model's name, or left out")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="the served model's name, or left out")
    tokens: list[int] = Field(description="token ids of the served model")


def request_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its JSON body is `model` (listed in the components by `openapi_schema`)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


def openapi_schema(app: FastAPI) -> dict:
    """`app`'s schema with the request models in its components; built once, then kept on the app."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (
            CompletionRequest,
            ChatCompletionRequest,
            ResponsesRequest,
            MessagesRequest,
            CountTokensRequest,
            LlamaCompletionRequest,
            LlamaInfillRequest,
            TokenizeRequest,
            DetokenizeRequest,
            ApplyTemplateRequest,
        ):
            spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(spec.pop("$defs", {}))
            generates = model in (CompletionRequest, ChatCompletionRequest, ApplyTemplateRequest)
            for name, values in NEUTRAL.items() if generates else ():  # fields taken only when they ask for nothing
                shown = " or ".join(json.dumps(v) for v in values)
                spec["properties"].setdefault(name, {"description": f"not supported: taken only as {shown}"})
            components[model.__name__] = spec
        app.openapi_schema = schema
    return app.openapi_schema
