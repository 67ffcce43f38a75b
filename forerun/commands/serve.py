"""`forerun serve`: an OpenAI-compatible HTTP server (forerun/server.py) over one engine."""
from __future__ import annotations

import argparse
import os
import sys
import threading

from forerun.commands.common import add_model_args, add_spec_args
from forerun.errors import ForerunError


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over OpenAI's HTTP API (completions, chat, streaming)")
    add_model_args(p)
    add_spec_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $FORERUN_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens of prompt plus completion per request (default: the model's context)")
    g.add_argument("--max-num-seqs", type=int, default=8,
                   help="most sequences generated at once, all in one target pass per step (others wait)")
    g.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait; beyond it a request gets HTTP 503")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from forerun.batch import BatchEngine
    from forerun.commands.generate import build_llm
    from forerun.scheduler import Scheduler
    from forerun.server import ServerConfig, create_app
    from forerun.server_metrics import ServerMetrics

    if args.max_num_seqs < 1:
        raise ForerunError(f"--max-num-seqs must be at least 1, got {args.max_num_seqs}")
    if not 0 < args.port < 65536:
        raise ForerunError(f"--port must be between 1 and 65535, got {args.port}")
    if args.max_waiting < 0:
        raise ForerunError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    llm = build_llm(args)
    context = llm.target.decoder.cfg.max_position
    max_model_len = args.max_model_len or context
    if not 1 < max_model_len <= context:
        raise ForerunError(f"--max-model-len must be between 2 and the model's context ({context}), "
                           f"got {max_model_len}")
    config = ServerConfig(served_model_name=args.served_model_name or args.model, max_model_len=max_model_len,
                          api_key=args.api_key or os.environ.get("FORERUN_API_KEY") or None)
    batch = BatchEngine(llm.new_engine, args.max_num_seqs, engines=[llm.engine])
    batch.prepare()                                 # every lane's drafter set up before the first request
    metrics = ServerMetrics(batch)
    scheduler = Scheduler(batch, args.max_waiting)
    app = create_app(llm, scheduler, config, metrics)
    # HTTP on a thread of its own; the engine loop on this one, the thread that loaded the model
    # (see Scheduler.run: a second thread runs the same forward ~45 % slower).
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    http = threading.Thread(target=server.run, name="forerun-http", daemon=True)
    http.start()
    print(f"forerun: serving {config.served_model_name} on http://{args.host}:{args.port}/v1 "
          f"(speculation: {llm.spec.method or 'off'})", file=sys.stderr, flush=True)
    try:
        scheduler.run(keep_going=http.is_alive)
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        scheduler.stop()
        http.join(10)
    if not server.started:
        raise ForerunError(f"could not serve on {args.host}:{args.port} (is the port taken?); pick another --port")
    return 0
