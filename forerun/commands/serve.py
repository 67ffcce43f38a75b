"""`forerun serve`: an OpenAI-compatible HTTP server (forerun/serve/app.py) over one engine.

The engine loop runs on the main thread (the one that loaded the model) and HTTP on a thread
beside it. SIGTERM or SIGINT drains: new requests get 503, waiting ones end at once with an error,
running ones have --shutdown-timeout seconds to finish before they are cut with an error event and
`[DONE]`; the process logs what it cut and exits 0. A second signal cuts at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from forerun.base.errors import ForerunError
from forerun.base.reasoning import PARSERS
from forerun.commands.common import add_model_args, add_spec_args, quantization_arg

if TYPE_CHECKING:
    from forerun.api import LLM
    from forerun.serve.metrics import ServerMetrics
    from forerun.serve.scheduler import Scheduler

HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's headers


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over OpenAI's HTTP API (completions, chat, streaming)")
    add_model_args(p, quantization="auto")
    add_spec_args(p, quantization="auto")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000)
    _add_access_args(g)
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="most tokens of prompt plus completion per request (default: the model's context)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=8,
        help="most sequences generated at once, all in one target pass per step (others wait)",
    )
    g.add_argument(
        "--max-waiting", type=int, default=256, help="requests let wait beyond the running ones; past it HTTP 503"
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="on SIGTERM / SIGINT, seconds running requests get to finish before they are cut",
    )
    _add_answer_args(g)
    g.add_argument(
        "--prefill-share",
        type=float,
        default=None,
        metavar="S",
        help="while requests decode, how much a waiting prompt's prefill may slow them: prompt rows "
        "costing S one-row passes carried in each step (gguf), else S seconds of prefill per second of "
        "steps (default 1.5; inf: each prompt whole before the next step)",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT,
        help="seconds a connection may take to send a request's headers before it is closed",
    )
    g.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds a request's body may take to arrive (then HTTP 408)"
    )
    _add_ray_args(p)
    p.set_defaults(func=run)


def _add_access_args(g: argparse._ArgumentGroup) -> None:
    """Flags for who may call and the names they call the model by."""
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health "
        "(default: $FORERUN_API_KEY)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name clients send (default: --model); more names are accepted too (a client's own model "
        "names, such as Claude Code's), each answer naming the one its request gave",
    )


def _add_answer_args(g: argparse._ArgumentGroup) -> None:
    """Flags that shape what a response holds beside the text."""
    g.add_argument(
        "--per-request-spec-decode-stats",
        default="none",
        choices=["none", "summary", "detailed"],
        help="each choice carries its speculation figures in vLLM's shape (detailed: per step too)",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=PARSERS,
        help="a thinking model's <think> reasoning goes to chat answers' reasoning_content, apart from "
        "content (vLLM's): qwen3 (reasoning where the answer opens with <think>) or deepseek_r1 (the "
        "answer starts inside it)",
    )


def _add_ray_args(p) -> None:
    g = p.add_argument_group("replicas under Ray Serve (docs/serving.md)")
    g.add_argument("--ray", action="store_true", help="run replicas of the engine under Ray Serve behind one endpoint")
    g.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (host:port, or auto); default: start a local one"
    )
    g.add_argument("--num-replicas", type=int, default=1, help="engine replicas (without autoscaling)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (with --max-replicas)")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas (with --min-replicas)")
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling: requests per replica Ray Serve scales toward (default: --max-num-seqs)",
    )
    g.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica, and its torch threads"
    )
    g.add_argument(
        "--routing",
        default="affinity",
        choices=["affinity", "p2c"],
        help="affinity: a request goes to the replica its prompt prefix (or X-Routing-Key) prefers; "
        "p2c: Ray Serve's power of two choices alone (the control)",
    )
    g.add_argument(
        "--routing-imbalance",
        type=int,
        default=1,
        help="a request goes to the replica its prompt prefers unless that one has this many more "
        "requests than the least loaded (then the power of two choices)",
    )
    g.add_argument(
        "--shared-answers-tokens",
        type=int,
        default=65536,
        help="tokens of finished answers shared by every replica's suffix memory (oldest out first; "
        "0: each replica remembers only its own)",
    )


def run(args: argparse.Namespace) -> int:
    """One engine behind the HTTP app (`forerun serve --ray` is forerun/cluster's, which cli.py hands
    the same flags: the cluster builds on this module's pieces, never the other way)."""
    from forerun.serve.app import create_app

    check(args)
    engine = start_engine(args)
    config = server_config(args, engine.llm.target.decoder.cfg.max_position)
    app = create_app(engine.llm, engine.scheduler, config, engine.metrics)
    server, http = _start_http(app, args)
    method = engine.llm.spec.method or "off"
    cache = str(engine.llm.target.decoder.cache_dtype).removeprefix("torch.")
    print(
        f"forerun: serving {config.served_model_name} on http://{args.host}:{args.port}/v1 "
        f"(format: {quantization_arg(args.quantization) or args.dtype}, KV cache: {cache}, speculation: {method})",
        file=sys.stderr,
        flush=True,
    )
    scheduler = engine.scheduler
    _on_signals(scheduler, args.shutdown_timeout)
    try:
        # The engine loop on this thread, the one that loaded the model (see Scheduler.run: a second
        # thread runs the same forward ~45 % slower).
        scheduler.run(keep_going=http.is_alive)
    finally:
        server.should_exit = True
        scheduler.stop()
        http.join(args.shutdown_timeout + 5)
    _report_shutdown(scheduler, args.shutdown_timeout)
    return 0


@dataclass
class ServedEngine:
    llm: LLM
    scheduler: Scheduler  # not yet running: the caller runs its loop (Scheduler.run or start)
    metrics: ServerMetrics


def start_engine(args: argparse.Namespace, chores: Callable[[], None] | None = None) -> ServedEngine:
    """The model, its batch of lanes (every drafter set up) and the scheduler over them, from the
    flags; `chores`: the scheduler's (Scheduler)."""
    from forerun.commands.generate import build_llm
    from forerun.engine.batch import BatchEngine
    from forerun.serve.metrics import ServerMetrics
    from forerun.serve.scheduler import PREFILL_SHARE, Scheduler

    llm = build_llm(args)
    batch = BatchEngine(llm.new_engine, args.max_num_seqs, engines=[llm.engine])
    batch.prepare()  # every lane's drafter set up before the first request
    share = PREFILL_SHARE if args.prefill_share is None else args.prefill_share
    scheduler = Scheduler(batch, args.max_waiting, prefill_share=share, chores=chores)
    return ServedEngine(llm, scheduler, ServerMetrics(batch))


def server_config(args: argparse.Namespace, context: int):
    """The app's options from the flags (--max-model-len checked against the model's `context`)."""
    from forerun.serve.state import ServerConfig

    names = args.served_model_name or [args.model]
    if not all(name.strip() for name in names):
        raise ForerunError(f"--served-model-name takes names that are not empty, got {names!r}")
    max_model_len = context if args.max_model_len is None else args.max_model_len
    if not 1 < max_model_len <= context:
        raise ForerunError(
            f"--max-model-len must be between 2 and the model's context ({context}), got {max_model_len}"
        )
    return ServerConfig(
        served_model_name=names[0],
        aliases=tuple(dict.fromkeys(names))[1:],
        max_model_len=max_model_len,
        api_key=args.api_key or os.environ.get("FORERUN_API_KEY") or None,
        body_timeout=args.body_timeout,
        speculative_model=args.speculative_model,
        spec_stats=args.per_request_spec_decode_stats,
        reasoning_parser=args.reasoning_parser,
        max_num_seqs=args.max_num_seqs,
        model_path=args.model,
        speculative_tokens=args.num_speculative_tokens if args.speculative_method or args.speculative_model else 0,
    )


def _report_shutdown(scheduler, grace: float) -> None:
    """What a drain did: the requests it cut, or that every running one finished."""
    if scheduler.cut:
        print(
            f"forerun: shut down; {len(scheduler.cut)} running request(s) cut at the end of the "
            f"{grace:g} s grace period (ids {', '.join(map(str, scheduler.cut))})",
            file=sys.stderr,
            flush=True,
        )
    elif scheduler.draining:
        print("forerun: shut down; every running request finished", file=sys.stderr, flush=True)


def check(args: argparse.Namespace) -> None:
    """A clear error for flags out of range, before anything loads."""
    if args.max_num_seqs < 1:
        raise ForerunError(f"--max-num-seqs must be at least 1, got {args.max_num_seqs}")
    if not 0 < args.port < 65536:
        raise ForerunError(f"--port must be between 1 and 65535, got {args.port}")
    if args.max_waiting < 0:
        raise ForerunError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.prefill_share is not None and not args.prefill_share > 0:
        raise ForerunError(f"--prefill-share must be above 0 (inf: whole prompts), got {args.prefill_share}")
    for name in ("shutdown_timeout", "header_timeout", "body_timeout"):
        if not getattr(args, name) >= 0:
            raise ForerunError(f"--{name.replace('_', '-')} must be >= 0 seconds, got {getattr(args, name)}")
    _check_ray(args)


def _check_ray(args: argparse.Namespace) -> None:
    ray_only = {
        "ray_address": None,
        "num_replicas": 1,
        "min_replicas": None,
        "max_replicas": None,
        "target_ongoing_requests": None,
    }
    if not args.ray:
        given = [name for name, default in ray_only.items() if getattr(args, name) != default]
        if given:
            raise ForerunError(f"--{given[0].replace('_', '-')} is for replicas: add --ray")
        return
    if args.num_replicas < 1:
        raise ForerunError(f"--num-replicas must be at least 1, got {args.num_replicas}")
    if not args.replica_cpus > 0:
        raise ForerunError(f"--replica-cpus must be above 0, got {args.replica_cpus}")
    if args.routing_imbalance < 0 or args.shared_answers_tokens < 0:
        raise ForerunError("--routing-imbalance and --shared-answers-tokens must be >= 0")


def _start_http(app, args: argparse.Namespace):
    """uvicorn on a thread of its own, returned once its port is bound (an error if it cannot be)."""
    import uvicorn

    from forerun.serve.http import TimedH11Protocol

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            http=TimedH11Protocol.with_timeout(args.header_timeout),
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )
    http = threading.Thread(target=server.run, name="forerun-http", daemon=True)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise ForerunError(
                f"could not serve on {args.host}:{args.port}: the port is taken or {args.host} is not an address "
                "of this machine (the line above says which); pick another --port or --host"
            )
        time.sleep(0.02)
    return server, http


def _on_signals(scheduler, grace: float) -> None:
    """SIGTERM and SIGINT drain the scheduler (a second one cuts at once)."""

    def drain(signum, frame) -> None:
        # A handler may run between any two bytecodes of the loop: it only assigns, and writes
        # straight to the file descriptor (a print could re-enter one the loop was in).
        name = signal.Signals(signum).name
        if scheduler.draining:
            os.write(2, f"forerun: {name} again: cutting the running requests now\n".encode())
            scheduler.drain(0)
            return
        os.write(
            2,
            f"forerun: {name}: taking no new requests; the running ones get up to {grace:g} s to "
            "finish, the waiting ones end now\n".encode(),
        )
        scheduler.drain(grace)

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
