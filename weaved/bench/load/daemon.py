"""The daemon under load: ``weave serve`` in its own process on a temporary socket and data directory,
and what it holds of the machine (resident memory, open descriptors) sampled while it serves."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

READY_S = 600.0  # loading, and on a cold cache compiling the kernels, on a busy host
STOP_S = 60.0


@dataclass
class Served:
    proc: subprocess.Popen
    socket: Path
    log: Path
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (seconds, RSS MB, open fds)

    def sample(self, since: float) -> None:
        p = psutil.Process(self.proc.pid)
        self.samples.append((time.monotonic() - since, p.memory_info().rss / 2**20, p.num_fds()))

    async def sample_every(self, seconds: float, since: float, end: float) -> None:
        while time.monotonic() < end and self.proc.poll() is None:
            self.sample(since)
            await asyncio.sleep(seconds)

    def cpu_s(self) -> float:
        """CPU seconds the daemon has used (every thread, user and system)."""
        return cpu_seconds(self.proc.pid)

    async def tokens(self, http: httpx.AsyncClient) -> dict[str, float]:
        """The daemon's own token counts since it started, summed over SLA classes, by kind (``prompt``,
        ``cached`` - prompt tokens served from a stored prefix or the session's KV -, ``completion``):
        from its /metrics, as each turn ends."""
        out: dict[str, float] = {}
        for family in text_string_to_metric_families((await http.get("/metrics")).text):
            for sample in family.samples:
                if sample.name == "weave_tokens_total":
                    kind = sample.labels["kind"]
                    out[kind] = out.get(kind, 0.0) + sample.value
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_S)
        return self.proc.returncode


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds process ``pid`` (None: this one) has used, every thread, user and system."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def start(model: Path, workdir: Path, *extra: str) -> Served:
    """``weave serve --model model`` (and ``extra`` arguments) with its socket and data under ``workdir``;
    returns once it answers (RuntimeError, with the end of its log, if it exits or does not answer in
    time)."""
    sock, log = workdir / "weave.sock", workdir / "serve.log"
    cmd = [sys.executable, "-m", "weaved.cli", "serve", "--model", str(model), "--socket", str(sock),
           "--data-dir", str(workdir / "data"), *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    served = Served(proc, sock, log)
    deadline = time.monotonic() + READY_S
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://weave", timeout=5) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                if c.get("/health").status_code == 200:
                    return served
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    served.stop()
    tail = "\n".join(log.read_text().splitlines()[-20:])
    raise RuntimeError(f"weave serve did not come up:\n{tail}")
