"""llama.cpp as a bench peer: find or build llama-server from a pinned source, run it as contenders.

The source is the llama.cpp tree vendored in the llama-cpp-python sdist of `VERSION` on PyPI
(checked against `SDIST_SHA256`), built once under FORERUN_HOME/peers/ with CMake. Three
contenders, each a llama-server of its own on a loopback port, started once and stopped at the end:
`llama-plain`, `llama-draft` (its draft-model speculation, same draft GGUF, at each K) and
`llama-ngram` (its n-gram speculation, drafts of K tokens). Every request carries forerun's prompt
token ids, max tokens and sampling settings, with `cache_prompt: false` so each run processes its
prompt. llama.cpp runs the GGUF files as they are (their own quantization), as forerun's gguf format
does; forerun's other formats dequantize them.

Build ahead of time with `make peers`, which calls `main()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from forerun.base import cpu
from forerun.base.config import SamplingParams
from forerun.base.errors import ForerunError
from forerun.base.paths import forerun_home
from forerun.bench.contenders import Measurement, PeerSetup
from forerun.models.load import resolve
from forerun.models.tokenizer import Tokenizer

VERSION = "0.3.36"  # the llama-cpp-python release whose vendor/llama.cpp is built
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF")
TARGETS = ("llama-server", "llama-speculative-simple", "llama-bench")

PEER = "llama.cpp"  # in --peers: all three contenders
LLAMA_PLAIN, LLAMA_DRAFT, LLAMA_NGRAM = "llama-plain", "llama-draft", "llama-ngram"
LLAMA_METHODS = (LLAMA_PLAIN, LLAMA_DRAFT, LLAMA_NGRAM)
ENGINE = "llama.cpp"

# A draft token below this probability ends the draft. llama.cpp's default (0) drafts K tokens
# however unsure, which collapses acceptance; 0.75 is the value its server documentation shows.
DRAFT_P_MIN = 0.75
NGRAM_TYPE = "ngram-simple"  # look up the last N tokens earlier in the context, copy what followed
STARTUP_TIMEOUT_S = 300.0  # loading two GGUF files from a cold disk can take a while
REQUEST_TIMEOUT_S = 3600.0


class LlamaCppUnavailable(ForerunError):
    """llama.cpp could not be found, downloaded, built or started; the bench notes it and goes on."""


# --- finding and building -----------------------------------------------------------------------


def peer_dir() -> Path:
    return forerun_home() / "peers" / f"llama.cpp-{VERSION}"


def source_dir() -> Path:
    return peer_dir() / "llama.cpp"


def server_path() -> Path:
    return source_dir() / "build" / "bin" / "llama-server"


def stamp_path() -> Path:
    return peer_dir() / "built.json"


def unpacked_path() -> Path:
    return peer_dir() / "unpacked"  # the source tree is complete


def find_server() -> Path | None:
    """llama-server from a finished build, or None: the stamp is written only after a build succeeds."""
    server = server_path()
    return server if stamp_path().is_file() and server.is_file() else None


def ensure_server(say: Callable[[str], None] | None = None) -> Path:
    """The llama-server binary, built first if this machine has none (minutes, once)."""
    return find_server() or build(say)


def build(say: Callable[[str], None] | None = None, jobs: int | None = None) -> Path:
    """Download the pinned sdist, unpack its llama.cpp tree and build it; raises LlamaCppUnavailable."""
    say = say or _say
    root = peer_dir()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    jobs = jobs or os.cpu_count() or 2
    say(
        f"building llama.cpp (from llama-cpp-python {VERSION}) for the llama.cpp peer, once: about 10 "
        f"minutes on 2 idle cores, more on a busy machine. It goes in {root}; the build log is {log}."
    )
    start = time.perf_counter()
    try:
        if unpacked_path().is_file() and (source_dir() / "CMakeLists.txt").is_file():
            src = source_dir()  # an interrupted or failed build: compile what is there
        else:
            src = _unpack(_download(root / "download", say), root)
        say(f"compiling {', '.join(TARGETS)} with {jobs} jobs ...")
        with log.open("w") as out:
            _step(["cmake", "-B", "build", *CMAKE_FLAGS], src, out, log)
            _step(["cmake", "--build", "build", f"-j{jobs}", "--target", *TARGETS], src, out, log)
    except (OSError, tarfile.TarError) as exc:  # a full disk, an unreadable archive
        raise LlamaCppUnavailable(f"building llama.cpp in {root} failed: {exc}") from None
    if not server_path().is_file():
        raise LlamaCppUnavailable(f"the llama.cpp build finished but {server_path()} is missing; see {log}")
    seconds = time.perf_counter() - start
    stamp_path().write_text(
        json.dumps(
            {
                "version": VERSION,
                "sdist_sha256": SDIST_SHA256,
                "cmake": list(CMAKE_FLAGS),
                "targets": list(TARGETS),
                "build_seconds": round(seconds),
                "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
            },
            indent=1,
        )
    )
    shutil.rmtree(root / "download", ignore_errors=True)
    say(f"llama.cpp built in {seconds / 60:.1f} minutes: {server_path()}")
    return server_path()


def _download(folder: Path, say: Callable[[str], None]) -> Path:
    sdist = folder / SDIST
    if not (sdist.is_file() and _sha256(sdist) == SDIST_SHA256):
        say(f"downloading the llama-cpp-python {VERSION} source (75 MB) from PyPI with pip ...")
        folder.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"llama-cpp-python=={VERSION}",
            "-d",
            str(folder),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not sdist.is_file():
            raise LlamaCppUnavailable(
                f"could not download llama-cpp-python {VERSION} with pip "
                f"({_last_line(done.stderr or done.stdout)}); check the network and run "
                "`make peers` again"
            )
    digest = _sha256(sdist)
    if digest != SDIST_SHA256:
        raise LlamaCppUnavailable(
            f"{sdist} has sha256 {digest}, expected {SDIST_SHA256}; delete it and run `make peers` again"
        )
    return sdist


def _unpack(sdist: Path, root: Path) -> Path:
    """vendor/llama.cpp out of the sdist into root/llama.cpp (a half-unpacked tree is replaced)."""
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    staging = root / "unpacking"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise LlamaCppUnavailable(f"{sdist} holds no {prefix}; is it the right file?")
        tar.extractall(staging, members=members, filter="data")
    tree = staging / prefix.rstrip("/")
    (tree / ".git").unlink(missing_ok=True)  # a submodule pointer into a .git that is not there
    unpacked_path().unlink(missing_ok=True)
    shutil.rmtree(source_dir(), ignore_errors=True)
    tree.rename(source_dir())
    shutil.rmtree(staging, ignore_errors=True)
    unpacked_path().write_text(f"{SDIST} {SDIST_SHA256}\n")
    return source_dir()


def _step(command: list[str], cwd: Path, out, log: Path) -> None:
    out.write(f"$ {' '.join(command)}\n")
    out.flush()
    try:
        done = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    except FileNotFoundError:
        raise LlamaCppUnavailable(
            f"building llama.cpp needs {command[0]}, which is not installed (apt-get install cmake g++)"
        ) from None
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise LlamaCppUnavailable(
            f"`{' '.join(command)}` failed (exit {done.returncode}); the last lines of {log}:\n" + "\n".join(tail)
        )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def _say(message: str) -> None:
    print(f"forerun: {message}", file=sys.stderr, flush=True)


# --- whether its repacked weights run on this CPU ------------------------------------------------

REPACK_PROBE_ROWS = 4  # a pass over this many rows shows the crash below
REPACK_PROBE_TIMEOUT_S = 300.0


def repack_path() -> Path:
    return peer_dir() / "repack.json"


def repack_works(binary: Path, model: Path, threads: int) -> bool:
    """Whether llama.cpp's default, repacked weights survive a pass over several rows on this CPU.

    By default llama.cpp repacks weights into layouts for the CPU's matrix units; on some CPUs with
    AMX its AMX kernels crash the process on every batch of more than one row (llama.cpp issue
    #20824), which kills a server at its first prompt. Probed once per CPU with llama-bench (a
    sibling of `binary`) and remembered in FORERUN_HOME/peers/; where it crashes, the peer runs with
    --no-repack, llama.cpp's own switch for it. Without llama-bench it cannot tell: True.
    """
    bench = binary.parent / "llama-bench"
    if not bench.is_file():
        return True
    key = hashlib.sha256(f"{VERSION}|{cpu.name()}|{' '.join(sorted(cpu.flags()))}".encode()).hexdigest()[:16]
    path = repack_path()
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        known = {}
    if key in known:
        return bool(known[key])
    command = [
        str(bench),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-p",
        str(REPACK_PROBE_ROWS),
        "-n",
        "0",
        "-r",
        "1",
        "--repack",
        "1",
    ]
    try:
        works = subprocess.run(command, capture_output=True, timeout=REPACK_PROBE_TIMEOUT_S).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        works = False
    known[key] = works
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(known, indent=1))
    return works


# --- one server per configuration ---------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    """What a llama-server is started with, apart from its binary and port."""

    method: str  # llama-plain, llama-draft or llama-ngram
    k: int  # draft length; 0 for plain
    model: Path  # the target .gguf
    threads: int  # -t and -td, as many as torch uses
    context: int  # -c: the longest prompt plus max tokens, with room for a draft
    draft: Path | None = None  # the draft .gguf, for llama-draft
    ngram: int = 3  # llama-ngram: how many last tokens to look up
    repack: bool = True  # False: --no-repack (see repack_works)

    def flags(self) -> list[str]:
        """The command line's flags, port aside: one slot, no prompt cache in RAM, no web UI."""
        flags = [
            "-m",
            str(self.model),
            "-t",
            str(self.threads),
            "-td",
            str(self.threads),
            "-c",
            str(self.context),
            "-np",
            "1",
            "-cram",
            "0",
            "--no-webui",
        ] + ([] if self.repack else ["--no-repack"])
        return flags + self.speculation_flags()

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
            options["flags"] = " ".join(f if not f.endswith(".gguf") else Path(f).name for f in flags)
        return options


class LlamaServer:
    """A llama-server subprocess on a free loopback port; `start` waits until /health says ok."""

    def __init__(self, binary: Path, spec: ServerSpec, log: Path) -> None:
        self.binary, self.spec, self.log = binary, spec, log
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [str(self.binary), *self.spec.flags(), "--host", "127.0.0.1", "--port", str(self.port)]

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.port = free_port()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self.log.open("w") as out:
                self.process = subprocess.Popen(
                    self.command(),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_end_with_parent,
                )
        except OSError as exc:
            raise LlamaCppUnavailable(f"could not start {self.binary}: {exc}") from None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LlamaCppUnavailable(
                    f"llama-server for {self.spec.method} exited with code "
                    f"{self.process.returncode} while starting: {self._log_tail()}"
                )
            if self._healthy():
                return
            time.sleep(0.25)
        self.stop()
        raise LlamaCppUnavailable(
            f"llama-server for {self.spec.method} was not ready after {timeout_s:.0f} s; see {self.log}"
        )

    def complete(self, body: dict) -> dict:
        request = urllib.request.Request(
            f"{self.url}/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise ForerunError(f"llama-server ({self.spec.method}) answered {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            raise ForerunError(
                f"llama-server ({self.spec.method}) did not answer ({exc.reason}); see {self.log}"
            ) from None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200  # 503 while the model loads
        except (urllib.error.URLError, OSError):
            return False

    def _log_tail(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log.is_file() else []
        return " | ".join(lines[-3:]) or "no output"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_with_parent() -> None:
    """In the child, before exec: on Linux, have the kernel stop the server if forerun dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# --- requests and answers -----------------------------------------------------------------------


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
    engine = {
        key: timings[key]
        for key in (
            "prompt_n",
            "prompt_ms",
            "prompt_per_second",
            "predicted_n",
            "predicted_ms",
            "predicted_per_second",
            "draft_n",
            "draft_n_accepted",
        )
        if key in timings
    }
    return Measurement(tokens, text, finish, elapsed_s, min(first, elapsed_s), spec, engine)


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


# --- the bench's entry point --------------------------------------------------------------------


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
    model, problem = _gguf(model_spec)
    if model is None:
        setup.notes.append(f"llama.cpp peer left out: {problem}")
        return setup
    draft = None
    if LLAMA_DRAFT in methods:
        if draft_spec is None:
            setup.notes.append("llama.cpp draft speculation left out: no --speculative-model to draft with")
        else:
            draft, problem = _gguf(draft_spec)
            if draft is None:
                setup.notes.append(f"llama.cpp draft speculation left out: {problem}")
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
    specs = server_specs(model, draft, ks, threads, context, methods, ngram, repack)
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
    return setup


def describe(setup_contenders: list) -> str:
    """One line for report.md: which llama.cpp ran, and with what flags."""
    flags = {}
    for c in setup_contenders:
        if isinstance(c, LlamaCppContender):
            label = c.method if not c.k else f"{c.method} K={c.k}"
            flags.setdefault(c.method, f"{label}: `{' '.join(_shown(c.server.spec.flags()))}`")
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


def _shown(flags: list[str]) -> list[str]:
    return [Path(f).name if f.endswith(".gguf") else f for f in flags]


def _gguf(spec: str) -> tuple[Path | None, str]:
    """(the .gguf file behind `spec`, "") or (None, why not)."""
    try:
        source = resolve(spec)
    except ForerunError as exc:
        return None, str(exc)
    if source.kind != "gguf":
        return None, f"it runs .gguf files only, and {spec!r} is a {source.kind} model folder"
    return source.path, ""


def main() -> int:
    """Build llama.cpp for the bench now, unless built already (what `make peers` runs)."""
    found = find_server()
    if found:
        _say(f"llama.cpp {VERSION} is already built: {found}")
        return 0
    try:
        build()
    except ForerunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
