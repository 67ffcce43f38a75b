"""User-facing settings as frozen dataclasses; each checks its own values and names the bad field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from numbers import Integral, Real

from forerun.base.errors import FieldError, ForerunError
from forerun.base.prompts import valid_unicode

# A temperature below this samples as greedy (as vLLM does): dividing logits by it overflows float32,
# and the distribution is a one-hot at the argmax to every digit a float holds anyway.
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes (end excluded)
MAX_LOGPROBS = 20  # most alternatives a token's log probability comes with (OpenAI's limit)


def is_whole(value: object) -> bool:
    """A whole number, and not a bool (True is an int to Python, never a count or a seed here)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_finite(value: object) -> bool:
    """A real number a float holds finitely, not a bool (an integer too big for a float is not)."""
    if not isinstance(value, Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a generated text must be, as vLLM's structured outputs say it: exactly one of json,
    regex, choice, grammar and json_object, and for JSON how it is spelled. The target's rows allow
    only the tokens that keep the text inside it (`verification.grammar`); the text ends with a
    stop token once it is complete."""

    json: str | dict | bool | None = None  # a JSON schema (a dict, or its text); kept as text
    regex: str | None = None  # the whole text matches this regular expression (Rust regex syntax)
    choice: tuple[str, ...] | None = None  # the text is one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect), its start rule `start`
    json_object: bool | None = False  # any JSON object (OpenAI's response_format json_object); None: False
    disable_any_whitespace: bool = False  # JSON without whitespace between its tokens (else JSON's own)
    disable_additional_properties: bool = False  # objects take only the properties they name
    whitespace_pattern: str | None = None  # the whitespace JSON may hold, as a regular expression
    disable_fallback: bool = False  # vLLM's: one backend here, so nothing to fall back to

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            object.__setattr__(self, "json", json.dumps(self.json))  # in its order: keys are written so
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is None:
            object.__setattr__(self, "json_object", False)
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError("structured_outputs", f"{name} must be true or false, got {getattr(self, name)!r}")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise FieldError(
                "structured_outputs",
                "structured_outputs takes exactly one of json, regex, choice, grammar and json_object, "
                f"got {', '.join(given) or 'none'}",
            )
        _check_structured(self)

    @property
    def kind(self) -> str:
        """Which of the five this is."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


def _check_structured(spec: StructuredOutputsParams) -> None:
    for name in ("json", "regex", "grammar", "whitespace_pattern"):
        value = getattr(spec, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise FieldError("structured_outputs", f"{name} must be a non-empty string, got {value!r}")
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except ValueError as e:
            raise FieldError("structured_outputs", f"json must be a JSON schema, and its text is not JSON: {e}") from e
        if schema is True:  # the schema that allows any JSON value
            object.__setattr__(spec, "json", "{}")
            schema = {}
        if schema is False:
            raise FieldError("structured_outputs", "json is the schema false, which no text follows")
        if not isinstance(schema, dict):
            raise FieldError("structured_outputs", f"json must be a JSON schema (an object), got {spec.json[:80]}")
    if spec.choice is not None and (
        not isinstance(spec.choice, tuple)
        or not spec.choice
        or any(not isinstance(c, str) or not c for c in spec.choice)
    ):
        raise FieldError("structured_outputs", f"choice must be a list of non-empty strings, got {spec.choice!r}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k likeliest tokens; 0 keeps all
    max_tokens: int = 128  # most new tokens to generate
    stop: tuple[str, ...] = ()  # strings that end generation (not included in the text: include_stop_str_in_output)
    seed: int | None = None  # seeds the sampler; None draws a fresh seed
    ignore_eos: bool = False  # keep going past stop tokens (benchmarks)
    # Log probabilities (the target's raw logits, before temperature, top-k and top-p): None computes
    # none; N gives each generated token's, with the N likeliest tokens at its position beside it.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first has none)
    # Adjustments of the target's logits, as in OpenAI's API and vLLM (`sampling.adjusted`; the
    # greedy argmax, temperature and the cuts after it start from the adjusted logits):
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict is taken
    presence_penalty: float = 0.0  # subtracted once from each token generated so far, in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per time each token was generated so far, in [-2, 2]
    # > 0: each token of the prompt or the output so far has its logit divided by it (above 0) or multiplied
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # in [0, 1]: after temperature, drop tokens below min_p x the likeliest's probability
    min_tokens: int = 0  # no stop token (and no stop string) before this many tokens, as in vLLM
    # Tokens that end generation besides the model's own stop tokens, as in vLLM: kept with
    # ignore_eos, and their text stays in the output (a special token has none).
    stop_token_ids: tuple[int, ...] = ()
    # The text must follow a JSON schema, a regular expression, a choice or a grammar (a dict is taken).
    structured_outputs: StructuredOutputsParams | None = None
    # The text leaves out special tokens' text (vLLM's default); False keeps it (tool calls whose
    # tags a vocabulary marks special are read from it).
    skip_special_tokens: bool = True
    # What the answer is expected to be, much of it (OpenAI's predicted outputs: a file an edit
    # rewrites), as text or token ids: drafters that copy text draft from it too. Only the speed
    # changes; the answer is the target's whatever the prediction says.
    prediction: str | tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the text stays in it

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)) or self.stop is None:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        else:
            raise FieldError("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        for name in ("temperature", "top_p"):
            if not isinstance(getattr(self, name), Real) or isinstance(getattr(self, name), bool):
                raise FieldError(name, f"{name} must be a number, got {getattr(self, name)!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(name, f"{name} must be True or False, got {getattr(self, name)!r}")
        if not (is_finite(self.temperature) and self.temperature >= 0):
            raise FieldError(
                "temperature", f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (not is_whole(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise FieldError("seed", f"seed must be a whole number in [-2**63, 2**64), got {self.seed!r}")
        # Whole numbers only: a float slips past `< 0` (NaN always does) and fails deep in torch later.
        if not is_whole(self.top_k) or self.top_k < 0:
            raise FieldError("top_k", f"top_k must be a whole number >= 0 (0 keeps every token), got {self.top_k!r}")
        if not is_whole(self.max_tokens) or self.max_tokens < 1:
            raise FieldError("max_tokens", f"max_tokens must be a whole number >= 1, got {self.max_tokens!r}")
        if any(not isinstance(s, str) for s in self.stop):
            raise FieldError("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise FieldError("stop", "stop strings must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_whole(value) or not 0 <= value <= MAX_LOGPROBS):
                raise FieldError(
                    name,
                    f"{name} must be a whole number from 0 to {MAX_LOGPROBS} (alternatives per "
                    f"token), or None for no log probabilities, got {value!r}",
                )
        _check_adjustments(self)
        _check_stop_token_ids(self)
        _check_structured_outputs(self)
        _check_prediction(self)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one below GREEDY_BELOW."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts(self) -> bool:
        """Whether the target's raw logits are adjusted (a bias, a penalty, stop tokens held off)
        before anything else."""
        return bool(self.logit_bias) or self.penalized or self.min_tokens > 0 or self.structured_outputs is not None


def _check_structured_outputs(params: SamplingParams) -> None:
    spec = params.structured_outputs
    if isinstance(spec, dict):
        try:
            spec = StructuredOutputsParams(**spec)
        except TypeError as e:
            raise FieldError("structured_outputs", f"structured_outputs: {e}") from e
        object.__setattr__(params, "structured_outputs", spec)
    if spec is not None and not isinstance(spec, StructuredOutputsParams):
        raise FieldError(
            "structured_outputs", f"structured_outputs must be a StructuredOutputsParams or a dict, got {spec!r}"
        )
    if spec is not None and params.ignore_eos:
        raise FieldError(
            "ignore_eos",
            "ignore_eos would write past the end of a structured output (it ends with a stop token once "
            "complete): leave out one of them",
        )


def _check_prediction(params: SamplingParams) -> None:
    """A prediction as text or a tuple of token ids; named when it is anything else."""
    value = params.prediction
    if value is None:
        return
    if isinstance(value, str):
        try:
            valid_unicode(value, "the prediction")
        except ForerunError as exc:
            raise FieldError("prediction", str(exc)) from None
        return
    if not isinstance(value, (list, tuple)) or any(not is_whole(t) or t < 0 for t in value):
        raise FieldError(
            "prediction", f"prediction must be text or a list of token ids (whole numbers >= 0), got {value!r:.80}"
        )
    object.__setattr__(params, "prediction", tuple(int(t) for t in value))


def _check_stop_token_ids(params: SamplingParams) -> None:
    """stop_token_ids as a sorted tuple of distinct token ids; named when it is anything else."""
    ids = () if params.stop_token_ids is None else params.stop_token_ids
    if not isinstance(ids, (list, tuple, set, frozenset)) or any(not is_whole(t) or t < 0 for t in ids):
        raise FieldError(
            "stop_token_ids", f"stop_token_ids must be a list of token ids (whole numbers >= 0), got {ids!r}"
        )
    object.__setattr__(params, "stop_token_ids", tuple(sorted({int(t) for t in ids})))


def _check_adjustments(params: SamplingParams) -> None:
    """The logit bias (a dict made a sorted tuple) and the penalties, each named when wrong."""
    bias = params.logit_bias
    if isinstance(bias, dict):
        bias = tuple(sorted(bias.items()))
    elif bias is None:
        bias = ()
    if not isinstance(bias, tuple) or any(not isinstance(pair, tuple) or len(pair) != 2 for pair in bias):
        raise FieldError("logit_bias", f"logit_bias must be a dict of token id -> bias, got {params.logit_bias!r}")
    for token, value in bias:
        if not is_whole(token) or token < 0:
            raise FieldError("logit_bias", f"logit_bias keys must be token ids (whole numbers >= 0), got {token!r}")
        if not is_finite(value) or not -100 <= value <= 100:
            raise FieldError(
                "logit_bias", f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}"
            )
    if len({token for token, _ in bias}) != len(bias):
        raise FieldError("logit_bias", "logit_bias names a token twice")
    object.__setattr__(params, "logit_bias", tuple((int(t), float(v)) for t, v in bias))
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not is_finite(value) or not -2 <= value <= 2:
            raise FieldError(name, f"{name} must be a number in [-2, 2] (0 is off), got {value!r}")
    if not is_finite(params.repetition_penalty) or not params.repetition_penalty > 0:
        raise FieldError(
            "repetition_penalty",
            f"repetition_penalty must be a number > 0 (1 is off), got {params.repetition_penalty!r}",
        )
    if not is_whole(params.min_tokens) or not 0 <= params.min_tokens <= params.max_tokens:
        raise FieldError(
            "min_tokens",
            f"min_tokens must be a whole number from 0 to max_tokens ({params.max_tokens}), got {params.min_tokens!r}",
        )
    if not is_finite(params.min_p) or not 0 <= params.min_p <= 1:
        raise FieldError("min_p", f"min_p must be a number in [0, 1] (0 is off), got {params.min_p!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None  # drafter name in the registry; None is plain decoding
    num_speculative_tokens: int = 5  # K: the most tokens a step drafts (every step's length when fixed)
    # The drafter's own settings, passed to it alone; never changed once made (dataclasses.replace).
    options: dict = field(default_factory=dict)
    k_policy: str = "adaptive"  # adaptive: each step's length from costs and acceptance; fixed: always K

    def __post_init__(self) -> None:
        if not is_whole(self.num_speculative_tokens):
            raise ForerunError(f"num_speculative_tokens must be a whole number, got {self.num_speculative_tokens!r}")
        if self.method is not None and self.num_speculative_tokens < 1:
            raise ForerunError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.k_policy not in ("adaptive", "fixed"):
            raise ForerunError(f"speculative_k_policy must be adaptive or fixed, got {self.k_policy!r}")
