"""The vLLM-shaped Python API: LLM(model=..., speculative_model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from numbers import Integral

from forerun import drafters
from forerun.base.chat import chat_turns
from forerun.base.config import SamplingParams, SpeculativeConfig, is_finite
from forerun.base.errors import ForerunError
from forerun.base.prompts import in_vocabulary
from forerun.base.tools import tool_choice
from forerun.engine.engine import Engine, RequestOutput
from forerun.engine.metrics import SpecMetrics
from forerun.models import formats
from forerun.models.load import LoadedModel, load_model
from forerun.models.prefix_cache import PREFIX_CACHE_MB, PrefixCache, token_bytes
from forerun.models.source import resolve
from forerun.policy.draft_length import DraftLengthPolicy
from forerun.policy.pass_costs import cached_pass_costs
from forerun.verification.logprobs import TokenLogprob

PROMPT_FORMS = (
    'a prompt is a string, a list of token ids, a list of chat messages ({"role", "content"}) '
    'or vLLM\'s {"prompt": text} or {"prompt_token_ids": ids} (either with "suffix": the text after a gap '
    "the answer fills in)"
)
VLLM_PROMPT_KEYS = ("prompt", "prompt_token_ids")


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # each of token_ids', when SamplingParams.logprobs asks
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it


@dataclass
class GenerationResult:
    prompt: str | list[dict] | list[int]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one completion per prompt (vLLM's shape)
    elapsed_s: float  # generation only, model loading excluded
    first_token_s: float
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # each prompt token's (entry 0 None), if asked
    # With SamplingParams.prediction: (accepted, rejected) prediction tokens, as OpenAI's usage counts them
    prediction_tokens: tuple[int, int] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after the first: the decode rate alone, as
        llama.cpp reports it (its prompt processing is the time to the first token)."""
        decode_s = self.elapsed_s - self.first_token_s
        return (len(self.token_ids) - 1) / decode_s if len(self.token_ids) > 1 and decode_s > 0 else 0.0


class LLM:
    """A target model, optionally with a drafter, ready to generate.

    speculative_method picks the drafter by name; speculative_model implies "auto". Any further
    keyword arguments in `speculative_options` go to the drafter alone. num_speculative_tokens is
    the most a step drafts: with speculative_k_policy "adaptive" each step drafts the length that
    pays best (0 when drafts keep failing; policy/draft_length.py), with "fixed" always that many.
    A draft model takes `quantization` too unless speculative_options["quantize"] names its own
    ("auto" picks per model: for a GGUF draft, `q4_0`).
    prefix_cache_mb bounds the prompt rows kept for later prompts that start the same (0: none kept;
    models/prefix_cache.py). kv_cache_dtype (auto, float32, float16) is what the target's and a
    draft model's KV caches store; None leaves each loaded model's own (auto: float16 where the
    native layers run, as llama.cpp's cache, else the activations' dtype).
    """

    def __init__(
        self,
        model: str | LoadedModel,
        speculative_model: str | LoadedModel | None = None,
        num_speculative_tokens: int = 5,
        speculative_method: str | None = None,
        speculative_options: dict | None = None,
        dtype: str = "bfloat16",
        device: str = "cpu",
        quantization: str | None = None,
        speculative_k_policy: str = "adaptive",
        prefix_cache_mb: float = PREFIX_CACHE_MB,
        kv_cache_dtype: str | None = None,
        **unknown: object,
    ) -> None:
        _check_unknown_args(unknown)
        _check_llm_args(model, speculative_method, prefix_cache_mb, device)
        _check_speculative_args(speculative_model, speculative_method, speculative_options)
        speculative_model, speculative_options = _named_by_text(speculative_model, speculative_options)
        draft = speculative_model if speculative_model is not None else (speculative_options or {}).get("model")
        if isinstance(draft, str):
            resolve(draft)  # a draft model that is not there is named before the target loads (minutes)
        if isinstance(model, LoadedModel):
            self.target = model
            if quantization is not None:
                formats.quantize_(self.target.decoder, quantization)
        else:
            self.target = load_model(model, dtype, device, quantization=quantization)
        if kv_cache_dtype is not None:
            self.target.decoder.set_kv_cache_dtype(kv_cache_dtype)
        self.last_result: GenerationResult | None = None
        options = dict(speculative_options or {})
        if speculative_model is not None:
            speculative_method = _with_draft_model(options, speculative_model, speculative_method, quantization)
            options.setdefault("dtype", dtype)
            options.setdefault("device", device)
        if kv_cache_dtype is not None and "model" in options:  # a draft model's caches too
            options.setdefault("kv_cache_dtype", kv_cache_dtype)
        if drafters.needs_draft_model(speculative_method) and "model" not in options:
            raise ForerunError(f"speculative_method {speculative_method!r} drafts with a model: give speculative_model")
        spec = SpeculativeConfig(speculative_method, num_speculative_tokens, options, speculative_k_policy)
        if speculative_method is not None and num_speculative_tokens > self.target.decoder.cfg.max_position:
            raise ForerunError(f"num_speculative_tokens {num_speculative_tokens} is beyond the model's context")
        # A draft model named by path is loaded once here, so every engine's drafter (one per
        # batched sequence) shares the weights.
        self.spec = dataclasses.replace(spec, options=_with_draft_loaded(options, dtype, device, self.target))
        self.drafter_memory: object | None = None  # what the drafters remember, shared by every engine's
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20)) if prefix_cache_mb > 0 else None
        self.draft_prefix_cache: PrefixCache | None = None  # a draft model's own, shared by every engine's drafter
        self.engine = self.new_engine()

    def new_engine(self) -> Engine:
        """An engine of its own (drafter, cost policy) over this LLM's weights: one per sequence
        generated at once (engine/batch.py)."""
        spec = self.spec
        drafter = None
        if spec.method:
            memory = self.drafter_memory
            options = spec.options if memory is None else {"memory": memory, **spec.options}
            drafter = drafters.create(spec.method, self.target, options)
            # Earlier outputs remembered once for all engines: a server's lane drafts from what any
            # earlier request answered (suffix.py).
            self.drafter_memory = memory if memory is not None else drafter.memory
            if self.prefix_cache is not None:  # a draft model keeps as many prompt tokens as the target
                tokens = self.prefix_cache.max_bytes // token_bytes(self.target.decoder)
                self.draft_prefix_cache = drafter.keep_prefixes(self.draft_prefix_cache, tokens)
        policy = None
        if drafter is not None and spec.k_policy == "adaptive":
            policy = DraftLengthPolicy(cached_pass_costs(self.target), spec.num_speculative_tokens)
        return Engine(self.target, drafter, spec.num_speculative_tokens, policy, self.prefix_cache)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def _prompt_ids(self, prompt: str | list[int] | list[dict] | dict) -> list[int]:
        if isinstance(prompt, dict):
            before, suffix = _vllm_prompt(prompt)
            no_markers = self.tokenizer is None or self.tokenizer.infill_markers is None
            if suffix is None or (suffix == "" and no_markers):  # as the server takes an empty one
                return self._prompt_ids(before)
            if self.tokenizer is None:
                raise ForerunError("this model has no tokenizer, so it cannot read a suffix: leave it out")
            prefix = before if isinstance(before, str) else self._prompt_ids(before)
            return self.tokenizer.infill(prefix, suffix)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ForerunError("this model has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise ForerunError(f"{PROMPT_FORMS}, not a {type(prompt).__name__}")
        if prompt and all(isinstance(m, dict) for m in prompt):
            if self.tokenizer is None:
                raise ForerunError("this model has no tokenizer (and no chat template): pass token ids")
            return self.tokenizer.apply_chat(chat_turns(prompt))
        if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
            kinds = sorted({type(t).__name__ for t in prompt})
            raise ForerunError(f"{PROMPT_FORMS}, not a list of {' and '.join(kinds)}")
        return in_vocabulary(prompt, self.target.decoder.cfg.vocab_size)

    def check_prompt(self, prompt: str | list[int] | list[dict] | dict, params: SamplingParams) -> list[int]:
        """The prompt's token ids; a clear error where it cannot run with `params` (empty, beyond the
        context, a logit bias beyond the vocabulary). A caller checks every prompt before generating any."""
        ids = self._prompt_ids(prompt)
        self.engine.check_fits(ids, params)
        return ids

    def generate(
        self, prompts: str | Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Prompts are strings, token-id lists, chat message lists or vLLM's prompt dicts; `params` is
        one SamplingParams for all or, as in vLLM, a list of one per prompt. Every prompt is checked
        before any runs."""
        prompts = _prompt_list(prompts)
        each = _params_per_prompt(params, len(prompts), "prompts")
        ids = [self.check_prompt(p, one) for p, one in zip(prompts, each)]
        return [self._run(p, one, i) for p, one, i in zip(prompts, each, ids)]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[GenerationResult]:
        """One conversation (a list of {"role", "content"}) or a list of them; as in vLLM, the
        assistant's turn is opened, or with `continue_final_message` (and `add_generation_prompt`
        False) the last, assistant's message is left open for the answer to go on. `tools` (OpenAI's
        {"type": "function", "function": ...} entries) go to the chat template, as vLLM's `LLM.chat`
        passes them; `forerun.base.tools.CallReader` reads the calls back from the text, and
        `SamplingParams.structured_outputs` may hold the answer to a call
        (`verification.grammar.tool_call_grammar`). `chat_template_kwargs`: more of the template's
        variables, as vLLM's (Qwen3's `{"enable_thinking": False}`)."""
        if not isinstance(messages, (list, tuple)) or not all(isinstance(c, (list, tuple, dict)) for c in messages):
            raise ForerunError('messages are a list of {"role", "content"} objects, or a list of such lists')
        for name, value in (
            ("add_generation_prompt", add_generation_prompt),
            ("continue_final_message", continue_final_message),
        ):
            if not isinstance(value, bool):
                raise ForerunError(f"{name} must be True or False, got {value!r}")
        if continue_final_message and add_generation_prompt:
            raise ForerunError("continue_final_message continues the last message: pass add_generation_prompt=False")
        if self.tokenizer is None:
            raise ForerunError("this model has no tokenizer (and no chat template): pass token ids to generate")
        offered = tool_choice(tools)  # checked as the server checks a request's
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        each = _params_per_prompt(params, len(conversations), "conversations")
        runs = []  # every conversation checked before any runs
        for conversation, one in zip(conversations, each):
            turns = chat_turns(conversation)
            if continue_final_message and turns[-1]["role"] != "assistant":
                raise ForerunError(
                    f"continue_final_message needs the assistant's message last, not {turns[-1]['role']!r}"
                )
            ids = self.tokenizer.apply_chat(
                turns,
                add_generation_prompt,
                continue_final_message,
                offered.tools if offered else None,
                chat_template_kwargs,
            )
            self.engine.check_fits(ids, one)
            runs.append((turns, one, ids))
        return [self._run(turns, one, ids) for turns, one, ids in runs]

    def stream(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None) -> Iterator[str]:
        """Text pieces as they become final; the finished result is then in `last_result`."""
        _check_params(params)
        params = params or SamplingParams()
        ids = self.check_prompt(prompt, params)
        done: list[RequestOutput] = []
        for step in self.engine.stream(ids, params, done):
            if step.text:
                yield step.text
        self.last_result = self._result(prompt, ids, done[0])

    def _run(self, prompt, params: SamplingParams, ids: list[int]) -> GenerationResult:
        """`prompt` generated from `ids`, its tokens."""
        self.last_result = self._result(prompt, ids, self.engine.generate(ids, params))
        return self.last_result

    @staticmethod
    def _result(prompt, ids: list[int], out: RequestOutput) -> GenerationResult:
        completion = CompletionOutput(out.text, out.token_ids, out.finish_reason, out.logprobs, out.stop_reason)
        return GenerationResult(
            prompt,
            ids,
            [completion],
            out.elapsed_s,
            out.first_token_s,
            out.metrics,
            out.prompt_logprobs,
            out.prediction_tokens,
        )


def _check_unknown_args(unknown: dict) -> None:
    """Name arguments LLM does not take (vLLM's own among them) before any model is loaded."""
    if unknown:
        import inspect

        known = [p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "unknown")]
        raise ForerunError(
            f"LLM does not take {', '.join(sorted(unknown))}; it takes {', '.join(known)} "
            "(SamplingParams takes the sampling settings)"
        )


def _check_llm_args(model: object, method: object, prefix_cache_mb: object, device: object) -> None:
    # Finite: an infinite budget has no size in bytes.
    if not is_finite(prefix_cache_mb) or not prefix_cache_mb >= 0:
        raise ForerunError(f"prefix_cache_mb must be a number, 0 (none) or more, got {prefix_cache_mb!r}")
    if not isinstance(model, (str, os.PathLike, LoadedModel)):
        raise ForerunError(f"model must be a name, a path or a LoadedModel, not {type(model).__name__}")
    if method is not None and (not isinstance(method, str) or not method):
        raise ForerunError(f"speculative_method must name a drafter, or be None for none; got {method!r}")
    if not isinstance(device, str):
        raise ForerunError(f"device must be a string (cpu or cuda), got {device!r}")


def _check_speculative_args(draft: object, method: object, options: object) -> None:
    """The draft model and the drafter's options of the right kind, and options only with a drafter."""
    if options is not None and not isinstance(options, dict):
        raise ForerunError(
            f"speculative_options must be a dict of the drafter's settings (e.g. {{'ngram_max': 3}}), "
            f"not a {type(options).__name__}"
        )
    for name, value in (("speculative_model", draft), ('speculative_options["model"]', (options or {}).get("model"))):
        if value is not None and not isinstance(value, (str, os.PathLike, LoadedModel)):
            raise ForerunError(f"{name} must be a name, a path or a LoadedModel, not {type(value).__name__}")
    if options and method is None and draft is None:
        raise ForerunError(
            f"speculative_options ({', '.join(map(str, options))}) go to a drafter, but none is named: "
            "give speculative_method (or speculative_model), or leave the options out"
        )


def _check_params(params: object, what: str = "params") -> None:
    if params is not None and not isinstance(params, SamplingParams):
        raise ForerunError(
            f"{what} must be a SamplingParams (e.g. SamplingParams(max_tokens=64)), not a {type(params).__name__}"
        )


def _params_per_prompt(params: object, count: int, what: str) -> list[SamplingParams]:
    """One SamplingParams for each of `count` prompts: `params` for all, or (vLLM's form) a list of
    one per prompt."""
    if not isinstance(params, (list, tuple)):
        _check_params(params)
        return [params if params is not None else SamplingParams()] * count
    if len(params) != count:
        raise ForerunError(
            f"params is a list of {len(params)} SamplingParams for {count} {what}: "
            "give one per prompt, or a single SamplingParams for all"
        )
    for index, one in enumerate(params):
        _check_params(one, f"params[{index}]")
    return list(params)


def _prompt_list(prompts: object) -> list:
    """`prompts` as a list of prompts: one prompt (text, token ids, messages, a vLLM prompt dict) is a
    list of one."""
    if _is_vllm_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, (str, list, tuple)):
        raise ForerunError(f"prompts are one prompt or a list of them ({PROMPT_FORMS}), not a {type(prompts).__name__}")
    # Integral, not int: a numpy integer is a token id too.
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], Integral)):
        return [prompts]
    if prompts and isinstance(prompts[0], dict) and not _is_vllm_prompt(prompts[0]):
        return [prompts]  # one conversation's messages
    return list(prompts)


def _is_vllm_prompt(prompt: object) -> bool:
    """vLLM's {"prompt": text} or {"prompt_token_ids": ids}: a dict that is no chat message."""
    return isinstance(prompt, dict) and "role" not in prompt and any(key in prompt for key in VLLM_PROMPT_KEYS)


def _vllm_prompt(prompt: dict) -> tuple[str | list, str | None]:
    """The text or the token ids of a vLLM prompt dict, and its suffix (None without one: a prompt
    with one is the text before a gap, `Tokenizer.infill`); a clear error for any other dict."""
    given = [key for key in VLLM_PROMPT_KEYS if key in prompt]
    others = sorted(map(str, set(prompt) - {*VLLM_PROMPT_KEYS, "suffix"}))
    if len(given) != 1 or others:
        why = f"it has {', '.join(others)}" if others else "it has " + (" and ".join(given) or "neither")
        raise ForerunError(f"{PROMPT_FORMS}; a prompt dict holds exactly one of prompt and prompt_token_ids: {why}")
    value = prompt[given[0]]
    if given[0] == "prompt" and not isinstance(value, str):
        raise ForerunError(f'a prompt dict\'s "prompt" is text, not a {type(value).__name__}')
    if given[0] == "prompt_token_ids" and (
        not isinstance(value, (list, tuple)) or any(isinstance(t, (dict, list, tuple)) for t in value)
    ):
        raise ForerunError(f'a prompt dict\'s "prompt_token_ids" is a list of token ids, got {value!r:.80}')
    suffix = prompt.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise ForerunError(f'a prompt dict\'s "suffix" is text (what follows the gap), not a {type(suffix).__name__}')
    return value, suffix


def _named_by_text(draft: object, options: dict | None) -> tuple[object, dict | None]:
    """A draft model given as a path object (pathlib.Path) as the text of its path, like a name."""
    if isinstance(draft, os.PathLike):
        draft = os.fspath(draft)
    if options is not None and isinstance(options.get("model"), os.PathLike):
        options = {**options, "model": os.fspath(options["model"])}
    return draft, options


def _with_draft_model(options: dict, draft: object, method: str | None, quantization: str | None) -> str:
    """`options` given the draft model `draft` (and, for one named by path, the target's format:
    "auto" is the choice for a draft); the method that runs it ("auto" unless one is named)."""
    if method is not None and not drafters.needs_draft_model(method):
        raise ForerunError(
            f"speculative_model is a draft model, but speculative_method {method!r} runs none; "
            f"use {' or '.join(drafters.draft_model_methods())}, or leave it out"
        )
    options.setdefault("model", draft)
    if quantization is not None and not isinstance(draft, LoadedModel):
        options.setdefault("quantize", quantization)
    return method or "auto"


def _with_draft_loaded(options: dict, dtype: str, device: str, target: LoadedModel) -> dict:
    """`options` with a draft model named by path loaded (in its `quantize` format, which the
    drafter then does not apply again, its caches in `kv_cache_dtype`; the target's tokenizer where
    its files are the target's)."""
    kv_cache_dtype = options.get("kv_cache_dtype")
    loaded = {key: value for key, value in options.items() if key != "kv_cache_dtype"}
    if isinstance(options.get("model"), LoadedModel) and kv_cache_dtype is not None:
        options["model"].decoder.set_kv_cache_dtype(kv_cache_dtype)
    if not isinstance(options.get("model"), str):
        return loaded
    loaded.pop("quantize", None)
    loaded["model"] = load_model(
        options["model"],
        options.get("dtype", dtype),
        options.get("device", device),
        quantization=options.get("quantize"),
        draft=True,
        kv_cache_dtype=kv_cache_dtype or "auto",
        tokens_like=target,
    )
    return loaded
