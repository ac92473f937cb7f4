"""The capacity simulator: its backend and cost models, the engines stepped in virtual time, and the
daemon's own router, admission and moves running over them - deterministic, fast, and marked simulated."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from weaved.backends.base import Logits, SeqChunk
from weaved.bench.agents.configs import resolve
from weaved.bench.agents.workload import AgentWorkload
from weaved.calibration.cost import Linear, StepCost
from weaved.calibration.store import Calibration
from weaved.engine.engine import BatchEngine
from weaved.engine.sampling import SamplingParams
from weaved.engine.scheduler import SchedulerConfig
from weaved.engine.sequence import Sequence, SLARank
from weaved.sim.backend import TOKEN, DeviceFull, SimBackend
from weaved.sim.clock import VirtualClock
from weaved.sim.cost import Q4_0_BYTES_PER_WEIGHT, gpu_roofline, matrix_weights, scaled_cpu
from weaved.sim.hardware import HOSTS, L40S
from weaved.sim.scenario import SimSetup, run_simulated
from weaved.sim.shapes import layout, shape_config

COST = StepCost(Linear(0.01, 1e-3, 1e-7), Linear(0.005, 2e-3, 1e-6))
SMOL = shape_config("smollm2-135m")


def _backend(clock, **kw) -> SimBackend:
    return SimBackend("cpu", layout(SMOL), COST, clock, real_kv_bytes_per_token=SMOL.kv_bytes_per_token, **kw)


def test_a_step_takes_what_the_cost_model_says_and_computes_nothing():
    clock = VirtualClock()
    be = _backend(clock)
    a, b = be.new_kv(512), be.new_kv(512)
    b.length = 100
    out = be.forward([SeqChunk(a, np.arange(64, dtype=np.int32), Logits.ALL),
                      SeqChunk(b, np.array([5], np.int32), Logits.LAST)])
    assert clock.now() == pytest.approx(COST.step_s(64, 64 * 32, 1, 100))  # one fixed part for the mixed step
    assert (a.length, b.length) == (64, 101) and out[0].shape == (64, 1024) and int(np.argmax(out[1])) == TOKEN
    assert not a.data.any()  # no KV is written


def test_a_device_counts_its_kv_and_charges_promotions_at_the_link():
    clock = VirtualClock()
    be = _backend(clock, device_positions=1000, link_bw=1e9)
    kv = be.new_kv(2048)
    kv.length = 600
    assert be.adopt(kv) == 600 * be.config.kv_bytes_per_token
    assert clock.now() == pytest.approx(600 * SMOL.kv_bytes_per_token / 1e9)
    other = be.new_kv(2048)
    other.length = 500
    with pytest.raises(DeviceFull) as e:
        be.adopt(other)
    assert e.value.http_status == 503 and e.value.need_bytes == 100 * be.config.kv_bytes_per_token
    be.release(kv)
    assert be.adopt(other) > 0 and be.device_kv_free_bytes() == 500 * be.config.kv_bytes_per_token


def test_the_cost_models():
    big = shape_config("qwen3-32b")
    gpu = gpu_roofline(big, L40S)
    weights = matrix_weights(big) * Q4_0_BYTES_PER_WEIGHT
    assert gpu.decode.base == pytest.approx(L40S.launch_s * 64 + weights / L40S.mem_bw)
    assert gpu.decode.per_token_context == pytest.approx(big.kv_bytes_per_token / L40S.mem_bw)  # reading K/V
    assert 20 < gpu.decode_tokens_per_s(1, 1024) < 60  # ~25 ms a step: what an L40S gives a 32B Q4 model
    same = scaled_cpu(COST, SMOL, 2, SMOL, None)
    assert same == COST  # this host, the model it was measured on: as measured
    epyc = scaled_cpu(COST, SMOL, 2, big, HOSTS["l40s-epyc"].cpu)
    assert epyc.decode.base >= weights / HOSTS["l40s-epyc"].cpu.mem_bw  # never faster than reading the weights
    assert epyc.prefill.per_token > COST.prefill.per_token  # a 32B token costs more than 8.4x threads win back
    with pytest.raises(ValueError, match="mixture of experts; the simulator's cost model covers dense"):
        shape_config("qwen3-30b-a3b")


def test_engines_run_on_the_virtual_clock():
    clock = VirtualClock()
    be = _backend(clock)
    eng = BatchEngine("cpu", be, SchedulerConfig(token_budget=272, max_batch=4, prefill_chunk=256), clock=clock.now)
    events: list[tuple[float, dict]] = []
    seq = Sequence("s", be.new_kv(1024), list(range(10, 310)), SamplingParams(max_tokens=5, temperature=0,
                                                                             ignore_eos=True),
                   SLARank.BACKGROUND, arrival=clock.now(), emit=lambda ev: events.append((clock.now(), ev)))
    eng.submit(seq)
    for _ in range(20):
        if not eng.has_work():
            break
        eng.run_once()
    tokens = [t for t, ev in events if ev["type"] == "token"]
    assert len(tokens) == 5 and events[-1][1]["type"] == "done"
    first = COST.prefill_chunk_s(256, 0) + COST.prefill_chunk_s(44, 256)  # two prefill chunks
    assert tokens[0] == pytest.approx(first) and seq.first_token_at == pytest.approx(first)
    assert tokens[1] - tokens[0] == pytest.approx(COST.decode_step_s(1, 300))


@pytest.fixture(scope="module")
def setup(smollm2_q4_0):
    cal = Calibration(StepCost(Linear(0.004, 4e-4, 1e-6), Linear(0.005, 6e-4, 2.3e-6)), "fp", "cpu", "cpu", 2,
                      "vnni")
    return dataclasses.replace(SimSetup.named("l40s-epyc", "llama-3.1-8b", cal, SMOL, smollm2_q4_0), engine_time=False)


def test_a_simulated_run_uses_the_daemon_router_and_is_deterministic(setup):
    w = AgentWorkload(agents=6, duration_s=300.0, seed=3)
    cfg = resolve("weave", setup.gpu)
    assert cfg.pools == ("gpu", "cpu")  # the simulated host has a GPU
    one, two = (run_simulated(setup, cfg, w) for _ in range(2))
    assert one["summary"] == two["summary"]  # virtual time: the same run twice
    s = one["summary"]["classes"]
    assert s["background"]["turns"] > 6 and s["interactive"]["turns"] > 0
    assert one["replay"]["promotions"] > 0 and one["migrations"]["count"] > 0  # check-ins move sessions
    assert one["migrations"]["seconds"] > 0  # promotions pay for their copy at the link's speed
    sim = one["simulated"]
    assert sim["simulated"] is True and sim["shape"] == "llama-3.1-8b" and sim["steps"] > 100
    assert set(sim["step_costs"]) == {"cpu", "torch"}


def test_gpu_only_and_fifo_run_one_pool(setup):
    w = AgentWorkload(agents=4, duration_s=120.0)
    for name in ("gpu-only", "fifo"):
        out = run_simulated(setup, resolve(name, setup.gpu), w)
        assert out["pools"] == ["gpu"] and out["summary"]["turns"] > 0


def test_this_host_without_a_gpu_runs_the_cpu_configurations_only(smollm2_q4_0, setup):
    here = dataclasses.replace(setup, host=HOSTS["this-host"], shape=SMOL)
    assert isinstance(resolve("gpu-only", here.gpu), str)  # unavailable: no GPU to simulate
    out = run_simulated(here, resolve("weave", here.gpu), AgentWorkload(agents=2, duration_s=60.0))
    assert out["pools"] == ["cpu"] and out["summary"]["turns"] > 0


def test_the_bench_command_simulates_a_gpu_host(tiny_llama, tmp_path, monkeypatch):
    from typer.testing import CliRunner
    from weaved.cli.app import app

    monkeypatch.setenv("WEAVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    out = CliRunner().invoke(app, ["bench", "--scenario", "agents", "--simulate", "l40s-epyc", "--shape",
                                   "llama-3.2-1b", "--model", str(tiny_llama), "--quick", "--configs",
                                   "weave,gpu-only", "--agents", "2", "--duration", "60"])
    assert out.exit_code == 0, out.output
    assert "SIMULATED (virtual time, no tokens computed): host NVIDIA L40S" in out.output
    assert "the seed's claim" in out.output and "weave " in out.output and "gpu-only" in out.output
    bad = CliRunner().invoke(app, ["bench", "--scenario", "agents", "--simulate", "mars", "--shape", "llama-3.2-1b",
                                   "--model", str(tiny_llama), "--quick"])
    assert bad.exit_code != 0 and "unknown simulated host 'mars'" in bad.output
    no_shape = CliRunner().invoke(app, ["bench", "--scenario", "agents", "--simulate", "l40s-epyc"])
    assert no_shape.exit_code != 0 and "--simulate needs --shape" in no_shape.output


@pytest.mark.slow
def test_the_validation_replays_for_real_and_simulated_and_compares(tiny_llama, tmp_path, monkeypatch):
    """The command runs both and prints the comparison; whether a run lands within the bar is a
    measurement (docs/benchmarks.md), not something a test can promise."""
    from typer.testing import CliRunner
    from weaved.cli.app import app

    monkeypatch.setenv("WEAVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    out = CliRunner().invoke(app, ["bench", "--scenario", "agents", "--validate", "--model", str(tiny_llama),
                                   "--configs", "fifo", "--agents", "2", "--duration", "15", "--threads", "1"])
    assert out.exit_code in (0, 1), out.output
    assert "SIMULATED (virtual time" in out.output and "fifo: simulation vs this host" in out.output
    assert "background TTFT p50 ms" in out.output
    bad = CliRunner().invoke(app, ["bench", "--scenario", "agents", "--validate", "--simulate", "l40s-epyc"])
    assert bad.exit_code == 2 and "--validate runs" in bad.output
