"""`forerun serve --ray`'s control of its application: joining a cluster (the address checked, the
API key read in the command), the application's life there (refused where one runs, stoppable while
it deploys, removed with Serve at the end), the drain a second signal cuts, and the hub's answers
(/health when it is restarting, a gone replica's gauges).

The parts run without a cluster first, against stand-ins for Serve and the hub; the last test starts
a Ray head of its own (`ray start --head`) and joins it as the "More machines" recipe does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

ray = pytest.importorskip("ray", reason="make test installs ray[serve] (requirements.txt)")

from test_cluster import RAY_ENV, _free_port  # noqa: E402
from test_cluster import folder as folder  # noqa: E402, F401 - the module's tiny model folder

from forerun.base.errors import ForerunError  # noqa: E402

RAY = Path(sys.executable).parent / "ray"


def _serve_args(folder, *flags: str):
    from forerun.cli import build_parser

    return build_parser().parse_args(["serve", "--model", str(folder), "--ray", *flags])


def _call(value):
    """A stand-in for a deployment handle's method: `.remote(...).result(timeout_s=...)` gives `value()`."""
    return SimpleNamespace(remote=lambda *args: SimpleNamespace(result=lambda timeout_s: value(*args)))


# --- 1. the API key ---------------------------------------------------------------------------------


def test_the_api_key_from_the_commands_environment_reaches_the_ingress_as_an_argument(folder, monkeypatch) -> None:
    from forerun.cluster.app import application, build_app

    def ingress_options(app) -> dict:
        return app._bound_deployment.init_args[0]

    monkeypatch.setenv("FORERUN_API_KEY", "from-the-shell")
    assert ingress_options(application(_serve_args(folder)))["api_key"] == "from-the-shell"
    assert ingress_options(application(_serve_args(folder, "--api-key", "flag")))["api_key"] == "flag"
    assert ingress_options(build_app({"model": str(folder)}))["api_key"] == "from-the-shell"  # serve run's builder
    monkeypatch.delenv("FORERUN_API_KEY")
    assert ingress_options(application(_serve_args(folder)))["api_key"] is None


# --- 2. --ray-address failures ---------------------------------------------------------------------


def _closed_port() -> str:
    return f"127.0.0.1:{_free_port()}"


@pytest.mark.parametrize(
    ("address", "said"),
    [
        ("notahost", "not an address of the form host:port"),
        ("127.0.0.1:notaport", "not an address of the form host:port"),
        ("no-such-host.invalid:6379", "no such host no-such-host.invalid"),
        (None, "nothing listens on 127.0.0.1:"),  # a port nobody listens on: ray.init waits minutes
    ],
)
def test_an_address_where_no_cluster_answers_is_an_error_within_seconds(folder, address, said) -> None:
    from forerun.cluster.app import run_cluster

    address = address or _closed_port()
    began = time.monotonic()
    with pytest.raises(ForerunError, match="could not reach the Ray cluster at") as raised:
        run_cluster(_serve_args(folder, "--ray-address", address, "--port", str(_free_port())))
    assert time.monotonic() - began < 30
    assert said in str(raised.value) and "start one with `ray start --head`" in str(raised.value)


def test_auto_with_no_cluster_on_this_machine_is_an_error(folder, monkeypatch, tmp_path) -> None:
    import ray._private.services as services

    from forerun.cluster.app import run_cluster

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no ray_current_cluster file here
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])  # other tests' clusters are not ours
    began = time.monotonic()
    with pytest.raises(ForerunError, match=r"at auto \(no Ray cluster runs on this machine"):
        run_cluster(_serve_args(folder, "--ray-address", "auto", "--port", str(_free_port())))
    assert time.monotonic() - began < 30


def test_the_command_line_says_the_error_with_exit_code_2(folder, capsys) -> None:
    from forerun.cli import main

    port = str(_free_port())
    assert main(["serve", "--ray", "--model", str(folder), "--ray-address", _closed_port(), "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not reach the Ray cluster at 127.0.0.1:"), err
    assert "Traceback" not in err


def test_a_cluster_that_wants_a_token_says_how_to_give_it(folder, monkeypatch) -> None:
    import ray._raylet

    from forerun.cluster.app import run_cluster

    def refuses(address):
        raise ray.exceptions.AuthenticationError("RPC error: InvalidAuthToken: Authentication token is missing")

    monkeypatch.setattr(ray._raylet, "GcsClient", refuses)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with socket.socket() as listening:  # the port answers; the cluster behind it wants a token
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        args = _serve_args(folder, "--ray-address", f"127.0.0.1:{listening.getsockname()[1]}")
        args.port = _free_port()
        with pytest.raises(ForerunError, match="asks for a token and this client sent none") as raised:
            run_cluster(args)
        assert "RAY_AUTH_MODE=token" in str(raised.value) and "~/.ray/auth_token" in str(raised.value)
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        with pytest.raises(ForerunError, match="refused this client's token"):
            run_cluster(args)


# --- 4. one forerun application per cluster, removed with Serve at the end --------------------------


class _Serve:
    """A stand-in for `ray.serve`: its applications' statuses, and what was called."""

    def __init__(self, applications: dict) -> None:
        self.applications = applications
        self.calls: list[str] = []

    def status(self):
        return SimpleNamespace(applications=self.applications)

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        self.applications = {}

    def delete(self, name: str) -> None:
        self.calls.append(f"delete {name}")
        self.applications.pop(name, None)


def _serve_running_on(monkeypatch, host: str | None, port: int = 8000) -> None:
    import ray.serve.context

    client = None if host is None else SimpleNamespace(http_config=SimpleNamespace(host=host, port=port))
    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda **kwargs: client)


def test_a_cluster_already_running_a_forerun_application_is_refused(folder, monkeypatch) -> None:
    from forerun.cluster.lifecycle import check_free

    args = _serve_args(folder, "--port", "8000")
    _serve_running_on(monkeypatch, "127.0.0.1", 8000)
    with pytest.raises(ForerunError, match="already runs an application named forerun") as raised:
        check_free(_Serve({"forerun": None}), args, "10.0.0.1:6379")
    assert "serve.delete('forerun')" in str(raised.value) and "serve shutdown" in str(raised.value)
    with pytest.raises(ForerunError, match="its proxy on 127.0.0.1:8000 for other.*--port 8000"):
        check_free(_Serve({"other": None}), _serve_args(folder, "--port", "9000"), "10.0.0.1:6379")
    check_free(_Serve({"other": None}), args, "10.0.0.1:6379")  # Serve's proxy on our port: shared
    idle = _Serve({})
    check_free(idle, _serve_args(folder, "--port", "9000"), "10.0.0.1:6379")
    assert idle.calls == ["shutdown"]  # left by an earlier run: restarted on our port
    _serve_running_on(monkeypatch, None)
    check_free(_Serve({}), args, "10.0.0.1:6379")  # no Serve at all


def test_leaving_a_joined_cluster_removes_the_application_and_serve_once_none_is_left() -> None:
    from forerun.cluster.lifecycle import leave

    alone = _Serve({"forerun": None})
    leave(alone, joined=True, deployed=True)
    assert alone.calls == ["delete forerun", "shutdown"]
    shared = _Serve({"forerun": None, "other": None})
    leave(shared, joined=True, deployed=True)
    assert shared.calls == ["delete forerun"]
    refused = _Serve({"forerun": None})  # another run's application: not ours to remove
    leave(refused, joined=True, deployed=False)
    assert refused.calls == []
    local = _Serve({"forerun": None})
    leave(local, joined=False, deployed=True)
    assert local.calls == ["shutdown"]


# --- 5. a deployment that is never ready -------------------------------------------------------------


class _Deploying(_Serve):
    """A Serve whose application deploys forever: a replica waiting for CPUs."""

    def __init__(self) -> None:
        waiting = SimpleNamespace(status=SimpleNamespace(value="UPDATING"), message="replicas waiting for CPUs")
        running = SimpleNamespace(status=SimpleNamespace(value="HEALTHY"), message="")
        app = SimpleNamespace(
            status=SimpleNamespace(value="DEPLOYING"),
            message="",
            deployments={"ForerunEngine": waiting, "ForerunHub": running},
        )
        super().__init__({"forerun": app})
        self.RunTarget = lambda app, name, route_prefix: (app, name)

    def run_many(self, targets, wait_for_applications_running: bool) -> None:
        assert wait_for_applications_running is False  # the wait is ours, stopped by a signal
        self.calls.append("run_many")


def test_a_signal_stops_a_deployment_that_is_never_ready_and_says_why_it_waits(monkeypatch, capsys) -> None:
    from forerun.cluster import lifecycle

    monkeypatch.setattr(lifecycle, "SLOW_DEPLOY_S", 0.3)
    monkeypatch.setattr(lifecycle, "DEPLOY_POLL_S", 0.05)
    serve, stop = _Deploying(), threading.Event()
    threading.Timer(1.0, stop.set).start()  # SIGTERM, a second into the wait
    began = time.monotonic()
    assert lifecycle.deploy(serve, "app", stop) is False
    assert time.monotonic() - began < 5
    err = capsys.readouterr().err
    assert err.count("not serving yet") == 1, err
    assert "ForerunEngine UPDATING: replicas waiting for CPUs" in err and "ForerunHub" not in err


# --- 6. a second signal -------------------------------------------------------------------------------


class _Hub:
    """A stand-in for the hub's handle: replicas busy until told to cut (`drain(0)`), then idle
    after `cut_after` looks."""

    def __init__(self, cut_after: int | None) -> None:
        self.graces: list[float] = []
        self.looks_since_cut = 0
        self.cut_after = cut_after
        self.drain = _call(self.graces.append)
        self.busy = _call(self._busy)

    def _busy(self) -> int:
        if 0.0 in self.graces:
            self.looks_since_cut += 1
            return int(self.cut_after is None or self.looks_since_cut <= self.cut_after)
        return 1


def _drain_with_a_second_signal(hub: _Hub) -> float:
    from forerun.cluster.lifecycle import drain

    serve = SimpleNamespace(get_deployment_handle=lambda name, app_name: hub)
    cut = threading.Event()
    threading.Timer(0.5, cut.set).start()  # the second signal, half a second into a 60-second grace
    began = time.monotonic()
    drain(serve, 60.0, cut)
    return time.monotonic() - began


def test_a_second_signal_tells_the_replicas_to_cut_and_waits_for_their_cut_events() -> None:
    hub = _Hub(cut_after=3)
    took = _drain_with_a_second_signal(hub)
    assert hub.graces == [60.0, 0.0]
    assert hub.looks_since_cut == 4  # waited until none was busy
    assert took < 3


def test_a_second_signal_waits_at_most_a_few_seconds_for_replicas_that_stay_busy() -> None:
    from forerun.cluster.lifecycle import CUT_WAIT_S, RELAY_S

    took = _drain_with_a_second_signal(_Hub(cut_after=None))
    assert CUT_WAIT_S <= took < 0.5 + CUT_WAIT_S + RELAY_S + 1.5


def test_a_replica_cuts_when_it_hears_a_shorter_grace_and_not_again_for_the_same() -> None:
    from forerun.cluster.replica import EngineReplica

    drains: list[float] = []
    replica = EngineReplica.__new__(EngineReplica)  # no engine: only what it does with the hub's word
    replica.grace = None
    replica.engine = SimpleNamespace(scheduler=SimpleNamespace(drain=drains.append, stop=lambda: None))
    for grace in (None, 30.0, 30.0, 0.0, 0.0):
        replica.hear(grace)
    assert drains == [30.0, 0.0]


def test_the_hub_takes_a_second_shorter_drain() -> None:
    from forerun.cluster.hub import Hub

    hub = Hub(max_tokens=10)
    asyncio.run(hub.drain(30.0))
    assert asyncio.run(hub.report("r1", "", 1, True)) == 30.0
    asyncio.run(hub.drain(0.0))
    assert asyncio.run(hub.report("r1", "", 1, True)) == 0.0


# --- 7. a gone replica's gauges ------------------------------------------------------------------------


def test_a_silent_replicas_gauges_leave_metrics_within_seconds_and_its_counters_stay(monkeypatch) -> None:
    import forerun.cluster.hub as hub_module
    from forerun.cluster.metrics import IngressMetrics

    text = (
        "# HELP forerun:num_requests_running Requests being generated\n"
        "# TYPE forerun:num_requests_running gauge\n"
        "forerun:num_requests_running 3.0\n"
        "# HELP forerun:request_success_total Finished requests\n"
        "# TYPE forerun:request_success_total counter\n"
        'forerun:request_success_total{finished_reason="stop"} 7.0\n'
        "# HELP forerun:time_to_first_token_seconds Time to first token\n"
        "# TYPE forerun:time_to_first_token_seconds histogram\n"
        'forerun:time_to_first_token_seconds_bucket{le="+Inf"} 7.0\n'
        "forerun:time_to_first_token_seconds_count 7.0\n"
    )
    clock = [100.0]
    monkeypatch.setattr(hub_module.time, "monotonic", lambda: clock[0])
    hub = hub_module.Hub(max_tokens=10)
    asyncio.run(hub.report("gone", text, 3))

    def shown() -> str:
        return IngressMetrics().merged(asyncio.run(hub.collected()))[0].decode()

    assert 'forerun:num_requests_running{replica="gone"} 3.0' in shown()
    clock[0] += 10.0  # ten reports missed: the replica is gone
    now = shown()
    assert 'forerun:num_requests_running{replica="gone"}' not in now
    assert 'forerun:request_success_total{finished_reason="stop",replica="gone"} 7.0' in now
    assert 'forerun:time_to_first_token_seconds_count{replica="gone"} 7.0' in now
    clock[0] += 120.0
    assert 'replica="gone"' not in shown()


# --- 8. /health while the hub restarts -----------------------------------------------------------------


def test_health_answers_503_within_seconds_when_the_hub_does_not_answer() -> None:
    from forerun.cluster.ingress import ReplicaBackend
    from forerun.cluster.metrics import IngressMetrics

    class Silent:  # a hub call that never comes back (the hub being restarted)
        def remote(self, *args):
            return asyncio.get_running_loop().create_future()

    hub = SimpleNamespace(live=Silent(), stopping=Silent(), collected=Silent())
    backend = ReplicaBackend(None, IngressMetrics(), hub)
    began = time.monotonic()
    status, body = asyncio.run(backend.health())
    assert status == 503 and body["status"] == "replica state unknown" and "did not answer" in body["detail"]
    assert time.monotonic() - began < 3.5  # the hub's restart takes 7 to 13 s
    began = time.monotonic()
    text, _ = asyncio.run(backend.metrics())  # the ingress's own series, without waiting on the hub
    assert b'replica="ingress"' in text and time.monotonic() - began < 3.5


# --- against a cluster of its own, joined with --ray-address ------------------------------------------


@contextlib.contextmanager
def _ray_head() -> Iterator[str]:
    """`ray start --head --block` on a free port with 2 CPUs (no token: RAY_ENV), its files in a
    folder of its own; stopped by its pid at the end (`ray stop` would stop every cluster here)."""
    folder = tempfile.mkdtemp(prefix="fr-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    port = _free_port()
    command = [str(RAY), "start", "--head", "--block", "--port", str(port), "--num-cpus", "2"]
    command += ["--temp-dir", folder, "--include-dashboard", "false", "--disable-usage-stats"]
    head = subprocess.Popen(command, env={**os.environ, **RAY_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _answers(address):
            assert head.poll() is None and time.monotonic() < deadline, head.stderr.read().decode()[-3000:]
            time.sleep(0.5)
        time.sleep(3)  # its raylet registering
        yield address
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(folder, ignore_errors=True)


def _answers(address: str) -> bool:
    host, port = address.split(":")
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
        return True
    return False


class _Joined:
    """`forerun serve --ray --ray-address ADDRESS` on the tiny model, its stderr kept."""

    def __init__(self, folder: Path, address: str, *flags: str, env: dict | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "forerun.cli", "serve", "--ray", "--ray-address", address]
        command += ["--model", str(folder), "--dtype", "float32", "--quantization", "none"]
        command += ["--served-model-name", "tiny", "--replica-cpus", "1", "--port", str(self.port), *flags]
        full_env = {**os.environ, **RAY_ENV, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=full_env)
        self.log: list[str] = []
        self.reader = threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True)
        self.reader.start()

    def said(self, pattern: str, seconds: float) -> str:
        """The first line of its stderr matching `pattern`, waited for up to `seconds` (or its end)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.reader.is_alive():
            if found := [line for line in list(self.log) if re.search(pattern, line)]:
                return found[0]
            time.sleep(0.2)
        self.reader.join(5)
        found = [line for line in self.log if re.search(pattern, line)]
        assert found, f"never said {pattern!r}:\n" + "".join(self.log[-30:])
        return found[0]

    def signal(self, count: int = 1) -> None:
        for _ in range(count):
            self.process.send_signal(signal.SIGTERM)
            time.sleep(1.0)

    def exit_code(self, seconds: float) -> int:
        try:
            return self.process.wait(seconds)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


def _long_stream(url: str, headers: dict, out: dict) -> None:
    body = {"model": "tiny", "prompt": "cut by a second signal", "stream": True, "max_tokens": 900, "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
            out["lines"] = []
            for line in r.iter_lines():
                if line:
                    out["lines"].append(line)
    except httpx.HTTPError as exc:
        out["error"] = type(exc).__name__


def test_a_joined_cluster_keeps_the_key_one_forerun_at_a_time_its_port_and_stops_on_signals(folder) -> None:
    key = {"FORERUN_API_KEY": "from-the-shell"}
    with _ray_head() as address:
        first = _Joined(folder, address, "--num-replicas", "1", "--shutdown-timeout", "120", env=key)
        try:
            first.said("serving tiny on", 240)
            assert httpx.get(first.url + "/v1/models", timeout=30).status_code == 401  # the shell's key holds
            auth = {"Authorization": "Bearer from-the-shell"}
            assert httpx.get(first.url + "/v1/models", headers=auth, timeout=30).status_code == 200

            second = _Joined(folder, address, "--num-replicas", "1")
            assert second.exit_code(120) == 2
            assert "already runs an application named forerun" in second.said("^error:", 1)
            assert httpx.get(first.url + "/health", timeout=30).json()["status"] == "ok"  # left running

            out: dict = {}
            streaming = threading.Thread(target=_long_stream, args=(first.url, auth, out))
            streaming.start()
            deadline = time.monotonic() + 60
            while len(out.get("lines", [])) < 3:
                assert time.monotonic() < deadline and "error" not in out, out
                time.sleep(0.05)
            first.signal(2)  # a 120-second grace, cut by the second signal
            streaming.join(60)
            assert first.exit_code(60) == 0, "".join(first.log[-30:])
        finally:
            first.kill()
        assert out["lines"][-1] == "data: [DONE]", out
        ended = json.loads(out["lines"][-2].removeprefix("data: "))
        assert ended["error"]["code"] == "shutting_down", out["lines"][-2:]

        # Three replicas of one CPU on a 2-CPU cluster: never ready; a signal stops the deployment.
        never = _Joined(folder, address, "--num-replicas", "3")
        time.sleep(20)
        never.signal()
        assert never.exit_code(60) == 0, "".join(never.log[-30:])
        never.said("stopped before the application was ready", 1)

        # The application removed and Serve shut down: the next run deploys on its own port.
        last = _Joined(folder, address, "--num-replicas", "1")
        try:
            last.said(rf"serving tiny on http://127.0.0.1:{last.port}/v1", 240)
            assert httpx.get(last.url + "/health", timeout=30).status_code == 200
            last.signal()
            assert last.exit_code(60) == 0
        finally:
            last.kill()
