"""``weave bench --scenario agents --simulate HOST --shape MODEL``: the agents scenario - its
configurations, its capacity search, its report - with every run a simulated daemon replaying the
workload in virtual time (hours of it in seconds).

The CPU pool's step model is this host's calibration (of the model it was measured with, read from
the calibration store or measured now) moved to the shape and the simulated CPU; a GPU pool's is the
device's roofline (``cost.py``).  Every result carries the cost model's parameters and is marked
simulated.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from weaved.bench.agents.configs import GpuSupport, ResolvedConfig, build_profile
from weaved.bench.agents.scenario import run_result
from weaved.bench.agents.workload import AgentWorkload, Plan
from weaved.calibration.store import Calibration
from weaved.config.load import load_profile
from weaved.model.config import ModelConfig
from weaved.sim.cost import scaled_cpu
from weaved.sim.hardware import HOSTS, HostSpec
from weaved.sim.shapes import shape_config

CLAIM = ("the seed's claim: co-executing the idle CPU beside the GPU serves nearly +50 % more sessions within SLA "
         "than the GPU alone (weave_over_gpu_only about 1.5)")


@dataclass(frozen=True)
class SimSetup:
    host: HostSpec
    shape: ModelConfig
    calibration: Calibration  # this host's CPU pool
    measured_on: ModelConfig  # the model the calibration was measured with
    tokenizer_model: Path  # a GGUF whose tokenizer the simulated daemon uses (turns are token ids)
    data_root: Path | None = None
    engine_time: bool = True  # add the engines' own measured work to each step (driver.py); off: reproducible

    @classmethod
    def named(cls, host: str, shape: str, calibration: Calibration, measured_on: ModelConfig,
              tokenizer_model: Path, data_root: Path | None = None) -> SimSetup:
        if host not in HOSTS:
            raise ValueError(f"unknown simulated host {host!r} (known: {', '.join(HOSTS)})")
        return cls(HOSTS[host], shape_config(shape), calibration, measured_on, tokenizer_model, data_root)

    @property
    def gpu(self) -> GpuSupport:
        """What the configurations may use: a GPU pool where the simulated host has a GPU."""
        return GpuSupport(torch_backend=True, cuda=bool(self.host.gpus))


def run_simulated(setup: SimSetup, cfg: ResolvedConfig, workload: AgentWorkload) -> dict:
    """One simulated replay of ``workload`` with configuration ``cfg``: the agents scenario's result
    for one run, marked simulated, with the cost model's parameters."""
    from weaved.bench.agents.figures import daemon_figures
    from weaved.bench.agents.replay import Replay
    from weaved.bench.agents.tokens import TokenPool
    from weaved.sim.daemon import build
    from weaved.sim.driver import Driver

    cal = setup.calibration
    cpu_cost = scaled_cpu(cal.cost, setup.measured_on, cal.threads, setup.shape, setup.host.cpu)
    cap = setup.host.kv_cap_bytes() // setup.shape.kv_bytes_per_token
    with tempfile.TemporaryDirectory(prefix="weave-sim-", dir=setup.data_root) as tmp:
        base = load_profile(setup.host.profile)
        profile = build_profile(cfg, Path(tmp), None, base=base)
        sim = build(profile, shape=setup.shape, host=setup.host, cpu_cost=cpu_cost,
                    tokenizer_model=setup.tokenizer_model, data_dir=Path(tmp) / "data", kv_cap_positions=cap)
        d = sim.daemon
        try:
            tokens = TokenPool.from_tokenizer(lambda t: d.tokenizer.encode(t, add_bos=False, special=False),
                                              workload.seed)
            driver = Driver(sim, engine_time=setup.engine_time)
            replay = Replay(d, Plan(workload), tokens, clock=sim.clock.now)
            replay.idle = lambda until: driver.run_until(until, replay.next_end)
            result = replay.run()
        finally:
            d.shutdown()
        figures = daemon_figures(result.status, d)
    return {**run_result(cfg, workload, result, figures, d.pool_notes),
            "simulated": {"steps": driver.steps, "engine_s": round(driver.engine_s, 3),
                          "engine_time": setup.engine_time, **sim.parameters()}}


def simulated_report(setup: SimSetup, report: dict) -> dict:
    """The scenario's report, marked simulated: the cost model and the seed's claim beside the result."""
    cal = setup.calibration
    return {**report, "model": f"{setup.shape.name} (shape; simulated)", "notice": None,
            "simulated": {"host": setup.host.to_dict(), "shape": setup.shape.name,
                          "cpu_calibration": {"key": cal.key, "measured_at": cal.measured_at,
                                              "measured_on": setup.measured_on.name, "threads": cal.threads},
                          "claim": CLAIM}}


def this_host_calibration(model: Path, threads: int, data_dir: Path, say=lambda m: None
                          ) -> tuple[Calibration, ModelConfig]:
    """This host's CPU calibration for ``model`` at ``threads`` (stored, or measured now) and the
    model's config."""
    from weaved.calibration.store import CalibrationStore, calibration_key
    from weaved.daemon.rates import calibration_of
    from weaved.kernels.matmul import kernel_path
    from weaved.kv.store import model_fingerprint
    from weaved.model.default import cache_dir
    from weaved.model.loader import open_model

    gguf, cfg = open_model(model)
    store = CalibrationStore(data_dir, cache_dir() / "calibration")
    found = store.load(calibration_key(model_fingerprint(cfg), "cpu", "cpu", threads, kernel_path()))
    if found is not None:
        return found, cfg
    from weaved.backends.cpu import CPUBackend

    pool = load_profile("cpu-only").pool("cpu")
    cal = calibration_of(CPUBackend(gguf, cfg, threads=threads), model_fingerprint(cfg), pool.prefill_chunk,
                         pool.max_batch, store, say)
    return cal, cfg
