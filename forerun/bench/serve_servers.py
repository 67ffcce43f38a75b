"""The servers bench-serve loads: a server subprocess waited on until healthy, `forerun serve`'s command
line for a set-up, and the draft counters a forerun server reports."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from forerun.base.errors import ForerunError

STARTUP_TIMEOUT_S = 600.0


class Process:
    """A server subprocess; `start` waits until its /health answers 200."""

    def __init__(self, command: list[str], health_url: str, log: Path) -> None:
        self.command, self.health_url, self.log = command, health_url, log
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-3:])
                raise ForerunError(f"{Path(self.command[0]).name} exited while starting: {tail}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ForerunError(f"server not ready after {STARTUP_TIMEOUT_S:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def forerun_command(
    port: int,
    model: str,
    quantization: str | None,
    draft: str | None,
    draft_quantization: str | None,
    draft_vocab: int | None,
    k: int,
    policy: str | None,
    max_num_seqs: int,
) -> list[str]:
    """`forerun serve` for one set-up; `policy` None is speculation off."""
    command = [
        sys.executable,
        "-m",
        "forerun.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-waiting",
        "4096",
    ]
    if quantization:
        command += ["--quantization", quantization]
    if policy is not None and draft is not None:
        command += ["--speculative-model", draft, "--num-speculative-tokens", str(k), "--speculative-k-policy", policy]
        if draft_quantization:
            command += ["--speculative-quantization", draft_quantization]
        if draft_vocab:
            command += ["--draft-vocab", str(draft_vocab)]
    return command


SPEC_COUNTERS = {
    "draft_tokens": "forerun:spec_decode_num_draft_tokens",
    "accepted_tokens": "forerun:spec_decode_num_accepted_tokens",
}


def spec_counts(server_url: str) -> dict[str, int]:
    """Draft tokens proposed and kept so far, from a forerun server's /metrics (`server_url` without /v1)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server_url.rstrip("/") + "/metrics", timeout=30) as response:
        text = response.read().decode()
    totals = {
        family.name: sum(s.value for s in family.samples if s.name.endswith("_total"))
        for family in text_string_to_metric_families(text)
    }
    return {field: int(totals.get(name, 0)) for field, name in SPEC_COUNTERS.items()}
