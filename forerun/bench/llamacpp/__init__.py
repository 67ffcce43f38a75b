"""llama.cpp as a bench peer: its contenders' names, and the error that leaves it out of a run.

The source is the llama.cpp tree vendored in a pinned llama-cpp-python sdist, built once under
FORERUN_HOME/peers/ (build.py; `make peers` builds it ahead). Three contenders, each a llama-server of
its own on a loopback port, started once and stopped at the end (peer.py): `llama-plain`,
`llama-draft` (its draft-model speculation, same draft GGUF, at each K) and `llama-ngram` (its n-gram
speculation, drafts of K tokens). What each server is started with is server_spec.py; running one is
server.py; a request and its answer are completion.py; whether its repacked weights run on this CPU
is repack.py. Every request carries forerun's prompt token ids, max tokens and sampling settings,
with `cache_prompt: false` so each run processes its prompt. llama.cpp runs the GGUF files as they
are (their own quantization), as forerun's gguf format does; forerun's other formats dequantize them.
"""

from __future__ import annotations

from forerun.base.errors import ForerunError

PEER = "llama.cpp"  # in --peers: all three contenders
LLAMA_PLAIN, LLAMA_DRAFT, LLAMA_NGRAM = "llama-plain", "llama-draft", "llama-ngram"
LLAMA_METHODS = (LLAMA_PLAIN, LLAMA_DRAFT, LLAMA_NGRAM)
ENGINE = "llama.cpp"


class LlamaCppUnavailable(ForerunError):
    """llama.cpp could not be found, downloaded, built or started; the bench notes it and goes on."""
