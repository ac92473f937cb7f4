"""``weave bench --scenario ring``: the broadcast alternative computes what the ring computes, the
cost model's arithmetic, the command's wiring, and the report's structure on a tiny model with tiny
sizes (never its timings)."""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import typer
from typer.testing import CliRunner
from weaved.cli import bench as bench_cli

from weaved.bench.ring import RingBenchOptions
from weaved.bench.ring.cost_model import Rates, Shape, project
from weaved.bench.ring.report import format_table
from weaved.bench.ring.sizes import HeadGroup, transfer_s

SMOL = Shape(n_layers=30, n_kv_heads=3, heads_per_group=1, q_per_kv=3, head_dim=64, kv_bytes_per_token=23040)


# ---- sizes and the cost model -------------------------------------------------------------------

def test_message_sizes_follow_the_packet_layout():
    from weaved.federation.ring_rows import Packet

    hg = HeadGroup(rows=16, q_heads=3, kv_heads=1, head_dim=64)
    assert hg.packet_bytes == Packet(16, 3, 1, 64).buf.nbytes == 16 * 4 * (3 * 64 + 2 * 64 + 3 * 65)
    assert hg.tail_bytes == Packet(16, 3, 1, 64, with_qkv=False).buf.nbytes
    assert hg.query_bytes + hg.tail_bytes == hg.packet_bytes
    assert hg.flops(1000) == 4 * 16 * 3 * 1000 * 64 and hg.kv_bytes(1000) == 16 * 1000 * 64 * 2 * 2
    assert transfer_s(1250, 10.0, 1e-6) == pytest.approx(2e-6)


def test_cost_model_arithmetic():
    rates = Rates(attend_s_per_row_key=1e-9, merge_s_per_row=1e-6, dense_fixed_s=0.05, dense_per_row_s=1e-3)
    one = project(SMOL, rates, agents=100, context=32768, n=1)
    attention = 30 * 3 * 100 * 32768 * 1e-9
    assert one["single_home"]["step_s"] == pytest.approx(0.05 + 0.1 + attention)
    assert one["single_home"]["exposed_transfer_s"] == 0 and one["every_node_home"]["link_s"] == 0
    assert one["broadcast_single_home"]["step_s"] == one["single_home"]["step_s"]
    assert one["kv_per_node_bytes"] == 100 * 32768 * 23040
    four = project(SMOL, rates, agents=100, context=32768, n=4)
    hg = four["head_group"]
    assert four["shard_keys"] == 8192 and hg["attend_s"] == pytest.approx(100 * 8192 * 1e-9)
    assert hg["margin"] == pytest.approx(hg["attend_s"] / hg["transfer_s"])
    assert four["single_home"]["tokens_per_s"] == pytest.approx(100 / four["single_home"]["step_s"])
    assert four["every_node_home"]["tokens_per_s_per_node"] * 4 == pytest.approx(
        four["every_node_home"]["tokens_per_s"])
    no_wire = project(SMOL, Rates(1e-9, 1e-6, 0.05, 1e-3, gbps=1e12, latency_s=0.0), 100, 32768, 4)
    assert no_wire["single_home"]["exposed_transfer_s"] == pytest.approx(0.0, abs=1e-9)
    # members in parallel: the home's own shard plus its merges, every layer (the wire is free)
    own = 100 * 8192 * 1e-9
    assert no_wire["broadcast_single_home"]["step_s"] == pytest.approx(0.15 + 30 * 3 * (own + 3 * 100 * 1e-6))
    slow = project(SMOL, Rates(1e-12, 0.0, 0.0, 1e-9, gbps=0.001), 100, 32768, 4)
    assert slow["every_node_home"]["bound"] == "link" and slow["head_group"]["margin"] < 1
    assert Rates.dense_line({16: 0.1, 100: 0.52}) == pytest.approx((0.02, 0.005))
    assert Rates.dense_line({8: 0.4}) == (0.0, 0.05)


# ---- the broadcast alternative against the ring ------------------------------------------------

@pytest.mark.federation
def test_broadcast_computes_what_the_ring_computes(tiny_llama):
    from weaved.backends.base import SeqChunk
    from weaved.backends.cpu import CPUBackend
    from weaved.bench.ring.broadcast import BroadcastMember
    from weaved.federation.comm import GroupSpec, PeerGroup, host_store
    from weaved.federation.layers import LayerRunner
    from weaved.federation.qring import RingChunk

    runner = LayerRunner(CPUBackend.from_file(tiny_llama, threads=1))
    cfg = runner.config
    store = host_store(timeout_s=30)
    with ThreadPoolExecutor(3) as ex:
        groups = [f.result(60) for f in [ex.submit(PeerGroup.form, GroupSpec("bcast", r, 3, port=store.port,
                                                                                    timeout_s=30),
                                                   store if r == 0 else None) for r in range(3)]]
    members = [BroadcastMember(g, cfg) for g in groups[1:]]
    threads = [threading.Thread(target=m.serve, daemon=True) for m in members]
    for t in threads:
        t.start()
    home = BroadcastMember(groups[0], cfg, runner)
    try:
        prompts = [[1, 504, 3458, 282, 4649, 314, 253], [1, 19556, 905, 30]]
        refs = []
        for sid, p in enumerate(prompts):
            kv = runner.backend.new_kv(32)
            runner.backend.forward([SeqChunk(kv, np.array(p, np.int32))])
            home.open_session(sid, 32, kv=kv.__class__(kv.data.copy(), kv.length))
            refs.append(kv)
        for tok in (7, 8, 9):
            got = home.step([RingChunk(s, np.array([tok], np.int32)) for s in range(len(prompts))])
            want = runner.backend.forward([SeqChunk(kv, np.array([tok], np.int32)) for kv in refs])
            for g, w in zip(got, want, strict=True):
                assert np.argmax(g) == np.argmax(w)
                assert np.abs(g - w).max() < 0.05 * max(1.0, float(np.abs(w).max()))
        # a member commits its rows after it has sent the step's last result: wait (bounded) for that
        deadline = time.monotonic() + 30
        while [m.shards.lengths for m in members] != [{0: 10, 1: 7}] * 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [m.shards.lengths for m in members] == [{0: 10, 1: 7}] * 2
    finally:
        home.stop()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)


# ---- the command ---------------------------------------------------------------------------------

FAKE_REPORT = {
    "scenario": "ring", "model": {"name": "m", "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                                  "kv_bytes_per_token": 256},
    "head_group": {"rows": 2, "q_heads": 2, "kv_heads": 1, "head_dim": 16, "packet_bytes": 784, "tail_bytes": 272,
                   "query_bytes": 512},
    "link": {"gbps": 10.0, "loopback_gbps": 3.0, "loopback_one_way_s": {"packet": 1e-4}},
    "margins": [{"context": 2048, "nodes": 1, "keys": 2048, "attend_s": 1e-3, "merge_s": 1e-5, "gflops_per_s": 1.0,
                 "kv_gb_per_s": 2.0, "transfer_10g_s": 1e-6, "transfer_loopback_s": 2e-6, "one_way_loopback_s": 1e-4,
                 "margin_10g": 1000.0, "margin_loopback": 500.0, "margin_loopback_one_way": 10.0}],
    "decode": [{"nodes": 2, "ring_step_s": 0.01, "broadcast_step_s": 0.012, "broadcast_over_ring": 1.2,
                "ring_home_wait_s": 0.001, "broadcast_home_wait_s": 0.002, "single_node_step_s": 0.005,
                "steps_s": {"ring": [0.01], "broadcast": [0.012], "single": [0.005]}}],
    "projection": None, "errors": [],
}


def _app(seen: list, report: dict = FAKE_REPORT):
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        pass

    def run_ring(opts):
        seen.append(opts)
        return report

    bench_cli.register(app, run=lambda cfg: pytest.fail("the llama scenario ran"),
                       run_agents=lambda o: pytest.fail("the agents scenario ran"), run_ring=run_ring)
    return app


@pytest.fixture
def model(tiny_llama):
    """A GGUF the engine runs as it is (so the command does not convert it; --model is checked from its
    header)."""
    return tiny_llama


def test_ring_options_and_output(model):
    seen: list[RingBenchOptions] = []
    res = CliRunner().invoke(_app(seen), ["bench", "--scenario", "ring", "--model", str(model), "--threads", "1",
                                          "--json"])
    assert res.exit_code == 0, res.output
    assert seen[0].threads == 1 and seen[0].worlds == (2, 3) and seen[0].model == model
    assert json.loads(res.stdout)["margins"][0]["margin_10g"] == 1000.0
    res = CliRunner().invoke(_app(seen), ["bench", "--scenario", "ring", "--model", str(model), "--quick"])
    assert res.exit_code == 0, res.output
    assert seen[-1].worlds == (2,) and seen[-1].reps < seen[0].reps
    assert "1000.0x" in res.stdout and "bcast/ring" in res.stdout


@pytest.mark.parametrize("args", [["--only", "prefill"], ["--agents", "3"]])
def test_ring_refuses_other_scenarios_options(model, args):
    seen: list = []
    res = CliRunner().invoke(_app(seen), ["bench", "--scenario", "ring", "--model", str(model), *args])
    assert res.exit_code == 2 and not seen


def test_a_failed_part_fails_the_command(model):
    res = CliRunner().invoke(_app([], {**FAKE_REPORT, "errors": ["loopback rank 1: PeerLost: gone"]}),
                             ["bench", "--scenario", "ring", "--model", str(model)])
    assert res.exit_code == 1 and "error: loopback rank 1: PeerLost: gone" in res.stdout


# ---- the real thing, tiny --------------------------------------------------------------------------

@pytest.mark.federation
@pytest.mark.slow
def test_ring_bench_report_structure_on_a_tiny_model(tiny_llama):
    from weaved.bench.ring.run import run_ring_bench

    opts = RingBenchOptions(model=tiny_llama, threads=1, rows=2, shards=((64, 1), (256, 2)), reps=2, pingpong_reps=3,
                            bulk_bytes=1 << 16, worlds=(2, 3), ring_sessions=2, ring_context=16, ring_steps=2,
                            agents=8, context=1024, dense_batches=(2, 4), timeout_s=120, deadline_s=600)
    said: list[str] = []
    report = run_ring_bench(opts, said.append)
    assert report["errors"] == [], report["errors"]
    assert [(m["context"], m["nodes"], m["keys"]) for m in report["margins"]] == [(64, 1, 64), (256, 2, 128)]
    for m in report["margins"]:
        for k in ("attend_s", "transfer_10g_s", "transfer_loopback_s", "one_way_loopback_s"):
            assert m[k] > 0 and math.isfinite(m[k]), (k, m)
        assert m["margin_10g"] == pytest.approx(m["attend_s"] / m["transfer_10g_s"])
    assert report["head_group"]["packet_bytes"] == HeadGroup(2, 2, 1, 16).packet_bytes
    assert report["link"]["loopback_gbps"] > 0
    assert [d["nodes"] for d in report["decode"]] == [2, 3]
    for d in report["decode"]:
        assert d["ring_step_s"] > 0 and d["broadcast_step_s"] > 0 and d["single_node_step_s"] > 0
        assert {k: len(v) for k, v in d["steps_s"].items()} == {"ring": 2, "broadcast": 2, "single": 2}
    rows = report["projection"]["rows"]
    assert [r["nodes"] for r in rows] == list(range(1, 9)) and set(report["dense_step_s"]) == {"2", "4"}
    text = format_table(report)
    assert "margin" in text and "projection: 8 agents at 1K context" in text
    assert json.loads(json.dumps(report)) == report
    assert any("loopback" in s for s in said)
