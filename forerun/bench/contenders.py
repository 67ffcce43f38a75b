"""What the bench times: forerun's plain and speculative runs behind one small interface.

A contender is one (method, K) configuration with its models already loaded; `run` generates for
one prompt and returns what was measured. The peers (transformers_peer.py for transformers, llamacpp/peer.py
for llama.cpp) have the same shape; one that holds a process has `close()`, called when the bench ends.
One whose runs remember earlier ones (forerun's suffix memory) has `remembered()` and `recall(state)`,
so that a prompt's repeated rounds all start from what its first round started from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from forerun.api import LLM
from forerun.base.config import SamplingParams
from forerun.drafters.suffix import SuffixMemory
from forerun.models.load import LoadedModel

PLAIN = "plain"


@dataclass
class Measurement:
    token_ids: list[int]  # generated tokens, prompt excluded
    text: str
    finish_reason: str
    elapsed_s: float  # prefill to last token; loading excluded
    first_token_s: float  # time to the first generated token
    spec: dict | None = None  # speculation counters (SpecMetrics.to_dict + forwards); None for plain
    engine_timings: dict | None = None  # a peer's own timing report, as it gave it (llama.cpp's `timings`)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first: the rate once the prompt is done."""
        return decode_rate(len(self.token_ids), self.elapsed_s, self.first_token_s)


def decode_rate(generated: int, elapsed_s: float, first_token_s: float) -> float | None:
    """(generated − 1) / (elapsed − first token time); None with one token or no time after it."""
    after_first = elapsed_s - first_token_s
    return (generated - 1) / after_first if generated > 1 and after_first > 0 else None


@dataclass
class PeerSetup:
    contenders: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # why a peer is missing, for the report


def drafter_of(method: str) -> str:
    """The drafter a bench method runs: `auto:gguf` is `auto` with its draft model in `gguf`, run
    beside `auto` (the draft in --speculative-quantization) on every prompt."""
    return method.split(":", 1)[0]


def _variant(method: str) -> str:
    """What follows METHOD: in a method's name ("" where nothing does)."""
    return method.split(":", 1)[1] if ":" in method else ""


def draft_format_of(method: str) -> str | None:
    """The draft model's format a `METHOD:FORMAT` method names (None: --speculative-quantization's,
    or the method is `METHOD:OPTION=VALUE`)."""
    variant = _variant(method)
    return variant if variant and "=" not in variant else None


def option_of(method: str) -> tuple[str, int | float | str] | None:
    """The drafter option a `METHOD:OPTION=VALUE` method sets (`auto:branch=0`: `auto` with its
    `branch` option 0, run beside `auto` as the flags set it); the value as a number where it reads
    as one. None: the method sets none."""
    variant = _variant(method)
    if "=" not in variant:
        return None
    key, value = variant.split("=", 1)
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


class Contender(Protocol):
    method: str  # "plain", a drafter name, or a peer's name such as "hf-assisted"
    engine: str  # "forerun", "transformers" or "llama.cpp"
    k: int  # draft length; 0 for plain decoding
    options: dict  # the method's own settings, as recorded in results.jsonl

    def run(self, prompt_ids: list[int], params: SamplingParams) -> Measurement: ...


class ForerunContender:
    engine = "forerun"

    def __init__(
        self,
        target: LoadedModel,
        method: str,
        k: int,
        options: dict,
        recorded: dict | None = None,
        k_policy: str = "adaptive",
    ) -> None:
        """`recorded`: the options as results.jsonl should hold them, when they differ from those handed
        on; `k_policy`: adaptive (K is the most a step drafts) or fixed, recorded with them."""
        self.method, self.k = method, k  # the method as named: `auto:gguf` runs `auto`
        speculative = method != PLAIN
        self.options = recordable(
            {**(options if recorded is None else recorded), **({"k_policy": k_policy} if speculative else {})}
        )
        self.llm = LLM(
            target,
            speculative_method=drafter_of(method) if speculative else None,
            speculative_options=options if speculative else None,
            num_speculative_tokens=k if speculative else 5,
            speculative_k_policy=k_policy,
            # Every run pays its whole prefill: the warm-up's prompt is the first one measured, and a
            # run compares methods, not what an earlier run left in a prefix cache.
            prefix_cache_mb=0,
        )

    def remembered(self) -> list[list[int]] | None:
        """The earlier outputs the drafters draft from (None: they remember none)."""
        memory = self.llm.drafter_memory
        return memory.outputs_held() if isinstance(memory, SuffixMemory) else None

    def recall(self, state: list[list[int]] | None) -> None:
        """Remember what `remembered` returned, and nothing since."""
        memory = self.llm.drafter_memory
        if isinstance(memory, SuffixMemory) and state is not None:
            memory.restore(state)

    def run(self, prompt_ids: list[int], params: SamplingParams) -> Measurement:
        result = self.llm.generate([prompt_ids], params)[0]
        spec = None
        if self.method != PLAIN:
            # to_dict lacks the forward count, which pooling mean accepted length over prompts needs.
            spec = {**result.metrics.to_dict(), "num_target_forwards": result.metrics.num_target_forwards}
        return Measurement(
            result.token_ids, result.text, result.finish_reason, result.elapsed_s, result.first_token_s, spec
        )


def build_forerun_contenders(
    target: LoadedModel,
    methods: list[str],
    ks: list[int],
    method_options: dict[str, dict],
    recorded_options: dict[str, dict] | None = None,
    k_policy: str = "adaptive",
) -> list[ForerunContender]:
    """Plain decoding first (every other run is compared with it), then each method at each K.

    `recorded_options`: per method, the options to record where they differ from those handed on.
    """
    recorded_options = recorded_options or {}
    contenders = [ForerunContender(target, PLAIN, 0, {})]
    for method in methods:
        if method == PLAIN:
            continue
        for k in ks:
            contenders.append(
                ForerunContender(
                    target, method, k, method_options.get(method, {}), recorded_options.get(method), k_policy
                )
            )
    return contenders


def recordable(options: dict) -> dict:
    """Options as JSON can hold them: a loaded model is recorded by its name."""
    return {key: value.name if isinstance(value, LoadedModel) else value for key, value in sorted(options.items())}
