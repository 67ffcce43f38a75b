"""`forerun serve --ray`: the Ray Serve application, and the command that starts it.

Three deployments (docs/serving.md draws them):
- ForerunIngress: `forerun serve`'s HTTP app on Serve's proxy (forerun/cluster/ingress.py), no model;
- ForerunEngine: N replicas, each one engine (forerun/cluster/replica.py), routed to by prompt
  affinity (forerun/cluster/router.py), scaled by Ray Serve's autoscaler when --min-replicas and
  --max-replicas are given;
- ForerunHub: one replica holding the shared answers and the replicas' metrics (forerun/cluster/hub.py).

`build_app` is the application builder for Ray's own `serve run` / `serve deploy` with a config
file (its `args` are `forerun serve`'s flags, underscores or dashes); `run_cluster` starts a local
Ray cluster or joins one (--ray-address: forerun/cluster/join.py checks the address first), runs
the application on --host/--port and waits for SIGTERM or SIGINT; forerun/cluster/lifecycle.py has
the steps (deploy, drain, remove).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import threading

from forerun.base.errors import ForerunError
from forerun.cluster import lifecycle
from forerun.cluster.join import join
from forerun.cluster.lifecycle import APP_NAME

RAY_INSTALL = "pip install 'ray[serve]==2.60.0'"


def _serve():
    """Ray Serve, or a clear error saying how to install it."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        from ray import serve
    except ImportError as exc:
        raise ForerunError(f"--ray needs Ray Serve, which is not installed here ({exc}): {RAY_INSTALL}") from None
    return serve


def application(args: argparse.Namespace):
    """The bound application for `args` (`forerun serve`'s flags, checked)."""
    serve = _serve()
    from ray.serve.config import RequestRouterConfig

    from forerun.cluster.hub import Hub
    from forerun.cluster.ingress import Ingress
    from forerun.cluster.replica import EngineReplica
    from forerun.cluster.router import AffinityRouter

    options = {k: v for k, v in vars(args).items() if k != "func"}
    # The key is read here, where the command (or `serve run`) runs: the ingress's Ray worker has
    # the environment of the `ray start` that started its node, not this one's.
    options["api_key"] = args.api_key or os.environ.get("FORERUN_API_KEY") or None
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    hub = serve.deployment(
        Hub, name="ForerunHub", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024
    ).options(logging_config=quiet)
    routing = {}  # p2c: Ray Serve's own router
    if args.routing == "affinity":
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class=AffinityRouter, request_router_kwargs={"imbalance": args.routing_imbalance}
        )
    engine = serve.deployment(EngineReplica, name="ForerunEngine").options(
        ray_actor_options={"num_cpus": args.replica_cpus},
        max_ongoing_requests=2 * args.max_num_seqs,  # a lane's worth waiting, the rest routed elsewhere
        graceful_shutdown_timeout_s=args.shutdown_timeout,
        logging_config=quiet,
        **routing,
        **_scaling(args),
    )
    ingress = serve.deployment(serve.ingress()(Ingress), name="ForerunIngress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096, logging_config=quiet
    )
    hub_app = hub.bind(args.shared_answers_tokens)
    return ingress.bind(options, engine.bind(options, hub_app), hub_app)


def check_replicas(args: argparse.Namespace) -> None:
    """A clear error for replica flags that do not go together, before Ray starts (`forerun serve`'s
    own `check` has the ranges of each)."""
    if not math.isfinite(args.replica_cpus):
        raise ForerunError(f"--replica-cpus must be a number of CPUs, got {args.replica_cpus}")
    if args.min_replicas is None and args.max_replicas is None:
        if args.target_ongoing_requests is not None:
            raise ForerunError("--target-ongoing-requests is for autoscaling: add --min-replicas and --max-replicas")
        return
    if args.num_replicas != 1:
        raise ForerunError(
            "--num-replicas is a fixed number of replicas: with autoscaling give --min-replicas and --max-replicas only"
        )
    if args.min_replicas is None or args.max_replicas is None or not 0 <= args.min_replicas <= args.max_replicas:
        raise ForerunError(
            "autoscaling needs both --min-replicas and --max-replicas, with 0 <= min <= max; "
            f"got {args.min_replicas} and {args.max_replicas}"
        )
    if args.max_replicas < 1:
        raise ForerunError(f"--max-replicas must be at least 1, got {args.max_replicas}")
    target = args.target_ongoing_requests
    if target is not None and not 0 < target < math.inf:
        raise ForerunError(f"--target-ongoing-requests must be above 0, got {target}")


def _scaling(args: argparse.Namespace) -> dict:
    """A fixed number of replicas, or Ray Serve's autoscaling between --min- and --max-replicas."""
    check_replicas(args)
    if args.min_replicas is None:
        return {"num_replicas": args.num_replicas}
    target = args.target_ongoing_requests or args.max_num_seqs
    return {
        "autoscaling_config": {
            "min_replicas": args.min_replicas,
            "max_replicas": args.max_replicas,
            "initial_replicas": max(args.min_replicas, 1),
            "target_ongoing_requests": target,
        }
    }


def build_app(config_args: dict):
    """Ray Serve's application builder: `import_path: forerun.cluster.app:build_app`, with `args`
    naming `forerun serve`'s flags (`model: ...`, `speculative_method: ...`, `num_replicas: 2`)."""
    from forerun.commands.serve import check, register

    parser = argparse.ArgumentParser(prog="forerun")
    register(parser.add_subparsers())
    argv = ["serve", "--ray"]
    for key, value in config_args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):  # a flag of several values (served_model_name: [a, b])
            argv += [flag, *map(str, value)]
        elif value not in (False, None):
            argv += [flag, str(value)]
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # argparse said what was wrong on stderr
        raise ForerunError(
            f"the application's args are not forerun serve's flags: {config_args} (see forerun serve --help)"
        ) from None
    check(args)
    check_replicas(args)
    return application(args)


def run_cluster(args: argparse.Namespace) -> int:
    """Start (or join) Ray, run the application on --host/--port, serve until SIGTERM or SIGINT."""
    from forerun.commands.serve import check

    check(args)
    serve = _serve()
    import ray

    check_replicas(args)
    _check_port_free(args.host, args.port)
    joined = args.ray_address is not None
    options = {"include_dashboard": False, "namespace": APP_NAME, "logging_level": "WARNING"}
    if joined:  # the replicas' logs stay on their machines: the command says what it must
        join(args.ray_address, **options, log_to_driver=False)
    else:
        ray.init(**options, log_to_driver=True)
    deployed = False
    try:
        if not joined:  # a cluster that may grow later is left to place the replicas when it can
            _check_cpus(args, ray.cluster_resources())
        where = ray.get_runtime_context().gcs_address
        lifecycle.check_free(serve, args, where)
        stop, again = _on_signals()
        serve.start(http_options={"host": args.host, "port": args.port})
        deployed = True
        if not lifecycle.deploy(serve, application(args), stop):
            lifecycle.say("stopped before the application was ready; removing it")
            return 0
        lifecycle.say(
            f"serving {(args.served_model_name or [args.model])[0]} on http://{args.host}:{args.port}/v1 "
            f"under Ray Serve ({_replicas_said(args)}; Ray cluster at {where})"
        )
        stop.wait()
        lifecycle.say(
            f"stopping the application: taking no new requests; the running ones get up to "
            f"{args.shutdown_timeout:g} s to finish"
        )
        lifecycle.drain(serve, args.shutdown_timeout, again)
    finally:
        lifecycle.leave(serve, joined, deployed)
        ray.shutdown()
    return 0


def _on_signals() -> tuple[threading.Event, threading.Event]:
    """SIGTERM and SIGINT: the first sets `stop` (drain), a second `again` (cut now)."""
    stop, again = threading.Event(), threading.Event()

    def on_signal(signum, frame) -> None:
        (again if stop.is_set() else stop).set()

    for name in (signal.SIGTERM, signal.SIGINT):
        signal.signal(name, on_signal)
    return stop, again


def _check_cpus(args: argparse.Namespace, resources: dict) -> None:
    """The replicas fit the local cluster's CPUs (else Ray Serve waits for CPUs that never come)."""
    replicas = args.num_replicas if args.min_replicas is None else max(args.min_replicas, 1)
    need, have = replicas * args.replica_cpus, resources.get("CPU", 0.0)
    if need > have + 1e-9:
        raise ForerunError(
            f"{replicas} replica{'s' if replicas != 1 else ''} x {args.replica_cpus:g} CPU each need {need:g} "
            f"CPUs and the local Ray cluster has {have:g}: ask for fewer (--num-replicas, --replica-cpus), "
            "or join a larger cluster with --ray-address"
        )


def _replicas_said(args: argparse.Namespace) -> str:
    if args.min_replicas is not None:
        return f"{args.min_replicas} to {args.max_replicas} replicas, autoscaled"
    return f"{args.num_replicas} replica{'s' if args.num_replicas != 1 else ''}"


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ForerunError(f"could not serve on {host}:{port} ({exc}); pick another --port") from None
