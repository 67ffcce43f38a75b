"""One /completion exchange with llama-server: forerun's prompt and sampling in, a Measurement out."""

from __future__ import annotations

import json

from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.bench.contenders import Measurement
from forerun.models.tokenizer import Tokenizer

# The figures of its `timings` kept in a record, as it reports them.
TIMINGS = (
    "prompt_n",
    "prompt_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_second",
    "draft_n",
    "draft_n_accepted",
)


def request_body(prompt_ids: list[int], params: SamplingParams) -> dict:
    """One /completion request: forerun's prompt ids and sampling, nothing of llama.cpp's own on top."""
    body = {
        "prompt": list(prompt_ids),
        "n_predict": params.max_tokens,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
        "ignore_eos": params.ignore_eos,
        "stop": list(params.stop),
        # forerun's order: temperature, then top-k, then top-p; greedy is top-k 1.
        "samplers": ["temperature", "top_k", "top_p"],
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_k": 1 if params.greedy else params.top_k,
        "top_p": 1.0 if params.greedy else params.top_p,
        "min_p": 0.0,
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "mirostat": 0,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    return body


def parse_completion(
    reply: dict, elapsed_s: float, tokenizer: Tokenizer, params: SamplingParams, speculative: bool
) -> Measurement:
    """A /completion answer as a Measurement; the text is decoded with forerun's tokenizer."""
    if "tokens" not in reply or "timings" not in reply:
        raise ForerunError(f"llama-server's answer lacks tokens or timings: {json.dumps(reply)[:300]}")
    tokens = [int(t) for t in reply["tokens"]]
    timings = reply["timings"]
    text = tokenizer.decode(tokens)
    cut = [i for i in (text.find(s) for s in params.stop) if i >= 0]
    if cut:
        text = text[: min(cut)]
    finish = "stop" if reply.get("stop_type") in ("eos", "word") else "length"
    spec = None
    if speculative:
        # Its drafts are counted; its verification steps are not in the answer, so tokens per
        # forward stays unknown. No draft at all leaves draft_n out.
        spec = {
            "num_draft_tokens": int(timings.get("draft_n", 0)),
            "num_accepted_tokens": int(timings.get("draft_n_accepted", 0)),
            "num_emitted_tokens": len(tokens),
        }
    first = float(timings.get("prompt_ms", 0.0)) / 1000
    engine = {key: timings[key] for key in TIMINGS if key in timings}
    return Measurement(tokens, text, finish, elapsed_s, min(first, elapsed_s), spec, engine)
