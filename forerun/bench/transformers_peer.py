"""Peers: the transformers library on the same weights and prompt ids, timed like forerun.

Three contenders: plain `generate`, assisted generation with the same draft model
(`assistant_model=`), and prompt lookup (`prompt_lookup_num_tokens=`). Each gets the prompt as the
same token ids forerun sees, the same stop tokens and the same number of new tokens. Generation
settings from the model's hub files (repetition penalty and the like) are cleared, so both engines
compute the same thing. `PEERS` lists every name `--peers` takes; llama.cpp's contenders live in
llamacpp/peer.py.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator

import torch

from forerun.base.config import SamplingParams
from forerun.bench.contenders import Measurement, PeerSetup
from forerun.bench.llamacpp import LLAMA_METHODS
from forerun.bench.llamacpp import PEER as LLAMA_PEER
from forerun.models.load import parse_dtype, resolve_device
from forerun.models.source import resolve
from forerun.models.tokenizer import Tokenizer

HF_PLAIN, HF_ASSISTED, HF_LOOKUP = "hf-plain", "hf-assisted", "hf-prompt-lookup"
HF_METHODS = (HF_PLAIN, HF_ASSISTED, HF_LOOKUP)
# "transformers" and "llama.cpp" each name all three of their contenders.
PEERS = ("transformers",) + HF_METHODS + (LLAMA_PEER,) + LLAMA_METHODS


class TransformersContender:
    engine = "transformers"

    def __init__(
        self, method: str, k: int, model, tokenizer: Tokenizer, assistant=None, assistant_confidence: float = 0.0
    ) -> None:
        self.method, self.k, self.model, self.tokenizer = method, k, model, tokenizer
        self.assistant, self.assistant_confidence = assistant, assistant_confidence
        self.options = {"assistant_confidence_threshold": assistant_confidence} if assistant is not None else {}

    def run(self, prompt_ids: list[int], params: SamplingParams) -> Measurement:
        config = self._generation_config(params)
        extra = {}
        if self.assistant is not None:
            # The assistant's own config sets its draft length; shared by every K, so set it per run.
            self.assistant.generation_config.num_assistant_tokens = self.k
            self.assistant.generation_config.num_assistant_tokens_schedule = "constant"
            self.assistant.generation_config.assistant_confidence_threshold = self.assistant_confidence
            extra["assistant_model"] = self.assistant
        if params.stop:
            # As a criterion, not config.stop_strings: the assistant's own generate would demand a tokenizer.
            from transformers import StoppingCriteriaList, StopStringCriteria

            extra["stopping_criteria"] = StoppingCriteriaList(
                [StopStringCriteria(self.tokenizer.hf, list(params.stop))]
            )
        ids = torch.tensor([prompt_ids], device=self.model.device)  # [1, prompt_len]
        clock = _first_token_clock()
        if params.seed is not None:
            torch.manual_seed(params.seed)
        forwards: list[None] = []  # one entry per target forward
        counter = self.model.register_forward_pre_hook(lambda *_: forwards.append(None))
        try:
            with quiet():
                start = time.perf_counter()
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=clock, **extra
                )  # [1, prompt_len + new]
                tokens = out[0, len(prompt_ids) :].tolist()  # .tolist() waits for the device
                elapsed = time.perf_counter() - start
        finally:
            counter.remove()
        first = (clock.first - start) if clock.first is not None else elapsed
        text, cut = _cut_at_stop(self.tokenizer.decode(tokens), params.stop)
        stopped = cut or (not params.ignore_eos and bool(tokens) and tokens[-1] in self.tokenizer.stop_ids)
        # Target forwards (prefill included) give tokens per forward, as forerun reports it.
        spec = {"num_target_forwards": len(forwards), "num_emitted_tokens": len(tokens)}
        return Measurement(tokens, text, "stop" if stopped else "length", elapsed, first, spec)

    def _generation_config(self, params: SamplingParams):
        from transformers import GenerationConfig

        stop_ids = sorted(self.tokenizer.stop_ids)
        fields = dict(
            max_new_tokens=params.max_tokens,
            do_sample=not params.greedy,
            eos_token_id=None if params.ignore_eos or not stop_ids else stop_ids,
            pad_token_id=self.tokenizer.hf.pad_token_id
            if self.tokenizer.hf.pad_token_id is not None
            else (stop_ids[0] if stop_ids else 0),
        )
        if not params.greedy:
            fields.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        if self.method == HF_LOOKUP:
            fields["prompt_lookup_num_tokens"] = self.k
        return GenerationConfig(**fields)


def transformers_contenders(
    model_spec: str,
    draft_spec: str | None,
    ks: list[int],
    dtype: str,
    device: str,
    tokenizer: Tokenizer,
    draft_min_confidence: float = 0.0,
    methods: tuple[str, ...] = HF_METHODS,
) -> PeerSetup:
    """Load the target (and draft) in transformers; a model it cannot load becomes a note, not an error.

    `methods`: which of hf-plain, hf-assisted and hf-prompt-lookup to run.
    """
    setup = PeerSetup()
    target, problem = load_in_transformers(model_spec, dtype, device)
    if target is None:
        setup.notes.append(f"transformers peer left out: it could not load the model {model_spec!r} ({problem})")
        return setup
    if HF_PLAIN in methods:
        setup.contenders.append(TransformersContender(HF_PLAIN, 0, target, tokenizer))
    assistant = None
    if HF_ASSISTED in methods:
        if draft_spec is None:
            setup.notes.append("transformers assisted generation left out: no --speculative-model to assist with")
        else:
            assistant, problem = load_in_transformers(draft_spec, dtype, device)
            if assistant is None:
                setup.notes.append(
                    f"transformers assisted generation left out: it could not load the draft {draft_spec!r} ({problem})"
                )
    for k in ks:
        if assistant is not None:
            setup.contenders.append(
                TransformersContender(HF_ASSISTED, k, target, tokenizer, assistant, draft_min_confidence)
            )
        if HF_LOOKUP in methods:
            setup.contenders.append(TransformersContender(HF_LOOKUP, k, target, tokenizer))
    return setup


def load_in_transformers(spec: str, dtype: str, device: str):
    """(model, None) or (None, why not). GGUF files load through transformers' own GGUF reader."""
    try:
        from transformers import AutoModelForCausalLM, GenerationConfig

        source = resolve(spec)
        kwargs = {"dtype": parse_dtype(dtype)}
        with quiet():
            if source.kind == "gguf":
                model = AutoModelForCausalLM.from_pretrained(
                    str(source.path.parent), gguf_file=source.path.name, **kwargs
                )
            else:
                model = AutoModelForCausalLM.from_pretrained(str(source.path), **kwargs)
        model = model.to(resolve_device(device)).eval()
        model.generation_config = GenerationConfig()  # no hub sampling defaults: same computation as forerun
        return model, None
    except Exception as exc:  # transformers raises many types; any of them means "cannot load"
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        return None, f"{type(exc).__name__}: {first_line}"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers' warnings and progress bars off while it loads and generates."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Text before the first stop string, as forerun reports it; and whether one was found."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


def _first_token_clock():
    """A streamer that notes when the first generated token arrives (the first put is the prompt)."""
    from transformers.generation.streamers import BaseStreamer

    class FirstTokenClock(BaseStreamer):
        def __init__(self) -> None:
            self.puts = 0
            self.first: float | None = None

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    return FirstTokenClock()
