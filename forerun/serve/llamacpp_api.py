"""llama.cpp's own completion routes (`POST /completion` and `/infill`), as its server answers them,
over the completions route's work: the editors' code-completion plugins (llama.vim, llama.vscode)
speak these.

`props` answers llama.cpp's GET /props, `slot_entry` a lane of its GET /slots. A body is read into a
completions body of token ids (`translate`): /completion's prompt tokenized as llama.cpp tokenizes
it; /infill's prompt laid out as llama.cpp lays it out, the other files (`input_extra`) first under
the repository-level markers where the vocabulary has them, then `[FIM_PRE] prefix prompt [FIM_SUF]
suffix [FIM_MID]`, each side cut to fit as llama.cpp cuts it. llama.cpp's sampling defaults apply
where a field is left out (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), and `n_predict` -1
(its default) writes to the end of the context. The completions route's checks and engine then run
it, so speculation drafts these answers too. The answer comes back in llama.cpp's shape (`content`,
`stop`, `stop_type`, `tokens_predicted`, `timings`, ...), filtered by `response_fields`, or streamed
as its `data:` chunks ending in one with `stop: true`; `n_probs` adds each token's
`completion_probabilities` (the target's log probabilities before sampling). Fields of llama.cpp's
that ask for something forerun does not do are refused by name. `samplers` says which of
temperature, top_k, top_p and min_p apply (a sampler left out is off, as in llama.cpp; forerun
applies them in its own order, and has no `infill` sampler); a few fields are taken and ignored:
`model`, `cache_prompt` and `id_slot` (llama.cpp's cache and slots), `t_max_prompt_ms`,
`t_max_predict_ms` and `n_indent` (its time and indentation limits: an answer here runs to its own
end, `n_predict` or a stop), `n_keep`. A null field is a field left out.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import metadata

from forerun.base.config import SamplingParams, is_whole
from forerun.base.errors import ForerunError
from forerun.models.card import ModelCard
from forerun.models.tokenizer import NO_INFILL, Tokenizer, valid_unicode
from forerun.serve.inflight import InFlight
from forerun.serve.requests import BadRequest
from forerun.serve.responses import error_body, floored
from forerun.serve.scheduler import Delta, Failed, Slot
from forerun.serve.state import ServerConfig
from forerun.serve.stream import sse

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama.cpp's
PASSED_ON = {"temperature", "top_k", "top_p", "min_p", "stop", "ignore_eos"}
OFF = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}  # a sampler `samplers` leaves out
SAMPLERS = ["top_k", "top_p", "min_p", "temperature"]  # forerun's, in llama.cpp's order
# Taken and ignored: the model's name, llama.cpp's cache and slots, its time and indentation limits.
IGNORED = {"model", "cache_prompt", "id_slot", "t_max_prompt_ms", "t_max_predict_ms", "n_indent", "n_keep"}
# Taken where they ask for nothing (llama.cpp's neutral values).
NEUTRAL = {
    "typical_p": (1,),
    "dynatemp_range": (0,),
    "mirostat": (0,),
    "xtc_probability": (0,),
    "dry_multiplier": (0,),
    "grammar": ("",),
    "repeat_penalty": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "post_sampling_probs": (False,),
}
OWN = {"prompt", "n_predict", "stream", "seed", "logit_bias", "json_schema", "return_tokens", "response_fields"}
OWN |= {"samplers", "n_cmpl", "n_probs", "max_tokens"}  # max_tokens: n_predict where that is left out
INFILL_OWN = {"input_prefix", "input_suffix", "input_extra"}
# The completions body's fields a refusal may name, as llama.cpp names them.
RENAMED = {"max_tokens": "n_predict", "structured_outputs": "json_schema", "n": "n_cmpl", "logprobs": "n_probs"}
LLAMACPP_SEED = 0xFFFFFFFF  # llama.cpp's "a random seed" (LLAMA_DEFAULT_SEED)
BATCH = 2048  # llama.cpp's default batch, which its /infill fits the prefix and suffix into
PROJECT = "myproject\n"  # the repository name llama.cpp's /infill writes


def props(config: ServerConfig, tokenizer: Tokenizer | None, total_slots: int, card: ModelCard) -> dict:
    """llama.cpp's GET /props for this server (`config`: its ServerConfig; `tokenizer` or None; the
    model's `card`): the defaults /completion applies, the context, the slots (`total_slots`: requests
    run at once, under Ray Serve every replica's), the model and its file type, its chat templates and
    what they can show, its tokens. forerun has no web UI, no media (so no `media_marker`) and no
    sleeping, and /props cannot be changed; /slots and /metrics are served."""
    hf = getattr(tokenizer, "hf", None)
    answer = {
        "default_generation_settings": {"params": _default_params(), "n_ctx": config.max_model_len},
        "total_slots": total_slots,
        "model_alias": config.served_model_name,
        "model_ftype": card.ftype,
        "model_path": config.model_path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True,
        "endpoint_props": False,
        "endpoint_metrics": True,
        "ui": False,
        "ui_settings": {},
        "chat_template": tokenizer.template_text if tokenizer is not None else "",
        "chat_template_caps": tokenizer.template_caps if tokenizer is not None else {},
        "bos_token": getattr(hf, "bos_token", None) or "",
        "eos_token": getattr(hf, "eos_token", None) or "",
        "build_info": _build_info(),
        "is_sleeping": False,
        "cors_proxy_enabled": False,
    }
    named = getattr(hf, "chat_template", None)
    if isinstance(named, dict) and isinstance(named.get("tool_use"), str):
        answer["chat_template_tool_use"] = named["tool_use"]
    return answer


def slot_entry(slot: Slot, config: ServerConfig) -> dict:
    """One lane as llama.cpp's GET /slots gives it: the request running there (`id_task` its id; under
    Ray Serve the replica's own number for it, which another replica's lane may share), its prompt's
    length, its sampling parameters, the tokens it has sent and may still send; or an idle lane with
    the defaults /completion applies (`id_task` -1)."""
    p, running = slot.params, slot.task is not None
    params = _default_params() if p is None else _request_params(p)
    return {
        "id": slot.id,
        "id_task": slot.task if running else -1,
        "n_ctx": config.max_model_len,
        "speculative": config.speculative_tokens > 0,
        "is_processing": running,
        "params": params | {"speculative.n_max": config.speculative_tokens, "speculative.n_min": 0},
        "n_prompt_tokens": slot.prompt_tokens,
        "next_token": [  # one entry a slot, as llama.cpp gives it
            {
                "has_next_token": running,
                "has_new_line": slot.new_line,
                "n_remain": max(p.max_tokens - slot.decoded, 0) if p is not None else -1,
                "n_decoded": slot.decoded,
            }
        ],
    }


def _default_params() -> dict:
    """The sampling settings /completion applies where a request leaves them out (llama.cpp's)."""
    params = {**DEFAULTS, "n_predict": -1, "max_tokens": -1, "seed": LLAMACPP_SEED, "n_probs": 0}
    neutral = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": False}
    return params | neutral | {"stop": [], "samplers": SAMPLERS}


def _request_params(p: SamplingParams) -> dict:
    """A running request's sampling settings in llama.cpp's names (a sampler that is off at its
    neutral value: top_k 0, top_p 1, min_p 0)."""
    return {
        "n_predict": p.max_tokens,
        "max_tokens": p.max_tokens,
        "seed": p.seed if p.seed is not None else LLAMACPP_SEED,
        "temperature": p.temperature,
        "top_k": max(p.top_k, 0),
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "ignore_eos": p.ignore_eos,
        "n_probs": p.logprobs or 0,
        "stop": list(p.stop),
        "samplers": SAMPLERS,
    }


def _build_info() -> str:
    """forerun and its installed version (llama.cpp gives its build's)."""
    installed = version()
    return f"forerun {installed}" if installed else "forerun"


def version() -> str:
    """forerun's installed version ("" where it is not installed as a package)."""
    try:
        return metadata.version("forerun")
    except metadata.PackageNotFoundError:
        return ""


def fields(infill: bool) -> set[str]:
    return OWN | PASSED_ON | IGNORED | set(NEUTRAL) | (INFILL_OWN if infill else set())


def translate(body: dict, infill: bool, model: str, tokenizer, max_model_len: int) -> Translated:
    """The completions body (token ids) that asks what llama.cpp's `body` asks. Tokenizes: run it
    off the event loop."""
    route = "/infill" if infill else "/completion"
    body = {name: value for name, value in body.items() if value is not None}  # null: left out, as llama.cpp reads it
    for name, value in body.items():
        if name not in fields(infill):
            raise BadRequest(f"unknown field {name[:60]!r}: {route} takes {', '.join(sorted(fields(infill)))}", name)
        if name in NEUTRAL and value not in NEUTRAL[name]:
            raise BadRequest(f"{name} is not supported by this server; leave it out or send {NEUTRAL[name][0]!r}", name)
    if tokenizer is None:
        raise BadRequest(f"{route} takes text, and this model has no tokenizer; use /v1/completions with token ids")
    ids = _infill_ids(body, tokenizer, max_model_len) if infill else _prompt_ids(body.get("prompt"), tokenizer)
    out = {name: body.get(name, DEFAULTS.get(name)) for name in PASSED_ON if name in body or name in DEFAULTS}
    out.update(_samplers(body.get("samplers")))
    out.update(model=model, prompt=ids, stream=body.get("stream", False), n=body.get("n_cmpl", 1))
    if isinstance(out.get("stop"), list):
        out["stop"] = [word for word in out["stop"] if word != ""]  # llama.cpp skips empty stop words
    if body.get("seed") not in (None, -1):
        out["seed"] = body["seed"]
    if body.get("logit_bias") is not None:
        out["logit_bias"] = _logit_bias(body["logit_bias"])
    if body.get("json_schema") is not None:
        out["structured_outputs"] = {"json": body["json_schema"]}
    named = "max_tokens" if "n_predict" not in body and "max_tokens" in body else "n_predict"  # as llama.cpp
    predict = body.get(named, -1)
    if not is_whole(predict) or predict < -1:
        raise BadRequest(
            f"{named} must be a whole number >= -1 (-1: to the end of the context), got {predict!r}", named
        )
    probs = body.get("n_probs", 0)
    if not is_whole(probs) or probs < 0:
        raise BadRequest(f"n_probs must be a whole number >= 0, got {probs!r}", "n_probs")
    if predict == 0:  # the prompt read into the cache, nothing written
        out.update(echo=True, max_tokens=0)
    else:  # llama.cpp stops at the context's end, whatever n_predict says
        room = max(max_model_len - len(ids), 1)
        out["max_tokens"] = min(predict, room) if predict > 0 else room
        if probs > 0:  # each token's and its n_probs likeliest ones' log probabilities, before sampling
            out["logprobs"] = probs
    _check_fields(body.get("response_fields"))
    return Translated(out, body, infill, ids, tokenizer)


def _samplers(given: object) -> dict:
    """The samplers a `samplers` list leaves out, off (llama.cpp runs only those it names)."""
    if given is None:
        return {}
    if not isinstance(given, list) or not all(isinstance(name, str) for name in given):
        raise BadRequest(
            'samplers must be a list of sampler names, such as ["top_k", "top_p", "temperature"]', "samplers"
        )
    return {name: value for name, value in OFF.items() if name not in given}


def _check_fields(wanted: object) -> None:
    if not isinstance(wanted, (list, type(None))) or not all(isinstance(path, str) for path in wanted or []):
        raise BadRequest(
            'response_fields must be a list of field names or paths, such as "timings/prompt_n"', "response_fields"
        )


def _prompt_ids(prompt: object, tokenizer) -> list[int]:
    """/completion's one prompt: text (BOS first where the tokenizer adds one) or token ids."""
    if isinstance(prompt, str):
        return tokenizer.encode(_unicode(prompt, "prompt"))
    if isinstance(prompt, list) and prompt and all(is_whole(t) for t in prompt):
        return [int(t) for t in prompt]
    raise BadRequest("prompt must be a string or a non-empty list of token ids (one prompt a request)", "prompt")


def _text(body: dict, name: str) -> str:
    value = body.get(name, "")
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string", name)
    return _unicode(value, name)


def _infill_ids(body: dict, tokenizer, max_model_len: int) -> list[int]:
    """llama.cpp's /infill prompt: [extra] [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID, the
    prefix's last 3/4 of a batch and the suffix's first quarter kept, the other files' last tokens
    as many as the context leaves."""
    markers = tokenizer.infill_markers
    if markers is None:
        raise BadRequest(NO_INFILL, "input_suffix")
    before_gap, after_gap, middle = markers

    encode = tokenizer.encode_as_text  # a file's text: special tokens' text stays text, as llama.cpp reads it

    prefix, suffix = (encode(_text(body, name)) for name in ("input_prefix", "input_suffix"))
    prompt = tokenizer.hf.encode(_text(body, "prompt"), add_special_tokens=False)
    extra = _extra_ids(body.get("input_extra"), tokenizer, encode)
    batch = min(BATCH, max_model_len)  # llama.cpp's batch is never longer than its context
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (batch // 4)) :]
    suffix = suffix[: min(len(suffix), max(0, batch // 4 - (2 + len(prompt))))]
    predict = body.get("n_predict", -1)
    room = max(0, max_model_len - batch - 2 * (predict if is_whole(predict) and predict > 0 else 0))
    extra = extra[len(extra) - min(room, len(extra)) :]
    return [*extra, *tokenizer.opening, before_gap, *prefix, *prompt, after_gap, *suffix, middle]


def _extra_ids(chunks: object, tokenizer, encode) -> list[int]:
    """The other files (`input_extra`: {"filename", "text"} each), under the repository's markers
    where the vocabulary has them, else each after a snippet rule, as llama.cpp writes them."""
    if chunks is None:
        chunks = []
    if not isinstance(chunks, list):
        raise BadRequest('input_extra must be a list of {"filename": string, "text": string}', "input_extra")
    repo = tokenizer.repo_markers
    out = [repo[0], *encode(PROJECT)] if repo else []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise BadRequest(f"input_extra[{i}] must hold a text (a string)", "input_extra")
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise BadRequest(f"input_extra[{i}].filename must be a string", "input_extra")
        out += [repo[1], *encode(_unicode(name, "input_extra") + "\n")] if repo else encode("\n\n--- snippet ---\n\n")
        out += encode(_unicode(chunk["text"], "input_extra"))
    return out + ([repo[1], *encode("filename\n")] if repo else [])


def _unicode(text: str, name: str) -> str:
    """`text`, or a 400 naming `name` where it holds a lone surrogate."""
    try:
        return valid_unicode(text, name)
    except ForerunError as exc:
        raise BadRequest(str(exc), name) from None


def _logit_bias(given: object) -> dict:
    """llama.cpp's logit_bias ([[id, bias], ...], false for never, or {id: bias}) as OpenAI's."""
    pairs = list(given.items()) if isinstance(given, dict) else given
    shape = "logit_bias must be [[token id, bias or false], ...] or {token id: bias}"
    if not isinstance(pairs, list):
        raise BadRequest(shape, "logit_bias")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise BadRequest(shape, "logit_bias")
        token, bias = pair
        if not (is_whole(token) or (isinstance(token, str) and token.isdecimal() and len(token) < 20)):
            raise BadRequest(f"{shape}; a token given as text is not supported, give its id", "logit_bias")
        out[str(int(token))] = -100 if bias is False else bias
    return out


@dataclass
class Translated:
    """A llama.cpp request read as a completions request, and how its answer goes back."""

    body: dict  # the completions body that runs
    given: dict  # the request as sent
    infill: bool
    ids: list[int]
    tokenizer: object
    held: dict = field(default_factory=dict)  # n_probs: a streamed completion's bytes of an unfinished character

    def renamed(self, exc: BadRequest) -> BadRequest:
        """A refusal of the completions body in llama.cpp's names."""
        message = exc.message
        for theirs, ours in RENAMED.items():
            message = message.replace("'n'" if theirs == "n" else theirs, ours)  # a bare n only where quoted
        return BadRequest(message, RENAMED.get(exc.param, exc.param), exc.status, exc.kind, exc.code)

    def shaped(self, completion: dict, run: InFlight) -> dict | list:
        """The whole answer in llama.cpp's shape (one per completion where n_cmpl asks for several),
        filtered by response_fields."""
        answers = [self._filtered(self._final(choice, completion["model"], streamed=False)) for choice in run.choices]
        return answers[0] if len(answers) == 1 else answers

    def _final(self, choice, model: str, streamed: bool) -> dict:
        """A completion's answer; streamed, its last chunk (the text and tokens sent already)."""
        output, echo = choice.output, bool(self.body.get("echo"))
        text = "" if echo else "".join(choice.pieces)
        reason, stopped_by = choice.reason, choice.stop_reason
        stop_type = "limit" if reason == "length" else "word" if isinstance(stopped_by, str) else "eos"
        generated = 0 if echo else len(choice.token_ids)
        tokens = list(choice.token_ids) if self.given.get("return_tokens") and generated and not streamed else []
        probabilities = {} if streamed or "logprobs" not in self.body else self._probabilities(choice.logprobs, None)
        return probabilities | {
            "index": choice.index,
            "content": "" if streamed else text,
            "tokens": tokens,
            "id_slot": self._slot(),
            "stop": True,
            "model": model,
            "tokens_predicted": generated,
            "tokens_evaluated": len(self.ids),
            "generation_settings": self._settings(),
            "prompt": self.prompt_text,
            "has_new_line": "\n" in text,
            "truncated": False,
            "stop_type": stop_type if generated else "none",
            "stopping_word": stopped_by if isinstance(stopped_by, str) else "",
            "tokens_cached": len(self.ids) + generated,  # the tokens the cache holds now
            "timings": _timings(output, len(self.ids) - output.num_cached_tokens, generated),
        }

    def _probabilities(self, entries: list | None, stream: int | None) -> dict:
        """n_probs: llama.cpp's `completion_probabilities` for these tokens' logprob entries (the
        target's distribution before sampling, as llama.cpp gives it with post_sampling_probs off).
        As llama.cpp, a token that leaves a character unfinished gets no entry: its bytes go to the
        next token's, whose text is the whole character (`stream`: the completion whose held bytes
        carry over between chunks; None: a whole answer's entries, read at once)."""
        held, out = self.held.pop(stream, b"") if stream is not None else b"", []
        for e in entries or []:
            held += self.tokenizer.token_bytes(e.token_id)
            if _whole_length(held) < len(held):
                continue
            top = [self._token(t, lp, self.tokenizer.token_bytes(t)) for t, lp in e.top]
            out.append({**self._token(e.token_id, e.logprob, held), "top_logprobs": top})
            held = b""
        if stream is not None and held:
            self.held[stream] = held
        return {"completion_probabilities": out} if out else {}

    def _token(self, token_id: int, logprob: float, raw: bytes) -> dict:
        text = raw[: _whole_length(raw)].decode("utf-8", "replace")  # llama.cpp's: an unfinished character cut
        return {"id": token_id, "token": text, "bytes": list(raw), "logprob": floored(logprob)}

    @functools.cached_property
    def prompt_text(self) -> str:
        """The prompt as text, special tokens and all (decoded once, whatever the completions)."""
        return self.tokenizer.decode(self.ids, skip_special_tokens=False)

    def _slot(self) -> int:
        slot = self.given.get("id_slot", 0)
        return slot if is_whole(slot) else 0

    def _settings(self) -> dict:
        settings = {name: self.body.get(name) for name in ("temperature", "top_k", "top_p", "min_p", "seed")}
        return {**settings, "n_predict": self.given.get("n_predict", -1), "stop": self.body.get("stop") or []}

    def _filtered(self, answer: dict) -> dict:
        """response_fields: only these of the answer, each a key or a path of keys ("timings/prompt_n"),
        under its own name, as llama.cpp gives them."""
        wanted = self.given.get("response_fields")
        if not wanted:
            return answer
        out = {}
        for path in wanted:
            value, found = answer, True
            for key in str(path).split("/"):
                found = isinstance(value, dict) and key in value
                value = value[key] if found else None
                if not found:
                    break
            if found:
                out[str(path)] = value
        return out

    async def events(self, run: InFlight) -> AsyncIterator[str]:
        """llama.cpp's stream: a `data:` chunk per step's new tokens (and their text), then each
        completion's answer fields with `stop: true`; an error as a `data:` error object."""
        echo, tokens = bool(self.body.get("echo")), bool(self.given.get("return_tokens"))
        try:
            while not run.done:
                index, event = await run.events.get()
                if isinstance(event, Failed):
                    yield sse(error_body(run.failure(event)))
                    return
                choice = run.take(index, event)
                if isinstance(event, Delta) and event.token_ids and not echo:
                    yield sse(
                        {
                            "index": choice.index,
                            "content": event.text,
                            "tokens": event.token_ids if tokens else [],
                            "stop": False,
                            "id_slot": self._slot(),
                            "tokens_predicted": len(choice.token_ids),
                            "tokens_evaluated": len(self.ids),
                        }
                        | self._probabilities(event.logprobs, choice.index)
                    )
            for choice in run.choices:
                yield sse(self._filtered(self._final(choice, run.reply.model, streamed=True)))
        finally:
            run.cancel()


def _whole_length(raw: bytes) -> int:
    """llama.cpp's validate_utf8: the length of `raw` without a last character it leaves unfinished."""
    for back in range(1, min(4, len(raw)) + 1):
        lead = raw[-back]
        if lead & 0xC0 == 0x80:  # a continuation byte: the character starts further back
            continue
        need = 2 if lead & 0xE0 == 0xC0 else 3 if lead & 0xF0 == 0xE0 else 4 if lead & 0xF8 == 0xF0 else 1
        return len(raw) - back if need > back else len(raw)
    return len(raw)


def _timings(output, evaluated: int, generated: int) -> dict:
    """llama.cpp's timings of one completion, from its first-token and elapsed times."""
    first_ms, all_ms = output.first_token_s * 1000, output.elapsed_s * 1000
    predicted_ms = all_ms - first_ms
    return {
        "prompt_n": evaluated,
        "prompt_ms": first_ms,
        "prompt_per_token_ms": first_ms / max(evaluated, 1),
        "prompt_per_second": evaluated / (first_ms / 1000) if first_ms > 0 else 0.0,
        "predicted_n": generated,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / max(generated, 1),
        "predicted_per_second": generated / (predicted_ms / 1000) if predicted_ms > 0 else 0.0,
    }
