"""``weave serve`` as a subprocess on a temporary socket and data directory, for end-to-end tests."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

READY_S = 240.0  # loading the model (and compiling kernels on a cold cache) on a busy 2-core host
STOP_S = 60.0


@dataclass
class ServeProc:
    proc: subprocess.Popen
    socket: Path
    data_dir: Path
    lines: list[str] = field(default_factory=list)
    tcp_url: str | None = None

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def terminate(self) -> int:
        """SIGTERM, then wait for the exit (SIGKILL if it hangs); the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_S)
        return self.proc.returncode


@contextmanager
def weave_serve(tmp: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[ServeProc]:
    sock, data = tmp / "weave.sock", tmp / "data"
    cmd = [sys.executable, "-m", "weaved.cli", "serve", "--socket", str(sock), "--data-dir", str(data), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    served = ServeProc(proc, sock, data)
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            served.lines.append(line.rstrip("\n"))
            if "ready on" in line:
                m = re.search(r"(http://\S+)", line)
                served.tcp_url = m.group(1) if m else None
                ready.set()
        ready.set()  # the process ended

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(READY_S) or proc.poll() is not None:
            raise AssertionError(f"weave serve did not become ready:\n{served.output}")
        yield served
    finally:
        served.terminate()
