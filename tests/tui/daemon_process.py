"""A real ``weave serve`` in a subprocess, on a temporary socket and data directory, for end-to-end
tests of the client commands and ``weave top``.  Waits are bounded; the daemon is stopped with SIGTERM
(then killed if it does not stop) and its directory removed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from weaved.cli.client import Client
from weaved.cli.errors import ClientError

READY_TIMEOUT_S = 300.0  # the first run may convert the default model and compile kernels
STOP_TIMEOUT_S = 30.0


@contextmanager
def running_daemon() -> Iterator[Path]:
    """Start ``weave serve --profile cpu-only``; yield its socket path once ``/health`` answers."""
    root = Path(tempfile.mkdtemp(prefix="wve", dir="/tmp"))  # short: a socket path must fit in 107 bytes
    sock, log = root / "w.sock", root / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("WEAVE_SOCKET", "WEAVE_API_KEY")}
    with open(log, "wb") as out:
        args = ["serve", "--profile", "cpu-only", "--socket", str(sock), "--data-dir", str(root / "data")]
        proc = subprocess.Popen([sys.executable, "-m", "weaved.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(proc, sock, log)
        yield sock
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
        shutil.rmtree(root, ignore_errors=True)


def _wait_ready(proc: subprocess.Popen, sock: Path, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weave serve exited ({proc.returncode}):\n{log.read_text(errors='replace')}")
        if sock.exists():
            try:
                if Client(sock).health().get("status") == "ok":
                    return
            except ClientError:
                pass
        time.sleep(0.2)
    raise TimeoutError(f"weave serve not ready in {READY_TIMEOUT_S:.0f} s:\n"
                       f"{log.read_text(errors='replace')}")


def wait_for(cond, timeout_s: float = 120.0, what: str = "") -> None:
    """Poll ``cond`` until it holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        time.sleep(0.1)
