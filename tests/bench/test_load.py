"""``weave bench --scenario load``: its figures from given outcomes, and its options on the command line.
(The load itself runs for minutes against a real daemon: a benchmark, not a test.)"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import generate_latest
from typer.testing import CliRunner

from weaved.bench.load import LoadOptions
from weaved.bench.load.clients import Outcome
from weaved.bench.load.daemon import Served
from weaved.bench.load.report import build, format_table
from weaved.metrics import Metrics


def test_figures_by_class_after_the_warm_up():
    outcomes = [
        Outcome("interactive", "sdk", True, "ok", start=1.0, ttft_s=9.0, latency_s=9.5, tokens=10),  # warm-up
        Outcome("interactive", "sdk", True, "ok", start=20.0, ttft_s=0.5, latency_s=2.0, tokens=64),
        Outcome("interactive", "httpx", True, "ok", start=21.0, ttft_s=3.0, latency_s=4.0, tokens=64),  # late
        Outcome("interactive", "httpx", False, "ok", start=22.0, latency_s=5.0, tokens=64),  # whole: by latency
        Outcome("interactive", "sdk", True, "cancelled", start=23.0, ttft_s=0.2, latency_s=0.3, tokens=3),
        Outcome("background", "sdk", False, "503", start=24.0, latency_s=0.01),
        Outcome("background", "httpx", False, "ok", start=25.0, latency_s=70.0, tokens=64),  # over 60 s
        Outcome("batch", "httpx", True, "error 500", start=26.0, latency_s=0.1),
    ]
    # (the last sample, after the clients drained, is the idle daemon: not the end of the measured span)
    samples = [(5.0, 300.0, 30), (15.0, 400.0, 40), (95.0, 410.0, 40), (112.0, 250.0, 20)]
    r = build(outcomes, samples, warmup_s=10.0, duration_s=110.0, batched_tps=10.0, clients=8)
    inter = r["classes"]["interactive"]
    assert inter["requests"] == 4 and inter["by_status"] == {"ok": 3, "cancelled": 1}
    assert inter["within_sla"] == pytest.approx(2 / 3) and inter["sla_or_503"] == pytest.approx(2 / 3)
    assert r["classes"]["background"]["sla_or_503"] == 0.5  # the 503 counts, the late answer does not
    assert r["errors"] == 1 and r["error_kinds"] == {"error 500": 1}
    assert r["tokens_per_s"] == pytest.approx((64 * 4 + 3) / 100.0) and r["vs_batched"] == pytest.approx(0.259)
    m = r["memory"]
    assert (m["rss_mb_start"], m["rss_mb_end"], m["fds_start"], m["fds_end"]) == (400.0, 410.0, 40, 40)
    text = format_table(r)
    assert "interactive" in text and "errors: {'error 500': 1}" in text and "+2.5%" in text


def test_what_the_engine_computed_counts_fed_prompt_tokens_and_generated_ones():
    r = build([], [], warmup_s=10.0, duration_s=110.0, batched_tps=100.0, clients=8,
              daemon_tokens={"prompt": 5000.0, "cached": 1000.0, "completion": 3000.0})
    e = r["engine"]
    assert (e["prompt_fed_per_s"], e["generated_per_s"], e["computed_per_s"]) == (40.0, 30.0, 70.0)
    assert e["vs_batched"] == pytest.approx(0.7)
    assert "40.0 prompt tokens fed + 30.0 generated (70% of the batched rate)" in format_table(r)
    assert build([], [], warmup_s=10.0, duration_s=110.0, batched_tps=None, clients=8)["engine"] is None


def test_the_cores_each_side_took_are_reported():
    r = build([], [], warmup_s=10.0, duration_s=110.0, batched_tps=100.0, clients=8,
              cores={"daemon": 1.7, "clients": 0.25, "idle": 0.05})
    assert r["cores"] == {"daemon": 1.7, "clients": 0.25, "idle": 0.05}
    assert "cores over the measured span: daemon 1.70, clients 0.25, idle 0.05" in format_table(r)
    assert "cores over" not in format_table(build([], [], warmup_s=10.0, duration_s=110.0, batched_tps=1.0,
                                                  clients=8))


def test_the_daemons_cpu_time_is_read_from_its_process():
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", "import time; t = time.process_time() + 0.2\n"
                             "while time.process_time() < t: pass\ntime.sleep(30)"])
    try:
        served = Served(proc, socket=None, log=None)
        for _ in range(100):  # until the child has burnt its 0.2 s (bounded: at most 10 s)
            if served.cpu_s() >= 0.2:
                break
            time.sleep(0.1)
        assert served.cpu_s() >= 0.2
    finally:
        proc.kill()
        proc.wait()


def test_the_daemons_token_counts_come_from_its_metrics():
    metrics = Metrics()
    metrics.observe_turn("interactive", "stop", 50, 10, 64)
    metrics.observe_turn("batch", "length", 30, 0, 16)
    text = generate_latest(metrics.registry).decode()  # the exposition /metrics serves

    async def go() -> dict:
        transport = httpx.MockTransport(lambda req: httpx.Response(200, text=text))
        async with httpx.AsyncClient(transport=transport, base_url="http://weave") as http:
            return await Served(proc=None, socket=None, log=None).tokens(http)

    assert asyncio.run(go()) == {"prompt": 80.0, "cached": 10.0, "completion": 80.0}


def test_options_are_checked():
    with pytest.raises(ValueError, match="warm-up"):
        LoadOptions(model="m.gguf", threads=2, duration_s=30, warmup_s=60)
    quick = LoadOptions.quick("m.gguf", 2)
    assert (quick.clients, quick.duration_s, quick.warmup_s) == (16, 60.0, 15.0)


def test_the_scenario_on_the_command_line(smollm2_q4_0):
    import typer
    from weaved.cli import bench

    seen = []

    def fake(opts):
        seen.append(opts)
        return {"clients": opts.clients, "duration_s": opts.duration_s, "warmup_s": opts.warmup_s, "classes": {},
                "errors": 0, "error_kinds": {}, "tokens_per_s": 1.0, "batched_tps": None, "vs_batched": None,
                "memory": None, "samples": []}

    app = typer.Typer()
    bench.register(app, run_load=fake)
    runner = CliRunner()
    res = runner.invoke(app, ["--scenario", "load", "--clients", "8", "--duration", "100", "--json"])
    assert res.exit_code == 0, res.output
    assert (seen[0].clients, seen[0].duration_s, seen[0].warmup_s) == (8, 100.0, 25.0)
    assert json.loads(res.stdout)["clients"] == 8
    res = runner.invoke(app, ["--scenario", "load", "--quick"])
    assert res.exit_code == 0 and (seen[1].clients, seen[1].duration_s) == (16, 60.0)
    assert runner.invoke(app, ["--clients", "8"]).exit_code == 2  # --clients needs the load scenario
    assert runner.invoke(app, ["--scenario", "load", "--agents", "3"]).exit_code == 2
    # the daemon runs its profile's kernel threads: the yardstick uses those, and --threads is refused
    from weaved.config.load import load_profile

    assert seen[0].threads == load_profile().threads.kernels
    refused = runner.invoke(app, ["--scenario", "load", "--threads", "1"])
    assert refused.exit_code == 2 and "kernel" in refused.output
