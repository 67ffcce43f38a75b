"""llama.cpp beside forerun: `forerun bench`'s contenders (a llama-server each, what is left out noted, a
line for the report), and the one llama-server `forerun bench-serve` loads."""

from __future__ import annotations

import time
from pathlib import Path

from forerun.base import cpu
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.bench.contenders import Measurement, PeerSetup
from forerun.bench.llamacpp import ENGINE, LLAMA_DRAFT, LLAMA_METHODS, LLAMA_PLAIN
from forerun.bench.llamacpp.build import CMAKE_FLAGS, VERSION, ensure_server, peer_dir
from forerun.bench.llamacpp.completion import parse_completion, request_body
from forerun.bench.llamacpp.repack import REPACK_PROBE_ROWS, repack_works
from forerun.bench.llamacpp.server import LlamaServer, server_command
from forerun.bench.llamacpp.server_spec import ServerSpec, server_specs, shown
from forerun.models.source import resolve
from forerun.models.tokenizer import Tokenizer


class LlamaCppContender:
    engine = ENGINE

    def __init__(self, server: LlamaServer, tokenizer: Tokenizer) -> None:
        self.server, self.tokenizer = server, tokenizer
        self.method, self.k = server.spec.method, server.spec.k
        self.options = server.spec.options()

    def run(self, prompt_ids: list[int], params: SamplingParams) -> Measurement:
        body = request_body(prompt_ids, params)
        start = time.perf_counter()
        reply = self.server.complete(body)
        elapsed = time.perf_counter() - start
        return parse_completion(reply, elapsed, self.tokenizer, params, speculative=self.k > 0)

    def close(self) -> None:
        self.server.stop()


def gguf_file(spec: str) -> tuple[Path | None, str]:
    """(the .gguf file behind model `spec`, "") or (None, why llama.cpp cannot run it)."""
    try:
        source = resolve(spec)
    except ForerunError as exc:
        return None, str(exc)
    if source.kind != "gguf":
        return None, f"it runs .gguf files only, and {spec!r} is a {source.kind} model folder"
    return source.path, ""


def serving_command(model_spec: str, port: int, threads: int, context: int, slots: int) -> tuple[list[str] | None, str]:
    """llama-server as bench-serve loads it: plain, `slots` requests at once sharing `context` tokens.

    (its command line, "") or (None, why llama.cpp cannot run the model); llama.cpp is built first if needed.
    """
    gguf, problem = gguf_file(model_spec)
    if gguf is None:
        return None, problem
    binary = ensure_server()
    repack = repack_works(binary, gguf, threads)
    spec = ServerSpec(LLAMA_PLAIN, 0, gguf, threads, context, repack=repack, slots=slots)
    return server_command(binary, spec, port), ""


def llamacpp_contenders(
    model_spec: str,
    draft_spec: str | None,
    ks: list[int],
    tokenizer: Tokenizer,
    threads: int,
    context: int,
    methods: tuple[str, ...] = LLAMA_METHODS,
    ngram: int = 3,
) -> PeerSetup:
    """Start a llama-server per configuration; anything missing or failing becomes a note, not an error.

    `context`: the longest prompt plus max tokens. The binary is built first if there is none.
    """
    setup = PeerSetup()
    model, problem = gguf_file(model_spec)
    if model is None:
        setup.notes.append(f"llama.cpp peer left out: {problem}")
        return setup
    draft = _draft_file(draft_spec, methods, setup.notes)
    if not server_specs(model, draft, ks, threads, context, methods, ngram):
        return setup
    try:
        binary = ensure_server()
    except ForerunError as exc:
        setup.notes.append(f"llama.cpp peer left out: {exc}")
        return setup
    repack = repack_works(binary, model, threads)
    if not repack:
        setup.notes.append(
            f"llama.cpp runs with --no-repack: with its default repacked weights it crashed on a "
            f"{REPACK_PROBE_ROWS}-row batch on this CPU ({cpu.name()}; llama.cpp issue #20824), "
            "so every prompt and every verification would kill it"
        )
    _start_all(binary, server_specs(model, draft, ks, threads, context, methods, ngram, repack), tokenizer, setup)
    return setup


def _draft_file(draft_spec: str | None, methods: tuple[str, ...], notes: list[str]) -> Path | None:
    """The draft .gguf for llama-draft, or None with a note saying why it is left out."""
    if LLAMA_DRAFT not in methods:
        return None
    if draft_spec is None:
        notes.append("llama.cpp draft speculation left out: no --speculative-model to draft with")
        return None
    draft, problem = gguf_file(draft_spec)
    if draft is None:
        notes.append(f"llama.cpp draft speculation left out: {problem}")
    return draft


def _start_all(binary: Path, specs: list[ServerSpec], tokenizer: Tokenizer, setup: PeerSetup) -> None:
    """A contender per spec whose server starts; a note for each that does not."""
    try:
        for spec in specs:
            server = LlamaServer(binary, spec, peer_dir() / "logs" / f"{spec.method}-k{spec.k}.log")
            try:
                server.start()
            except ForerunError as exc:
                setup.notes.append(
                    f"llama.cpp {spec.method}" + (f" K={spec.k}" if spec.k else "") + f" left out: {exc}"
                )
                continue
            setup.contenders.append(LlamaCppContender(server, tokenizer))
    except BaseException:  # Ctrl-C while servers start: stop the ones already up
        for c in setup.contenders:
            c.close()
        raise


def describe(setup_contenders: list) -> str:
    """One line for report.md: which llama.cpp ran, and with what flags."""
    flags = {}
    for c in setup_contenders:
        if isinstance(c, LlamaCppContender):
            label = c.method if not c.k else f"{c.method} K={c.k}"
            flags.setdefault(c.method, f"{label}: `{' '.join(shown(c.server.spec.flags()))}`")
    threads = next((c.server.spec.threads for c in setup_contenders if isinstance(c, LlamaCppContender)), None)
    return (
        f"llama.cpp peers (llama-*): llama-server from the llama.cpp tree in llama-cpp-python {VERSION}, "
        f"built with {' '.join(CMAKE_FLAGS)}; it runs the same GGUF files in their own quantization (as "
        "forerun's gguf format does, with its own activation rounding and summation order; other formats "
        "dequantize them), so its tokens equal forerun plain's all the way on some prompts only; it gets the same "
        "prompt token ids, max tokens and sampling (greedy: top-k 1), stops at its model's end-of-generation "
        f"tokens, processes every prompt (cache_prompt false) and uses {threads} threads like torch. Flags "
        "(at the first K; each K has a server of its own): "
        + "; ".join(flags.values())
        + ". Its TTFT is its own prompt_ms; its α counts its drafts (draft_n, "
        "draft_n_accepted); its verification steps are not reported, so mean accepted length stays blank."
    )
