"""What every route of one `forerun serve` app reads: its options, the backend, metrics and limits.

One object rather than closure variables, so a handler's inputs are named in one place. Its one
behaviour is the check every guarded route makes first: the API key, then the body's declared size.
The check runs in the route rather than in an HTTP middleware, because a middleware hides a
client's disconnect from the route.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from forerun.base.errors import ForerunError
from forerun.models.card import ModelCard
from forerun.models.tokenizer import Tokenizer
from forerun.serve.backend import Backend
from forerun.serve.metrics import ServerMetrics
from forerun.serve.requests import BadRequest, Limits
from forerun.serve.response_store import ResponseStore
from forerun.serve.responses import refused

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413)
BODY_TIMEOUT = 30.0  # seconds a request's body may take to arrive (408)
SPEC_STATS = ("none", "summary", "detailed")


@dataclass
class ServerConfig:
    served_model_name: str
    max_model_len: int  # prompt plus max_tokens may not exceed it
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout: float = BODY_TIMEOUT
    speculative_model: str | None = None  # /v1/models lists it as the served model's speculator
    spec_stats: str = "none"  # per-request speculation figures: none, summary or detailed
    reasoning_parser: str | None = None  # chat answers' <think> reasoning apart (`base.reasoning`): qwen3, deepseek_r1
    aliases: tuple[str, ...] = ()  # other names a request may give the model (its answer names it so)
    max_num_seqs: int = 1  # requests run at once (llama.cpp's /props calls them slots)
    model_path: str = ""  # what --model named (llama.cpp's /props shows it)
    speculative_tokens: int = 0  # the most tokens a step drafts; 0: no speculation (llama.cpp's /slots)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may give the served model: its own first."""
        return (self.served_model_name, *self.aliases)


@dataclass
class ServerState:
    config: ServerConfig
    backend: Backend  # where the requests run: this process's scheduler, or replicas
    metrics: ServerMetrics
    tokenizer: Tokenizer | None  # None: a model without one, whose prompts come as token ids
    limits: Limits
    created: int  # when the app was made, in seconds since the epoch (/v1/models' `created`)
    card: ModelCard  # the model's facts /v1/models and /props give
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's stored answers

    @classmethod
    def build(
        cls,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        backend: Backend,
        config: ServerConfig,
        metrics: ServerMetrics,
        card: ModelCard,
    ) -> ServerState:
        """The state over `backend`, running a model of `vocab_size` tokens read by `tokenizer`, its
        facts `card`."""
        if config.spec_stats not in SPEC_STATS:
            raise ForerunError(
                f"per-request speculation figures must be one of {', '.join(SPEC_STATS)}, got {config.spec_stats!r}"
            )
        limits = Limits(config.max_model_len, vocab_size, config.max_body_bytes)
        return cls(config, backend, metrics, tokenizer, limits, int(time.time()), card)

    def check_access(self, request: HTTPRequest) -> None:
        """BadRequest (401 or 413) unless the request carries the key and declares a body within the limit."""
        key, limit = self.config.api_key, self.config.max_body_bytes
        if key:
            given = request.headers.get("authorization", "")
            other = request.headers.get("x-api-key", "")  # Anthropic's header, as llama.cpp takes it too
            bearer = hmac.compare_digest(given.encode(), f"Bearer {key}".encode())
            if not (bearer or (other and hmac.compare_digest(other.encode(), key.encode()))):
                raise BadRequest(
                    "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    None,
                    401,
                    "invalid_request_error",  # OpenAI's type for a wrong key (code invalid_api_key)
                    "invalid_api_key",
                )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise BadRequest(f"request body of {length} bytes is over the limit of {limit} bytes", None, 413)

    def refusal(self, request: HTTPRequest) -> Response | None:
        """`check_access`'s error response (counted), or None when the request may go on."""
        try:
            self.check_access(request)
        except BadRequest as exc:
            self.metrics.rejected(exc.status)
            return refused(exc)
        return None
