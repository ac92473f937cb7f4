"""``weave bench --scenario agents``: options reach the scenario, the default scenario is unchanged."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner
from weaved.cli import bench as bench_cli

from weaved.bench.agents.cli import parse_configs
from weaved.bench.agents.configs import GpuSupport
from weaved.bench.agents.scenario import ScenarioOptions, run_scenario


def _fake_run(cfg, w):
    """A run's report without a daemon: every turn met, a little of everything."""
    cls = {"turns": 2, "met": 2, "missed": 0, "unfinished": 0, "failed": 0, "rejected": 0, "share_met": 1.0,
           "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "itl_p50_ms": 1.0, "itl_p99_ms": 2.0, "tokens_generated": 4}
    summary = {"classes": {c: dict(cls) for c in ("background", "interactive", "batch")}, "turns": 6,
               "tokens_generated": 12, "tokens_per_s": 12 / w.duration_s, "compactions": 0,
               "checkin_wait_p50_s": 0.0, "checkin_wait_p99_s": 0.0, "meets_sla": w.agents <= 5,
               "limiting_class": "background"}
    return {"agents": w.agents, "duration_s": w.duration_s, "pools": list(cfg.pools), "summary": summary,
            "pools_figures": [], "preemptions": 0, "tokens_prefilled": 0, "migrations": None,
            "migrations_source": None, "kv": {"file_bytes": 0, "ram_bytes": 0, "device_bytes": 0},
            "replay": {"promotions": 1, "demotions": 1, "checkins_started": 1, "checkins_done": 1,
                       "checkins_queued": 0, "batch_jobs_started": 1}, "errors": [], "pool_notes": []}


@pytest.fixture
def model(tiny_llama):
    """A GGUF the engine runs as it is (so the command does not convert it; --model is checked from its
    header)."""
    return tiny_llama


def _app(seen: list[ScenarioOptions]):
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        pass

    def run_agents(opts):
        seen.append(opts)
        return run_scenario(opts, gpu=GpuSupport(False, False), run=_fake_run)

    bench_cli.register(app, run=lambda cfg: pytest.fail("the llama scenario ran"), run_agents=run_agents)
    return app


def test_options_reach_the_scenario(model):
    seen: list[ScenarioOptions] = []
    args = ["bench", "--scenario", "agents", "--model", str(model), "--agents", "3", "--duration", "5", "--seed", "2",
            "--configs", "fifo, weave,fifo", "--threads", "1", "--no-capacity", "--json"]
    res = CliRunner().invoke(_app(seen), args)
    assert res.exit_code == 0, res.output
    (opts,) = seen
    assert (opts.workload.agents, opts.workload.duration_s, opts.workload.seed) == (3, 5.0, 2)
    assert opts.configs == ("fifo", "weave") and opts.threads == 1 and opts.capacity is False
    report = json.loads(res.stdout)
    assert report["scenario"] == "agents" and list(report["configs"]) == ["fifo", "weave"]
    assert report["capacity"] is None and "CPU pool" in report["notice"]


def test_quick_defaults_and_table(model):
    seen: list[ScenarioOptions] = []
    res = CliRunner().invoke(_app(seen), ["bench", "--scenario", "agents", "--model", str(model), "--quick"])
    assert res.exit_code == 0, res.output
    opts = seen[0]
    assert opts.capacity is False and opts.workload.duration_s == 60.0 and opts.workload.agents == 4
    assert opts.configs == ("weave", "weave-noprefix", "isolation", "fifo", "gpu-only")
    assert "gpu-only: not run" in res.stdout and "interactive" in res.stdout
    res = CliRunner().invoke(_app(seen), ["bench", "--scenario", "agents", "--model", str(model), "--quick",
                                          "--capacity", "--configs", "weave,fifo"])
    assert res.exit_code == 0, res.output
    assert seen[-1].capacity is True and "capacity:" in res.stdout and "x1.00 vs fifo" in res.stdout
    # the quick search's 30 s runs cannot judge a background turn that has not ended: the table says so
    assert seen[-1].capacity_duration_s == 30.0 and "shorter than the background budget, 60 s" in res.stdout
    res = CliRunner().invoke(_app(seen), ["bench", "--scenario", "agents", "--model", str(model), "--capacity",
                                          "--configs", "weave,fifo", "--agents", "2", "--duration", "5"])
    assert res.exit_code == 0, res.output
    assert seen[-1].capacity_duration_s == 90.0 and "shorter than the background budget" not in res.stdout


@pytest.mark.parametrize("args", [
    ["--agents", "3"], ["--configs", "weave"], ["--no-capacity"],  # agents options need --scenario agents
    ["--scenario", "agents", "--configs", "nope"], ["--scenario", "agents", "--only", "prefill"],
    ["--scenario", "nope"],
])
def test_bad_combinations_are_refused(model, args):
    seen: list[ScenarioOptions] = []
    res = CliRunner().invoke(_app(seen), ["bench", "--model", str(model), *args])
    assert res.exit_code == 2 and not seen


def test_parse_configs():
    assert parse_configs(None) is None
    assert parse_configs("gpu-only,weave") == ("gpu-only", "weave")
    with pytest.raises(ValueError):
        parse_configs(" , ")
