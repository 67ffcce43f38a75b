"""What `forerun serve` answers: OpenAI's response, chunk and error shapes, logprobs, reasoning, tool calls,
speculation figures.

One `Reply` per HTTP request, one `Choice` per sample: `n` of each prompt (a completions request
may batch several), choice p * n + i being prompt p's sample i, as in vLLM. A streamed choice sends
what it has not sent yet (text and logprobs) in each chunk; `echo` puts its prompt (and the prompt's
logprobs) before the first. Usage sums the prompts' tokens and every choice's. Speculation figures
follow vLLM's per-request spec-decode shape, per choice, so tools that read vLLM's read these
unchanged; summed over every choice they equal the /metrics counters.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from forerun.base.reasoning import ReasoningReader, split
from forerun.base.tools import CallReader
from forerun.engine.engine import RequestOutput
from forerun.engine.metrics import SpecMetrics
from forerun.models.card import ModelCard
from forerun.serve.requests import BadRequest, Checked
from forerun.serve.scheduler import Delta

LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity: a token the model rules out gets this


@dataclass
class Choice:
    """One sample's text and logprobs so far, and what of them a stream has sent."""

    index: int
    prompt: int = 0  # which prompt of the request's batch it samples
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprob per generated token
    prompt_logprobs: list | None = None  # echo: the prompt's (first entry None)
    output: RequestOutput | None = None  # once finished
    finish_reason: str | None = None  # overrides the output's (echo alone)
    sent_pieces: int = 0
    sent_logprobs: int = 0
    echoed: bool = False
    text_offset: int = 0  # completions logprobs: where the next token starts
    reader: CallReader | None = None  # chat with tools to call: its text read into content and calls
    thinker: ReasoningReader | None = None  # chat with a reasoning parser: reasoning read apart from the answer

    def add(self, delta: Delta) -> None:
        self.pieces.append(delta.text)
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += delta.logprobs

    @property
    def reason(self) -> str | None:
        if self.output is None:
            return None
        return self.finish_reason or self.output.finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's: the stop string or stop token id that ended it (None until then, and for others)."""
        if self.output is None or self.finish_reason is not None:
            return None
        return self.output.stop_reason


class Reply:
    """OpenAI's response and chunk shapes for one request."""

    def __init__(
        self,
        checked: Checked,
        model: str,
        prompt_ids: list[list[int]],
        tokenizer,
        prompt_texts: list[str],
        reasoning: str | None = None,
    ) -> None:
        """`prompt_ids`: each prompt's tokens; `prompt_texts`: what `echo` puts before each prompt's
        choices ("" without echo); `reasoning`: the server's reasoning parser (`base.reasoning`; chat only)."""
        self.checked, self.model, self.prompt_ids, self.tokenizer = checked, model, prompt_ids, tokenizer
        self.prompt_texts = prompt_texts
        self.reasoning = reasoning if checked.chat else None
        self.chat = checked.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        # A streamed chunk's object: chat's has its own name, a completion's is the whole response's
        # (as OpenAI and vLLM send them).
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"

    # --- not streamed --------------------------------------------------------------------------

    def complete(self, choices: list[Choice], stats: list[dict | None]) -> dict:
        shaped = []
        for choice, figures in zip(choices, stats):
            text = "".join(choice.pieces)
            if self.chat:
                entry = {
                    "index": choice.index,
                    "message": self._message(choice, text),
                    "logprobs": self._chat_logprobs(choice.logprobs),
                }
            else:
                entry = {
                    "index": choice.index,
                    "text": self.prompt_texts[choice.prompt] + text,
                    "logprobs": self._completion_logprobs(choice, self._echo_entries(choice) + choice.logprobs),
                }
            entry["finish_reason"], entry["stop_reason"] = self._reason(choice), choice.stop_reason
            if figures is not None:
                entry["speculative_decoding_stats"] = figures
            shaped.append(entry)
        return self._top(shaped, usage=self.usage(choices), stats=stats)

    # --- streamed ------------------------------------------------------------------------------

    def opening(self) -> list[dict]:
        """Chunks sent before any token: chat's role, one per choice."""
        if not self.chat:
            return []
        return [
            self._top(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                        "stop_reason": None,
                    }
                ],
                streamed=True,
            )
            for i in range(self.checked.n)
        ]

    def chunk(self, choice: Choice, stats: dict | None = None) -> dict | None:
        """What `choice` has not sent yet (None: nothing); with its finish reason (and `stats`) once done."""
        text = "".join(choice.pieces[choice.sent_pieces :])
        entries = choice.logprobs[choice.sent_logprobs :]
        prefix_text, prefix_entries = "", []
        if not choice.echoed and (text or entries or choice.output is not None):
            prefix_text, prefix_entries = self.prompt_texts[choice.prompt], self._echo_entries(choice)
            choice.echoed = True
        choice.sent_pieces, choice.sent_logprobs = len(choice.pieces), len(choice.logprobs)
        delta = self._delta(choice, text) if self.chat else {}
        if not ((delta if self.chat else text) or entries or prefix_text or choice.output is not None):
            return None
        if self.chat:
            entry = {"index": choice.index, "delta": delta, "logprobs": self._chat_logprobs(entries)}
        else:
            entry = {
                "index": choice.index,
                "text": prefix_text + text,
                "logprobs": self._completion_logprobs(choice, prefix_entries + entries),
            }
        entry["finish_reason"], entry["stop_reason"] = self._reason(choice), choice.stop_reason
        if stats is not None:
            entry["speculative_decoding_stats"] = stats
        return self._top([entry], streamed=True)

    # --- tool calls ----------------------------------------------------------------------------

    def _reader(self, choice: Choice) -> CallReader | None:
        """The choice's call reader, when its chat offers tools to call (tool_choice not none)."""
        tools = self.checked.tools
        if tools is None or tools.choice == "none":
            return None
        if choice.reader is None:
            choice.reader = CallReader([function["name"] for function in tools.functions])
        return choice.reader

    def _message(self, choice: Choice, text: str) -> dict:
        """A whole answer's message: its text, or, with tools, its content and calls (content null
        when it only called tools, as OpenAI gives it); with a reasoning parser, the reasoning apart
        (`reasoning` and `reasoning_content`, as vLLM gives it; null without any)."""
        thinking = {}
        if self.reasoning is not None:
            reasoning, text = split(self.reasoning, text)
            thinking = _thinking(reasoning or None)
        reader = self._reader(choice)
        if reader is None:
            return {"role": "assistant", "content": text, **thinking}
        content, calls = reader.feed(text)
        rest, last = reader.finish()
        content, calls = content + rest, calls + last
        message = {"role": "assistant", "content": content if content or not calls else None, **thinking}
        if calls:
            message["tool_calls"] = [call.shaped() for call in calls]
        return message

    def _think(self, choice: Choice, text: str) -> tuple[str, str]:
        """A streamed piece as (reasoning, content) where the server reads reasoning apart; all
        content otherwise."""
        if self.reasoning is None:
            return "", text
        if choice.thinker is None:
            choice.thinker = ReasoningReader(self.reasoning)
        reasoning, content = choice.thinker.feed(text)
        if choice.output is not None:
            more, rest = choice.thinker.finish()
            reasoning, content = reasoning + more, content + rest
        return reasoning, content

    def _delta(self, choice: Choice, text: str) -> dict:
        """A streamed chunk's delta: the new text, or, with tools, the content given out and each call
        once it is whole (its arguments in one piece), numbered as OpenAI's stream numbers them."""
        reasoning, text = self._think(choice, text)
        thinking = _thinking(reasoning) if reasoning else {}
        reader = self._reader(choice)
        if reader is None:
            return {**thinking, "content": text} if text else thinking
        before = len(reader.calls)
        content, calls = reader.feed(text)
        if choice.output is not None:
            rest, last = reader.finish()
            content, calls = content + rest, calls + last
        delta: dict = {**thinking, "content": content} if content else thinking
        if calls:
            delta["tool_calls"] = [call.shaped(before + j) for j, call in enumerate(calls)]
        return delta

    def _reason(self, choice: Choice) -> str | None:
        """Why the choice ended: "tool_calls" when it stopped after calling tools it chose to call
        (auto or required; a named function's call ends with "stop", as OpenAI and vLLM say)."""
        reason = choice.reason
        tools = self.checked.tools
        called = choice.reader is not None and choice.reader.calls
        if reason == "stop" and called and tools.choice in ("auto", "required"):
            return "tool_calls"
        return reason

    def usage_chunk(self, choices: list[Choice], stats: list[dict | None]) -> dict:
        return self._top([], usage=self.usage(choices), stats=stats, streamed=True)

    # --- pieces --------------------------------------------------------------------------------

    def usage(self, choices: list[Choice]) -> dict:
        """Every prompt's tokens once (its samples share them) and every choice's generated tokens."""
        n = sum(len(c.token_ids) for c in choices)
        prompt = sum(len(ids) for ids in self.prompt_ids)
        firsts = choices[:: self.checked.n]  # each prompt's first sample, which ran its prefill
        cached = sum(c.output.num_cached_tokens for c in firsts if c.output is not None)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": n,
            "total_tokens": prompt + n,
            "prompt_tokens_details": {"cached_tokens": cached},  # OpenAI's field: rows from the prefix cache
        }
        used = [c.output.prediction_tokens for c in choices if c.output is not None and c.output.prediction_tokens]
        if self.checked.prediction is not None:  # OpenAI's: what the answers kept of the prediction
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": sum(accepted for accepted, _ in used),
                "rejected_prediction_tokens": sum(rejected for _, rejected in used),
            }
        return usage

    def _top(
        self,
        choices: list[dict],
        usage: dict | None = None,
        stats: list[dict | None] | None = None,
        streamed: bool = False,
    ) -> dict:
        obj = self.chunk_object if streamed else self.object
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        elif self.checked.include_usage and streamed:
            out["usage"] = None  # OpenAI's: with include_usage, every chunk before the usage chunk says null
        if stats is not None and len(stats) == 1 and stats[0] is not None:
            out["speculative_decoding_stats"] = stats[0]  # where a reader of the whole response looks
        return out

    def _echo_entries(self, choice: Choice) -> list:
        """The prompt's logprob entries, echo with logprobs only ([None] * len first when missing)."""
        if not self.checked.echo or self.checked.logprobs is None:
            return []
        return list(choice.prompt_logprobs or [None] * len(self.prompt_ids[choice.prompt]))

    def _completion_logprobs(self, choice: Choice, entries: list) -> dict | None:
        """The completions shape: tokens, token_logprobs, top_logprobs and text offsets."""
        if self.checked.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = choice.text_offset
        for i, entry in enumerate(entries):
            if entry is None:  # the prompt's first token: nothing before it
                prompt_ids = self.prompt_ids[choice.prompt]
                token = self.tokenizer.piece(prompt_ids[i]) if self.tokenizer is not None else ""
                tokens.append(token)
                token_logprobs.append(None)
                top.append(None)
            else:
                token = self._piece(entry.token_id)
                tokens.append(token)
                token_logprobs.append(floored(entry.logprob))
                # The chosen token's logprob always among them, as OpenAI and vLLM give it: up to
                # logprobs + 1 entries where it is not among the likeliest (sampled, or a logit bias).
                likeliest = {self._piece(t): floored(lp) for t, lp in entry.top}
                top.append(likeliest | {token: likeliest.get(token, floored(entry.logprob))})
            offsets.append(offset)
            offset += len(token)
        choice.text_offset = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, entries: list) -> dict | None:
        if self.checked.logprobs is None:
            return None
        return {
            "content": [
                {**self._token(e.token_id, e.logprob), "top_logprobs": [self._token(t, lp) for t, lp in e.top]}
                for e in entries
            ]
        }

    def _token(self, token_id: int, logprob: float) -> dict:
        piece = self._piece(token_id)
        raw = self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else piece.encode("utf-8", "replace")
        return {"token": piece, "logprob": floored(logprob), "bytes": list(raw)}

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.piece(token_id) if self.tokenizer is not None else f"<{token_id}>"


def echo_texts(checked: Checked, prompt_ids: list[list[int]], tokenizer) -> list[str]:
    """What `echo` puts before each prompt's completions: the prompt as sent (token ids decoded, and
    a prompt cut by truncate_prompt_tokens as what was kept, which its logprobs score)."""
    if not checked.echo:
        return [""] * len(prompt_ids)
    return [
        prompt
        if isinstance(prompt, str) and not (checked.cut and checked.cut[index])
        else tokenizer.decode(ids)
        if tokenizer is not None
        else ""
        for index, (prompt, ids) in enumerate(zip(checked.prompts, prompt_ids))
    ]


def _thinking(reasoning: str | None) -> dict:
    """An answer's reasoning under vLLM's name (`reasoning`) and its older one (`reasoning_content`,
    which DeepSeek's API and many clients read)."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def error_body(exc: BadRequest) -> dict:
    """OpenAI's error shape: a response's body, or a stream's last event. Text the client sent back
    to it (a field's name) may hold a lone surrogate, which UTF-8 cannot carry: it goes escaped."""
    return {
        "error": {"message": _sendable(exc.message), "type": exc.kind, "param": _sendable(exc.param), "code": exc.code}
    }


def _sendable(text: str | None) -> str | None:
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def refused(exc: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


def model_list(
    names: tuple[str, ...], created: int, max_model_len: int, speculative_model: str | None, card: ModelCard
) -> dict:
    """/v1/models: the one served model under each of its names, naming the speculator that drafts
    for it (None: none) and, as llama.cpp does, the model's facts (`meta`, from `card`); beside
    OpenAI's `data`, llama.cpp's Ollama-style `models` (its fields llama.cpp leaves empty left empty,
    the weights' file format named in its details)."""
    return {
        "models": [ollama_entry(name, card.file_format) for name in names],
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "forerun",
                "max_model_len": max_model_len,
                "speculative_model": speculative_model,
                "meta": card.meta(max_model_len),
            }
            for name in names
        ],
    }


def ollama_entry(name: str, file_format: str) -> dict:
    """One name's entry of the `models` list llama-server gives (as Ollama's /api/tags lists a model)."""
    return {
        "name": name,
        "model": name,
        "modified_at": "",
        "size": "",
        "digest": "",
        "type": "model",
        "description": "",
        "tags": [""],
        "capabilities": ["completion"],
        "parameters": "",
        "details": {
            "parent_model": "",
            "format": file_format,
            "family": "",
            "families": [""],
            "parameter_size": "",
            "quantization_level": "",
        },
    }


def floored(logprob: float) -> float:
    """A logprob JSON can hold: -inf (a token the model rules out) as LOGPROB_FLOOR."""
    return max(float(logprob), LOGPROB_FLOOR)


def spec_stats(m: SpecMetrics, detailed: bool) -> dict | None:
    """vLLM's per-request spec-decode figures of one sample; None when it never verified a draft."""
    if m.num_speculative_tokens == 0:
        return None
    steps, accepted = m.num_drafts, m.num_accepted_tokens
    figures = {
        "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / m.num_draft_tokens if m.num_draft_tokens else 0.0,
        "acceptance_histogram": {str(j): c for j, c in enumerate(m.acceptance_histogram) if c},
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": m.num_draft_tokens,
        "num_spec_tokens": m.num_speculative_tokens,
        "accepted_per_position": list(m.accepted_per_position),  # [K] drafts kept at positions 1..K
    }
    if detailed:
        figures["per_step_accepted"] = [kept for _, kept in m.steps]
        figures["per_step_drafted"] = [drafted for drafted, _ in m.steps]
    return figures
