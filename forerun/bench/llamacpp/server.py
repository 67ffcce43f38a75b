"""One llama-server subprocess: started on a free loopback port, asked for completions, stopped."""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from forerun.base.errors import ForerunError
from forerun.bench.llamacpp import LlamaCppUnavailable
from forerun.bench.llamacpp.server_spec import ServerSpec

STARTUP_TIMEOUT_S = 300.0  # loading two GGUF files from a cold disk can take a while
REQUEST_TIMEOUT_S = 3600.0


def server_command(binary: Path, spec: ServerSpec, port: int) -> list[str]:
    """The whole command line of a llama-server for `spec`, listening on loopback at `port`."""
    return [str(binary), *spec.flags(), "--host", "127.0.0.1", "--port", str(port)]


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
        return server_command(self.binary, self.spec, self.port)

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
