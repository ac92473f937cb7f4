"""One end-to-end replay on a tiny model with tiny parameters: the report's structure and internal
consistency (never wall-clock thresholds: this machine's speed is not what is tested)."""

from __future__ import annotations

import json

import pytest

from weaved.bench.agents.report import format_table
from weaved.bench.agents.scenario import ScenarioOptions, run_scenario
from weaved.bench.agents.workload import AgentWorkload

TINY = AgentWorkload(agents=2, duration_s=2.5, seed=3, start_context=48, max_context=192, tool_output=(8, 32),
                     agent_gen=(4, 8), heartbeat_s=0.4, checkins_per_min=60, exchanges=(1, 2), question=(4, 8),
                     answer=(4, 8), exchange_gap_s=(0.1, 0.2), batch_concurrency=1, batch_document=96,
                     batch_summary=8)


@pytest.mark.slow
def test_tiny_replay_report_is_consistent(tiny_llama, tmp_path):
    opts = ScenarioOptions(model=tiny_llama, workload=TINY, configs=("weave", "fifo"), threads=1, capacity=True,
                           capacity_duration_s=1.5, capacity_start=1, capacity_max_agents=2, capacity_max_runs=2,
                           data_root=tmp_path, spec_tokens=16, spec_reps=1)
    progress: list[str] = []
    report = run_scenario(opts, progress.append)
    json.dumps(report)  # JSON-able as --json prints it
    assert report["scenario"] == "agents" and list(report["configs"]) == ["weave", "fifo"]
    assert report["workload"]["agents"] == 2 and report["plan"]["checkins"] >= 1
    for c in report["configs"].values():
        assert "error" not in c, c
        s = c["summary"]
        classes = s["classes"]
        assert set(classes) == {"background", "interactive", "batch"}
        for k in classes.values():
            assert k["met"] + k["missed"] + k["unfinished"] == k["turns"]
            assert k["failed"] == k["rejected"] == 0
            judged = k["met"] + k["missed"]
            assert k["share_met"] == (round(k["met"] / judged, 4) if judged else None)
            if k["ttft_p50_ms"] is not None:
                assert 0 <= k["ttft_p50_ms"] <= k["ttft_p99_ms"]
        assert s["turns"] == sum(k["turns"] for k in classes.values())
        assert classes["background"]["turns"] >= TINY.agents and classes["batch"]["turns"] >= 1
        assert s["tokens_generated"] == sum(k["tokens_generated"] for k in classes.values()) > 0
        assert s["tokens_per_s"] == pytest.approx(s["tokens_generated"] / c["duration_s"], rel=0.01)
        assert c["duration_s"] >= TINY.duration_s
        # the engines generated at least what the replay saw before it closed the run
        assert sum(p["tokens_generated"] for p in c["pools_figures"]) >= s["tokens_generated"]
        assert isinstance(c["preemptions"], int) and c["preemptions"] >= 0
        assert c["migrations"] is None or {"count", "bytes", "seconds"} <= set(c["migrations"])
        assert c["kv"]["file_bytes"] > 0 and c["kv"]["sessions"] >= TINY.agents
        r = c["replay"]
        assert r["checkins_done"] <= r["checkins_started"] and r["demotions"] <= r["promotions"]
        assert c["pools"] == ["cpu"] or "gpu" in c["pools"]
    cap = report["capacity"]
    assert set(cap["by_config"]) == {"weave", "fifo"}
    for c in cap["by_config"].values():
        assert 1 <= len(c["runs"]) <= 2 and 0 <= c["capacity"] <= 2
        assert all(set(r["shares"]) == {"background", "interactive", "batch"} for r in c["runs"])
    rel = cap["relative_to_fifo"]
    assert rel["fifo"] in (1.0, None)
    spec = report["speculative"]
    assert "error" not in spec, spec
    for w in ("repetitive", "natural"):
        assert spec[w]["identical"] and spec[w]["tokens"] == 16 and spec[w]["plain_tps"] > 0
    text = format_table(report)
    assert "weave" in text and "fifo" in text and "capacity:" in text and "speculative decoding" in text
    if report["notice"]:
        assert report["notice"] in text
