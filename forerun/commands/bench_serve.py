"""`forerun bench-serve`: forerun serve under load at several concurrencies, beside llama-server."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from forerun.base.errors import ForerunError
from forerun.commands.common import positive_int

if TYPE_CHECKING:
    from forerun.bench.serve_load import LevelResult
    from forerun.bench.serve_servers import Process

SETUPS = ("off", "fixed", "auto", "off-whole", "off-uncached")
# Each set-up: its speculation policy (None: off) and `forerun serve` flags of its own. off-whole
# prefills each prompt whole before the next step (no chunked prefill), off-uncached keeps no
# earlier prompt's rows (no prefix cache): the controls for them.
_SETUP_SERVE = {
    "off": (None, []),
    "fixed": ("fixed", []),
    "auto": ("adaptive", []),
    "off-whole": (None, ["--prefill-share", "inf"]),
    "off-uncached": (None, ["--prefix-cache-mb", "0"]),
}


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers of at least 1, got {text!r}")
    return values


def register(sub) -> None:
    p = sub.add_parser(
        "bench-serve",
        help="load-test forerun serve at several concurrencies, beside llama-server",
        description="Start forerun serve once per set-up (speculation off, a fixed K, auto) and "
        "llama.cpp's llama-server, send streamed greedy completions at each concurrency, "
        "and write results.json and report.md to --out.",
    )
    p.add_argument("--model", required=True, help="embedded name, .gguf file or model folder")
    p.add_argument("--quantization", default="auto", help="the target's numeric format (as forerun serve takes it)")
    p.add_argument("--speculative-model", default=None, help="draft model for the fixed and auto set-ups")
    p.add_argument("--speculative-quantization", default="auto")
    p.add_argument("--draft-vocab", type=positive_int, default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=5, help="K: fixed K, and auto's most")
    p.add_argument(
        "--setups",
        default="off,fixed,auto",
        help=f"comma-separated, of {', '.join(SETUPS)} (off-whole: off with each prompt prefilled whole, "
        "no chunked prefill; off-uncached: off with no prefix cache); one named again runs as a second "
        "server of its own (off,auto,off: an off-against-off control, the noise between two identical servers); "
        "@rayN[xT] runs a set-up as N replicas of T threads under Ray Serve (T: the CPUs over N), "
        "and @rayN[xT]-p2c with Ray's power of two choices and a memory per replica (auto@ray2, auto@ray2-p2c)",
    )
    p.add_argument(
        "--concurrency",
        type=_ints,
        default=[1, 2, 4, 8, 16, 32],
        help="comma-separated levels; one given again runs again (a repeat, to see the noise)",
    )
    p.add_argument("--requests-per-level", type=int, default=2, help="requests sent at level c: this many times c")
    p.add_argument("--max-tokens", type=int, default=64, help="the longest a request may be")
    p.add_argument(
        "--length-spread",
        type=float,
        default=0.5,
        help="requests' max tokens are spread evenly over [(1 - this) x --max-tokens, --max-tokens] in a "
        "shuffled order, the same for every server (0: every request --max-tokens long)",
    )
    p.add_argument("--peers", default="", help="llama.cpp: llama-server with one slot per request in flight")
    p.add_argument("--dataset", default="spec-bench")
    p.add_argument("--categories", default=None, help="comma-separated categories or task kinds")
    p.add_argument(
        "--distinct",
        action="store_true",
        help="send no prompt twice in the run, so no request repeats an earlier one, and deal every "
        "level prompts as long on average as it can (an even sample over their lengths); "
        "needs --requests-per-level x the sum of the levels prompts",
    )
    p.add_argument("--out", required=True, help="folder for results.json, report.md and server logs")
    p.set_defaults(func=run)


@dataclass
class _Server:
    setup: str  # its name in the report: off, fixed, auto#2, llama-server, ...
    process: Process
    port: int


def run(args: argparse.Namespace) -> int:
    from forerun.base.prompts import load_prompts
    from forerun.bench.serve_load import level_prompts, shortest
    from forerun.models.load import load_tokenizer_of

    setups = _check(args)
    shortest(args.max_tokens, args.length_spread)  # a spread out of range: a clear error now
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer_of(args.model)  # the servers hold the model; this side only counts tokens
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = [
        tokenizer.apply_chat([{"role": "user", "content": p.text}]) for p in load_prompts(args.dataset, categories)
    ]
    if not prompts:
        raise ForerunError("no prompts to send")
    sends = level_prompts(prompts, [args.requests_per_level * c for c in args.concurrency], args.distinct)
    top = max(args.concurrency)
    context = max(len(p) for p in prompts) + args.max_tokens + args.num_speculative_tokens + 8
    servers = _forerun_servers(args, setups, top, out)
    if "llama.cpp" in args.peers:
        servers += _llama_server(args.model, context, top, out)
    _run_levels(args, servers, sends, out)
    return 0


def _check(args: argparse.Namespace) -> list[str]:
    """The set-ups asked for, once the flags are known to fit together."""
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if any(setup_serve(s)[0] is not None for s in setups) and args.speculative_model is None:
        raise ForerunError("the fixed and auto set-ups draft with a model: give --speculative-model, or --setups off")
    if args.requests_per_level < 1 or args.max_tokens < 1:
        raise ForerunError("--requests-per-level and --max-tokens must be at least 1")
    return setups


def setup_serve(setup: str) -> tuple[str | None, list[str]]:
    """A set-up's speculation policy (None: off) and its `forerun serve` flags of its own."""
    kind, _, placement = setup.partition("@")
    if kind not in _SETUP_SERVE:
        raise ForerunError(f"unknown set-up {kind!r}; use some of {', '.join(SETUPS)}")
    policy, flags = _SETUP_SERVE[kind]
    if not placement:
        return policy, flags
    found = re.fullmatch(r"ray(\d+)(?:x(\d+))?(-p2c)?", placement)
    if found is None or int(found.group(1)) < 1 or found.group(2) == "0":
        raise ForerunError(f"unknown placement {placement!r} in {setup!r}; use @rayN, @rayNxT or @rayNxT-p2c")
    replicas = int(found.group(1))
    threads = int(found.group(2) or max(1, (os.cpu_count() or 1) // replicas))
    flags = [*flags, "--ray", "--num-replicas", str(replicas), "--replica-cpus", str(threads)]
    if found.group(3):
        flags += ["--routing", "p2c", "--shared-answers-tokens", "0"]
    return policy, flags


def _forerun_servers(args: argparse.Namespace, setups: list[str], top: int, out: Path) -> list[_Server]:
    """A forerun serve per set-up (one named again is a second server, named kind#2)."""
    from forerun.bench.llamacpp.server import free_port
    from forerun.bench.serve_servers import Process, forerun_command

    servers = []
    for number, kind in enumerate(setups):
        count = setups[: number + 1].count(kind)
        setup = kind if count == 1 else f"{kind}#{count}"
        port = free_port()
        policy, flags = setup_serve(kind)
        command = forerun_command(
            port,
            args.model,
            args.quantization,
            args.speculative_model,
            args.speculative_quantization,
            args.draft_vocab,
            args.num_speculative_tokens,
            policy,
            top,
        )
        health = f"http://127.0.0.1:{port}/health"
        servers.append(_Server(setup, Process(command + flags, health, out / f"{setup}.log"), port))
    return servers


def _llama_server(model: str, context: int, top: int, out: Path) -> list[_Server]:
    """llama-server with a slot per request in flight, each with room for the longest request; none
    (and a note) when llama.cpp cannot run the model."""
    import torch

    from forerun.bench.llamacpp.peer import serving_command
    from forerun.bench.llamacpp.server import free_port
    from forerun.bench.serve_servers import Process

    port = free_port()
    command, problem = serving_command(model, port, torch.get_num_threads(), context * top, top)
    if command is None:
        print(f"forerun: llama.cpp peer left out: {problem}", file=sys.stderr)
        return []
    health = f"http://127.0.0.1:{port}/health"
    return [_Server("llama-server", Process(command, health, out / "llama-server.log"), port)]


def _run_levels(args: argparse.Namespace, servers: list[_Server], sends: list[list], out: Path) -> None:
    """Every level on every server, the report rewritten after each; the servers stop on every way out."""
    from forerun.bench.serve_load import request_lengths, running_order, write_report

    # Every server is up at once (idle ones cost memory, not time) and each level runs every set-up
    # back to back, so the ratios at a level are taken moments apart on this shared machine; the
    # order reverses from one level to the next (a drift in the machine's speed favours no set-up).
    levels = []
    try:
        for server in servers:
            server.process.start()
        for index, (c, sent) in enumerate(zip(args.concurrency, sends)):
            lengths = request_lengths(len(sent), args.max_tokens, args.length_spread, seed=c)
            for server in running_order(servers, index):
                levels.append(_run_level(server, args.model, sent, c, lengths))
                write_report(out, levels, _header(args))
    finally:
        for server in servers:
            server.process.stop()


def _run_level(server: _Server, model: str, sent: list, c: int, lengths: list[int]) -> LevelResult:
    """One level on one server, with forerun's draft counters over it; a line on stderr."""
    from forerun.bench.serve_load import run_level
    from forerun.bench.serve_servers import spec_counts

    url = f"http://127.0.0.1:{server.port}"
    counted = server.setup != "llama-server"  # forerun's servers: their draft counters
    before = spec_counts(url) if counted else None
    level = asyncio.run(run_level(url + "/v1", model, sent, c, lengths, setup=server.setup))
    if counted:
        after = spec_counts(url)
        level.draft_tokens, level.accepted_tokens = (after[k] - before[k] for k in ("draft_tokens", "accepted_tokens"))
    print(
        f"forerun: {server.setup} c={c}: {level.tokens_per_s:.1f} tok/s, TTFT p50 {level.ttft_p50_s * 1000:.0f} ms"
        f", failed {level.failures}" + (f" ({level.errors[0]})" if level.errors else ""),
        file=sys.stderr,
        flush=True,
    )
    return level


def _header(args: argparse.Namespace) -> str:
    from forerun.bench.machine import cpu_line

    shown = " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench-serve"] else "bench-serve"
    return (
        f"# forerun bench-serve\n\nMade with `forerun {shown}` on "
        f"{datetime.now(UTC):%Y-%m-%d}. {cpu_line()}. Greedy, max tokens {_lengths(args)}, "
        f"{args.requests_per_level} x c requests per level, at most c in flight"
        f"{', no prompt sent twice' if args.distinct else ''}; streamed completions "
        "with prompt token ids (the chat template applied). The set-ups run one after another at each level, "
        "in the order given on the first level and reversed on every other one."
    )


def _lengths(args: argparse.Namespace) -> str:
    if args.length_spread == 0:
        return str(args.max_tokens)
    from forerun.bench.serve_load import shortest

    lengths = f"{shortest(args.max_tokens, args.length_spread)}-{args.max_tokens}"
    return f"{lengths} (drawn per request, the same on every server)"
