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
from forerun.base.files import make_folder
from forerun.commands.common import positive_int
from forerun.models.load import QUANTIZATIONS

if TYPE_CHECKING:
    from forerun.bench.serve_load import LevelResult
    from forerun.bench.serve_servers import Process

SETUPS = ("off", "fixed", "auto", "off-whole", "off-uncached")
LLAMA_PEER = "llama.cpp"  # the one --peers name: llama-server
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
    _add_server_args(p)
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
    p.add_argument(
        "--requests-per-level", type=positive_int, default=2, help="requests sent at level c: this many times c"
    )
    p.add_argument("--max-tokens", type=positive_int, default=64, help="the longest a request may be")
    p.add_argument(
        "--length-spread",
        type=float,
        default=0.5,
        help="requests' max tokens are spread evenly over [(1 - this) x --max-tokens, --max-tokens] in a "
        "shuffled order, the same for every server (0: every request --max-tokens long)",
    )
    p.add_argument("--peers", default="", help=f"{LLAMA_PEER}: llama-server with one slot per request in flight")
    p.add_argument("--dataset", default="spec-bench")
    p.add_argument("--categories", default=None, help="comma-separated categories or task kinds")
    p.add_argument(
        "--distinct",
        action="store_true",
        help="send no prompt twice in the run, so no request repeats an earlier one, and deal every "
        "level prompts as long on average as it can (an even sample over their lengths); "
        "needs --requests-per-level x the sum of the levels prompts",
    )
    p.add_argument(
        "--out",
        required=True,
        help="folder for results.json, report.md and server logs; a later run into it adds its set-ups "
        "beside the earlier ones' (a set-up run again replaces its own), made with the same settings",
    )
    p.set_defaults(func=run)


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """The model flags every forerun server gets, checked here rather than by the child server."""
    p.add_argument("--model", required=True, help="embedded name, .gguf file or model folder")
    formats = [*QUANTIZATIONS, "none"]  # as forerun serve takes them
    p.add_argument(
        "--quantization",
        default="auto",
        choices=formats,
        help="the target's numeric format (as forerun serve takes it)",
    )
    p.add_argument("--speculative-model", default=None, help="draft model for the fixed and auto set-ups")
    p.add_argument("--speculative-quantization", default="auto", choices=formats)
    p.add_argument("--draft-vocab", type=positive_int, default=None)
    p.add_argument("--num-speculative-tokens", type=positive_int, default=5, help="K: fixed K, and auto's most")


@dataclass
class _Server:
    setup: str  # its name in the report: off, fixed, auto#2, llama-server, ...
    process: Process
    port: int
    speculates: bool = False  # a forerun server with a draft model: its levels' settings name the draft's


def run(args: argparse.Namespace) -> int:
    from forerun.base.prompts import load_prompts, unread_fields
    from forerun.bench.serve_load import REPORT, RESULTS, earlier_levels, level_prompts, shortest
    from forerun.models.load import load_tokenizer_of

    setups = _check(args)
    shortest(args.max_tokens, args.length_spread)  # a spread out of range: a clear error now
    out = make_folder(Path(args.out), "--out", (RESULTS, REPORT), "bench-serve")
    earlier = earlier_levels(out, _settings(args, any(setup_serve(s)[0] is not None for s in setups)))
    tokenizer = load_tokenizer_of(args.model)  # the servers hold the model; this side only counts tokens
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    loaded = load_prompts(args.dataset, categories)
    unread_fields([vars(p) for p in loaded], "forerun bench-serve")
    prompts = [tokenizer.apply_chat([{"role": "user", "content": p.text}]) for p in loaded]
    if not prompts:
        raise ForerunError("no prompts to send")
    sends = level_prompts(prompts, [args.requests_per_level * c for c in args.concurrency], args.distinct)
    top = max(args.concurrency)
    context = max(len(p) for p in prompts) + args.max_tokens + args.num_speculative_tokens + 8
    servers = _forerun_servers(args, setups, top, out)
    if LLAMA_PEER in _peers(args.peers):
        servers += _llama_server(args.model, context, top, out)
    rerun = {server.setup for server in servers}  # a set-up run again replaces its earlier levels
    _run_levels(args, servers, sends, out, [level for level in earlier if level.setup not in rerun])
    return 0


def _check(args: argparse.Namespace) -> list[str]:
    """The set-ups asked for, once the flags are known to fit together (before anything loads)."""
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not setups:
        raise ForerunError(f"--setups {args.setups!r}: no set-ups given; name some of {', '.join(SETUPS)}")
    if any(setup_serve(s)[0] is not None for s in setups) and args.speculative_model is None:
        raise ForerunError("the fixed and auto set-ups draft with a model: give --speculative-model, or --setups off")
    _peers(args.peers)
    return setups


def _peers(text: str) -> list[str]:
    """--peers' names, each one known."""
    peers = [p.strip() for p in text.split(",") if p.strip()]
    for peer in peers:
        if peer != LLAMA_PEER:
            raise ForerunError(f"unknown peer {peer!r} in --peers; bench-serve's one peer is {LLAMA_PEER}")
    return peers


def _settings(args: argparse.Namespace, speculates: bool) -> dict:
    """What shapes a level's numbers (serve_load.run_settings); the draft model's part for a set-up
    that `speculates`."""
    from forerun.bench.serve_load import run_settings

    common = {
        name: getattr(args, name)
        for name in ("model", "quantization", "dataset", "categories", "concurrency", "requests_per_level")
        + ("max_tokens", "length_spread", "distinct")
    }
    draft = {
        name: getattr(args, name)
        for name in ("speculative_model", "speculative_quantization", "draft_vocab", "num_speculative_tokens")
    }
    return run_settings(common, draft if speculates else None)


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
        process = Process(command + flags, health, out / f"{setup}.log")
        servers.append(_Server(setup, process, port, speculates=policy is not None))
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


def _run_levels(
    args: argparse.Namespace, servers: list[_Server], sends: list[list], out: Path, earlier: list[LevelResult]
) -> None:
    """Every level on every server, the report rewritten after each (after `earlier`: the levels an
    earlier run left in --out, of set-ups not run now); the servers stop on every way out."""
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
                level = _run_level(server, args.model, sent, c, lengths)
                level.settings = _settings(args, server.speculates)
                levels.append(level)
                write_report(out, earlier + levels, _header(args, earlier))
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


def _header(args: argparse.Namespace, earlier: list[LevelResult]) -> str:
    from forerun.bench.machine import cpu_line

    shown = " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench-serve"] else "bench-serve"
    kept = ", ".join(dict.fromkeys(level.setup for level in earlier))
    return (
        f"# forerun bench-serve\n\nMade with `forerun {shown}` on "
        f"{datetime.now(UTC):%Y-%m-%d}. {cpu_line()}. Greedy, max tokens {_lengths(args)}, "
        f"{args.requests_per_level} x c requests per level, at most c in flight"
        f"{', no prompt sent twice' if args.distinct else ''}; streamed completions "
        "with prompt token ids (the chat template applied). The set-ups run one after another at each level, "
        "in the order given on the first level and reversed on every other one."
        + (
            f" The rows of {kept} come from an earlier run into this folder, with the same settings "
            "but not moments apart from the others."
            if kept
            else ""
        )
    )


def _lengths(args: argparse.Namespace) -> str:
    if args.length_spread == 0:
        return str(args.max_tokens)
    from forerun.bench.serve_load import shortest

    lengths = f"{shortest(args.max_tokens, args.length_spread)}-{args.max_tokens}"
    return f"{lengths} (drawn per request, the same on every server)"
