"""Running the load: the engine's batched rate first (nothing else on the cores), then the daemon, the
clients and the sampler together until the end, then the report."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from weaved.bench.load import LoadOptions
from weaved.bench.load import daemon as served_daemon
from weaved.bench.load.clients import TIMEOUT_S, Client
from weaved.bench.load.report import build


def pool_batch() -> int:
    """The batch of the CPU pool ``weave serve`` will run here: its first standard CPU pool's
    ``max_batch`` in the profile it detects for this machine."""
    from weaved.config.load import load_profile

    pools = [p for p in load_profile().pools if p.backend == "cpu" and p.strategy == "standard"]
    return pools[0].max_batch if pools else 16


def batched_rate(opts: LoadOptions, say: Callable[[str], None]) -> tuple[float | None, int]:
    """Weave's CPU engine decoding a full batch of the daemon's CPU pool (16 or 64 sequences: the
    measured batch at or below the pool's), in its own process; returns (tokens/s, batch)."""
    from weaved.bench import BenchConfig
    from weaved.bench.harness import filler_tokens
    from weaved.bench.runner import measure_in_subprocess

    batch = 64 if pool_batch() >= 64 else 16
    key = f"batch{batch}_tps"
    # the median of three repetitions of 32 steps (a second or two): one short repetition swung by a third
    # from run to run on a shared host, and this rate is the run's yardstick
    cfg = BenchConfig(opts.model, opts.threads, (key,), rounds=1, reps=3)
    say(f"measuring the engine's batched rate ({batch} sequences)")
    try:
        return float(measure_in_subprocess("weave", cfg, filler_tokens(opts.model, cfg.tokens_needed))[key]), batch
    except Exception as exc:  # noqa: BLE001 - the load still runs; the ratio is then unknown
        say(f"the batched rate could not be measured: {exc}")
        return None, batch


async def _drive(opts: LoadOptions, served: served_daemon.Served, say: Callable[[str], None]) -> list:
    limits = httpx.Limits(max_connections=opts.clients * 2, max_keepalive_connections=opts.clients * 2)
    transport = httpx.AsyncHTTPTransport(uds=str(served.socket), limits=limits)
    async with httpx.AsyncClient(transport=transport, base_url="http://weave", timeout=TIMEOUT_S) as http:
        sdk = openai.AsyncOpenAI(base_url="http://weave/v1", api_key="load", http_client=http, max_retries=0,
                                 timeout=TIMEOUT_S)
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.monotonic()
        end = t0 + opts.duration_s
        clients = [Client(i, opts, http, sdk, model, t0) for i in range(opts.clients)]
        say(f"{opts.clients} clients for {opts.duration_s:.0f} s")

        async def counts_over_the_measured_span() -> tuple[dict[str, float], dict[str, float]]:
            await asyncio.sleep(opts.warmup_s)
            before, cpu0 = await served.tokens(http), _cpu_marks(served)
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            after, cpu1 = await served.tokens(http), _cpu_marks(served)
            wall = cpu1["wall"] - cpu0["wall"]
            cores = {k: (cpu1[k] - cpu0[k]) / wall for k in cpu0 if k != "wall"}
            return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}, cores

        (counted, cores), *_ = await asyncio.gather(
            counts_over_the_measured_span(), served.sample_every(opts.sample_s, t0, end),
            *(c.run(end) for c in clients))
        served.sample(t0)
    return [o for c in clients for o in c.outcomes], counted, cores


def _cpu_marks(served: served_daemon.Served) -> dict[str, float]:
    """CPU seconds so far: the daemon's, this process's (the clients and the sampler) and the machine's
    idle time, with the wall clock; differences over a span give each one's cores."""
    import psutil

    return {"wall": time.monotonic(), "daemon": served.cpu_s(), "clients": served_daemon.cpu_seconds(),
            "idle": psutil.cpu_times().idle}


def run_load(opts: LoadOptions, say: Callable[[str], None]) -> dict:
    batched, batch = batched_rate(opts, say)
    with tempfile.TemporaryDirectory(prefix="weave-load-") as tmp:
        say("starting weave serve")
        served = served_daemon.start(opts.model, Path(tmp))
        try:
            outcomes, counted, cores = asyncio.run(_drive(opts, served, say))
        finally:
            code = served.stop()
        report = build(outcomes, served.samples, warmup_s=opts.warmup_s, duration_s=opts.duration_s,
                       batched_tps=batched, clients=opts.clients, daemon_tokens=counted, cores=cores)
        report["daemon_exit"] = code
        report["batched_batch"] = batch
        log = served.log.read_text().splitlines()
        report["daemon_log_problems"] = [line for line in log if "Traceback" in line or "error" in line.lower()][:20]
    return report
