"""Joining a Ray cluster (`--ray-address`): the address checked before `ray.init`, and its failures
said in a line.

Unchecked, `ray.init` answers a malformed address or `auto` with no cluster with a traceback, an
address where nothing listens with a wait of many minutes, and a cluster that asks for a token
(Ray 2.60's `ray start` turns token authentication on; a client given an explicit address does
not send one unless RAY_AUTH_MODE=token) with a plain "Failed to connect" after 20 seconds. So: the
address is parsed, its port connected to within CONNECT_TIMEOUT_S, and the cluster's GCS asked
once (PROBE_TIMEOUT_S) whether it takes us, before `ray.init` runs.
"""

from __future__ import annotations

import os
import socket
import threading

from forerun.base.errors import ForerunError

CONNECT_TIMEOUT_S = 3.0  # a TCP connect to the cluster's port
PROBE_TIMEOUT_S = 10.0  # the cluster's GCS answering once its port is open
START_HINT = "start one with `ray start --head`, or leave --ray-address out for a local one"
TOKEN_PLACES = "~/.ray/auth_token, $RAY_AUTH_TOKEN or the file $RAY_AUTH_TOKEN_PATH names"


def unreachable(address: str, why: str) -> ForerunError:
    return ForerunError(f"could not reach the Ray cluster at {address} ({why}): {START_HINT}")


def join(address: str, **init_options) -> None:
    """`ray.init(address, **init_options)`, or a ForerunError saying why the cluster at `address`
    could not be joined."""
    import ray

    host_port = _host_port(address)
    _connect(address, host_port)
    if not address.startswith("ray://") and address != "auto":  # `auto` turns on the token by itself
        _probe(address, host_port)
    try:
        ray.init(address=address, **init_options)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise _said(address, exc) from None


def _host_port(address: str) -> tuple[str, int]:
    """The host and port `address` names (`auto`: the cluster `ray start` last started here)."""
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address_or_die

        try:
            address = canonicalize_bootstrap_address_or_die("auto")
        except (ConnectionError, ValueError) as exc:
            raise unreachable("auto", f"no Ray cluster runs on this machine: {exc}") from None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise unreachable(address, "not an address of the form host:port, such as 10.0.0.1:6379, or auto")
    return host.strip("[]"), int(port)


def _connect(address: str, host_port: tuple[str, int]) -> None:
    """A TCP connect to the cluster's port within CONNECT_TIMEOUT_S (ray.init waits minutes)."""
    host, port = host_port
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except socket.gaierror as exc:
        raise unreachable(address, f"no such host {host}: {exc.strerror}") from None
    except TimeoutError:
        raise unreachable(address, f"nothing answered on port {port} within {CONNECT_TIMEOUT_S:g} s") from None
    except OSError as exc:
        raise unreachable(address, f"nothing listens on {host}:{port}: {exc.strerror or exc}") from None


def _probe(address: str, host_port: tuple[str, int]) -> None:
    """Ask the cluster's GCS once whether it takes this client, on a thread (a port that is not a
    GCS keeps the call 40 s)."""
    try:
        from ray._raylet import GcsClient
    except ImportError:  # another Ray than the one pinned: ray.init says what goes wrong
        return
    host, port = host_port
    result: list[BaseException | None] = []
    answered = threading.Event()

    def ask() -> None:
        try:
            GcsClient(address=f"{host}:{port}")
            result.append(None)
        except BaseException as exc:  # noqa: BLE001 - judged below
            result.append(exc)
        answered.set()

    threading.Thread(target=ask, name="forerun-ray-probe", daemon=True).start()
    if not answered.wait(PROBE_TIMEOUT_S):
        raise unreachable(address, f"port {port} is open but no Ray cluster answered on it in {PROBE_TIMEOUT_S:g} s")
    if result[0] is not None:
        raise _said(address, result[0])


def _said(address: str, exc: BaseException) -> ForerunError:
    """ray.init's (or the probe's) failure as a line: a token refused, or the cluster unreachable."""
    chain, link = [], exc
    while link is not None:
        chain.append(f"{type(link).__name__}: {link}")
        link = link.__cause__ or link.__context__
    text = "\n".join(chain)
    if "AuthenticationError" in text or "InvalidAuthToken" in text or "Unauthenticated" in text:
        return _token_refused(address)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return unreachable(address, first)


def _token_refused(address: str) -> ForerunError:
    token = f"the cluster's token in {TOKEN_PLACES} (`ray get-auth-token` on its head prints it)"
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode != "token":  # Ray 2.60's `ray start` turns token authentication on
        return ForerunError(
            f"the Ray cluster at {address} asks for a token and this client sent none (RAY_AUTH_MODE is "
            f"{mode or 'unset'} here): run forerun with RAY_AUTH_MODE=token and {token}"
        )
    return ForerunError(f"the Ray cluster at {address} refused this client's token: give forerun {token}")
