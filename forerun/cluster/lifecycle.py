"""The application's life on a Ray cluster, for `forerun serve --ray` (forerun/cluster/app.py):
checked that it may go there, deployed and waited for, drained on a signal, removed at the end.

The wait for the deployment runs on the main thread, a signal ending it: replicas asking for more
CPUs than a joined cluster has are never placed, and Serve would wait for them forever; after
SLOW_DEPLOY_S the command says which deployments are not running and why (a joined cluster's logs
do not reach this terminal). On a joined cluster the application is removed at the end, and Serve
too once no application is left there: Serve's proxy keeps the --host/--port it started with, so
the next run's would otherwise be ignored.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time

from forerun.base.errors import ForerunError

APP_NAME = "forerun"
DEPLOY_POLL_S = 0.5  # seconds between looks at the application's status while it deploys
SLOW_DEPLOY_S = 60.0  # not running after this long: say which deployments wait, and why
DRAIN_MARGIN_S = 5.0  # past the grace: every replica hearing of the drain, the last events relayed
CUT_WAIT_S = 3.0  # a second signal: at most this long for the replicas to send their cut events
RELAY_S = 0.5  # the replicas idle: their last events on their way through the ingress and the proxy
HUB_CALL_S = 10.0  # a call to the hub while stopping


def say(line: str) -> None:
    print(f"forerun: {line}", file=sys.stderr, flush=True)


def check_free(serve, args: argparse.Namespace, where: str) -> None:
    """Refuse a cluster where an application named forerun already runs (another `forerun serve
    --ray`, or one killed before it removed its own), or where Serve's proxy, serving other
    applications, listens elsewhere than --host/--port. Serve left running with no application
    (by an earlier run) is shut down, so that ours starts on --host/--port."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return
    applications = serve.status().applications
    if APP_NAME in applications:
        raise ForerunError(
            f"the Ray cluster at {where} already runs an application named {APP_NAME}: another `forerun serve "
            "--ray` is serving from it, or one was killed before it could remove its application. Stop that one, "
            f"or remove the application: `python -c \"import ray; from ray import serve; ray.init(address='{where}'); "
            f"serve.delete('{APP_NAME}')\"` (with RAY_AUTH_MODE=token where the cluster asks for a token), or Serve "
            "with every application on the cluster: `serve shutdown --address http://<head>:8265 --yes`"
        )
    http = client.http_config
    if (http.host, http.port) == (args.host, args.port):
        return
    if applications:
        raise ForerunError(
            f"Ray Serve already runs on the cluster at {where}, its proxy on {http.host}:{http.port} for "
            f"{', '.join(sorted(applications))}, and cannot move to {args.host}:{args.port} while it does: "
            f"run with --host {http.host} --port {http.port}, or stop those applications first"
        )
    say(f"Ray Serve ran on the cluster with no application, on {http.host}:{http.port}: restarting it")
    serve.shutdown()


def deploy(serve, app, stop: threading.Event) -> bool:
    """Deploy `app` and wait until it runs: True; False when `stop` came first (the caller removes
    what was deployed). A ForerunError when its replicas failed to start, with their reason."""
    serve.run_many([serve.RunTarget(app, name=APP_NAME, route_prefix="/")], wait_for_applications_running=False)
    began, told = time.monotonic(), False
    while not stop.wait(DEPLOY_POLL_S):
        status, message = _app_status(serve)
        if status == "RUNNING":
            from ray.serve.context import _get_global_client

            _get_global_client().wait_for_proxies_serving()  # their routes to it in place, as serve.run waits
            return True
        if status == "DEPLOY_FAILED":
            raise ForerunError(f"the replicas did not start: {why_not_started(serve) or message}")
        if not told and time.monotonic() - began >= SLOW_DEPLOY_S:
            say(f"not serving yet after {SLOW_DEPLOY_S:g} s ({not_running(serve)}); SIGTERM or Ctrl-C stops it")
            told = True
    return False


def _app_status(serve) -> tuple[str | None, str]:
    overview = serve.status().applications.get(APP_NAME)
    return (None, "") if overview is None else (str(overview.status.value), overview.message or "")


def not_running(serve) -> str:
    """The application's deployments that are not running, each with Serve's word on why."""
    try:
        deployments = serve.status().applications[APP_NAME].deployments
    except Exception as exc:  # noqa: BLE001 - Serve gave no status: say that
        return f"Serve gave no status: {type(exc).__name__}: {exc}"
    said = [
        f"{name} {d.status.value}" + (f": {' '.join(d.message.split())}" if d.message else "")
        for name, d in sorted(deployments.items())
        if d.status.value != "HEALTHY"
    ]
    return "; ".join(said) or "every deployment is running; the application is not yet"


def why_not_started(serve) -> str | None:
    """The last error named in the application's deployments' status (a replica's constructor's)."""
    try:
        deployments = serve.status().applications[APP_NAME].deployments.values()
    except Exception:  # noqa: BLE001 - no status to read: the caller says what Serve said
        return None
    for deployment in deployments:
        found = re.findall(r"(\w+(?:Error|Exception)): (.+)$", deployment.message or "", re.MULTILINE)
        if found:
            kind, message = found[-1]
            return message if kind == "ForerunError" else f"{kind}: {message}"
    return None


def drain(serve, grace: float, cut: threading.Event) -> None:
    """Stop as `forerun serve` does, while Serve's proxy still relays: every replica refuses new
    requests (503 shutting_down) and gives its running ones `grace` seconds, then cuts them with an
    error event; returns once none is busy (the hub hears each replica's state). A second signal
    (`cut`) tells the replicas to cut now, and gives them up to CUT_WAIT_S to send the cut events."""
    try:
        hub = serve.get_deployment_handle("ForerunHub", app_name=APP_NAME)
        hub.drain.remote(grace).result(timeout_s=HUB_CALL_S)
        deadline = time.monotonic() + grace + DRAIN_MARGIN_S
        while time.monotonic() < deadline and not cut.is_set() and _busy(hub):
            time.sleep(0.2)
        if cut.is_set():
            say("a second signal: cutting the running requests now")
            hub.drain.remote(0.0).result(timeout_s=HUB_CALL_S)
            deadline = time.monotonic() + CUT_WAIT_S
            while time.monotonic() < deadline and _busy(hub):
                time.sleep(0.1)
        time.sleep(RELAY_S)
    except Exception as exc:  # noqa: BLE001 - Serve's own shutdown ends the requests then
        say(f"could not drain the replicas ({type(exc).__name__}: {exc})")


def _busy(hub) -> int:
    return hub.busy.remote().result(timeout_s=HUB_CALL_S)


def leave(serve, joined: bool, deployed: bool) -> None:
    """Take off the cluster what this run put there: a local cluster's Serve whole; on a joined
    one the application (when `deployed`), then Serve once no application is left on it."""
    try:
        if not joined:
            serve.shutdown()
            return
        if deployed:
            serve.delete(APP_NAME)
        if not serve.status().applications:
            serve.shutdown()
    except Exception as exc:  # noqa: BLE001 - the cluster gone: nothing left to take off
        say(f"could not remove the application from the cluster ({type(exc).__name__}: {exc})")
