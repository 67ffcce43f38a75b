"""What a llama-server is started with: a bench run's configurations, and the one place its flags are built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from forerun.bench.llamacpp import LLAMA_DRAFT, LLAMA_NGRAM, LLAMA_PLAIN
from forerun.bench.llamacpp.build import VERSION

# A draft token below this probability ends the draft. llama.cpp's default (0) drafts K tokens
# however unsure, which collapses acceptance; 0.75 is the value its server documentation shows.
DRAFT_P_MIN = 0.75
NGRAM_TYPE = "ngram-simple"  # look up the last N tokens earlier in the context, copy what followed


@dataclass(frozen=True)
class ServerSpec:
    """What a llama-server is started with, apart from its binary and port."""

    method: str  # llama-plain, llama-draft or llama-ngram
    k: int  # draft length; 0 for plain
    model: Path  # the target .gguf
    threads: int  # -t and -td, as many as torch uses
    context: int  # -c: the longest prompt plus max tokens, with room for a draft (all slots together)
    draft: Path | None = None  # the draft .gguf, for llama-draft
    ngram: int = 3  # llama-ngram: how many last tokens to look up
    repack: bool = True  # False: --no-repack (see repack.py)
    slots: int = 1  # -np: requests served at once (the bench sends one at a time)

    def flags(self) -> list[str]:
        """The command line's flags, port aside: no prompt cache in RAM, no web UI."""
        flags = ["-m", str(self.model), "-t", str(self.threads), "-td", str(self.threads)]
        flags += ["-c", str(self.context), "-np", str(self.slots), "-cram", "0", "--no-webui"]
        return flags + ([] if self.repack else ["--no-repack"]) + self.speculation_flags()

    def speculation_flags(self) -> list[str]:
        if self.method == LLAMA_DRAFT:
            return [
                "--spec-type",
                "draft-simple",
                "-md",
                str(self.draft),
                "--spec-draft-n-max",
                str(self.k),
                "--spec-draft-p-min",
                str(DRAFT_P_MIN),
            ]
        if self.method == LLAMA_NGRAM:
            return [
                "--spec-type",
                NGRAM_TYPE,
                "--spec-ngram-simple-size-n",
                str(self.ngram),
                "--spec-ngram-simple-size-m",
                str(self.k),
            ]
        return []

    def options(self) -> dict:
        """As results.jsonl records them: what shapes the numbers, not where the files lie."""
        options = {"version": VERSION, "threads": self.threads}
        flags = ([] if self.repack else ["--no-repack"]) + self.speculation_flags()
        if flags:
            options["flags"] = " ".join(shown(flags))
        return options


def shown(flags: list[str]) -> list[str]:
    """Flags as a report shows them: a .gguf file by its name, not its path."""
    return [Path(f).name if f.endswith(".gguf") else f for f in flags]


def server_specs(
    model: Path,
    draft: Path | None,
    ks: list[int],
    threads: int,
    context: int,
    methods: tuple[str, ...],
    ngram: int = 3,
    repack: bool = True,
) -> list[ServerSpec]:
    """Plain first, then draft and n-gram at each K (draft only with a draft model)."""
    specs = [ServerSpec(LLAMA_PLAIN, 0, model, threads, context, repack=repack)] if LLAMA_PLAIN in methods else []
    for k in ks:
        if LLAMA_DRAFT in methods and draft is not None:
            specs.append(ServerSpec(LLAMA_DRAFT, k, model, threads, context + k, draft, repack=repack))
        if LLAMA_NGRAM in methods:
            specs.append(ServerSpec(LLAMA_NGRAM, k, model, threads, context + k, ngram=ngram, repack=repack))
    return specs
