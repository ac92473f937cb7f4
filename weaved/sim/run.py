"""From ``weave bench --scenario agents --simulate`` options to a simulated scenario and its report."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from weaved.bench.agents.scenario import ScenarioOptions, run_scenario

SIM_DURATION_S = 3600.0  # an hour of the workload per configuration (seconds of wall time)
SIM_CAPACITY_DURATION_S = 1200.0
SIM_MAX_AGENTS = 512


def simulation_options(model: Path, *, quick: bool, agents: int | None, duration: float | None, seed: int | None,
                       configs: tuple[str, ...] | None, capacity: bool | None) -> ScenarioOptions:
    """The agents scenario's options for a simulation: an hour per run, capacity runs of 20 minutes up to
    512 agents (``--quick``: ten minutes, no capacity search); no speculative measurement (not simulated)."""
    from weaved.bench.agents.workload import AgentWorkload

    w = AgentWorkload(duration_s=600.0 if quick else SIM_DURATION_S)
    w = dataclasses.replace(w, **{k: v for k, v in (("agents", agents), ("duration_s", duration), ("seed", seed))
                                  if v is not None})
    opts = ScenarioOptions(model=model, workload=w, capacity=not quick if capacity is None else capacity,
                           capacity_duration_s=SIM_CAPACITY_DURATION_S, capacity_max_agents=SIM_MAX_AGENTS,
                           capacity_max_runs=10, speculative=False)
    return dataclasses.replace(opts, configs=configs) if configs is not None else opts


def simulate_and_format(host: str, shape: str, model: Path, *, threads: int, quick: bool, json_out: bool,
                        agents: int | None, duration: float | None, seed: int | None,
                        configs: tuple[str, ...] | None, capacity: bool | None,
                        say: Callable[[str], None]) -> tuple[str, bool]:
    """(text to print, whether every asked configuration ran).  ``model``: what this host's CPU
    calibration is measured with; ``threads``: the CPU pool's threads for it."""
    from weaved.bench.agents.report import format_table
    from weaved.sim.scenario import SimSetup, run_simulated, simulated_report, this_host_calibration

    opts = simulation_options(model, quick=quick, agents=agents, duration=duration, seed=seed, configs=configs,
                              capacity=capacity)
    from weaved.config.load import load_profile

    cal, measured_on = this_host_calibration(model, threads, load_profile("cpu-only").host.data_dir, say)
    setup = SimSetup.named(host, shape, cal, measured_on, model, opts.data_root)
    report = run_scenario(opts, lambda m: say(f"[simulated] {m}"), gpu=setup.gpu,
                          run=lambda cfg, w: run_simulated(setup, cfg, w), spec=lambda: None)
    report = {**simulated_report(setup, report), "threads": None}
    text = json.dumps(report) if json_out else format_table(report)
    return text, all("error" not in c for c in report["configs"].values())


def validate_and_format(model: Path, *, threads: int, json_out: bool, agents: int | None, duration: float | None,
                        seed: int | None, configs: tuple[str, ...] | None, say: Callable[[str], None]
                        ) -> tuple[str, bool]:
    """The workload replayed for real on this host and simulated with this host's calibration of the same
    model, for each configuration: both reports and their comparison (``validate.py``).  (text, whether
    every held figure is within the bar)."""
    from weaved.bench.agents.report import format_table
    from weaved.bench.agents.scenario import ScenarioOptions, run_scenario
    from weaved.config.load import load_profile
    from weaved.sim.hardware import HOSTS
    from weaved.sim.scenario import SimSetup, run_simulated, simulated_report, this_host_calibration
    from weaved.sim.validate import compare, format_comparison

    base = ScenarioOptions(model=model, capacity=False, speculative=False, threads=threads)
    w = dataclasses.replace(base.workload, **{k: v for k, v in (("agents", agents), ("duration_s", duration),
                                                                ("seed", seed)) if v is not None})
    opts = dataclasses.replace(base, workload=w, **({"configs": configs} if configs is not None else {}))
    cal, cfg = this_host_calibration(model, threads, load_profile("cpu-only").host.data_dir, say)
    real = run_scenario(opts, lambda m: say(f"[real] {m}"))
    setup = SimSetup(HOSTS["this-host"], cfg, cal, cfg, model, opts.data_root)
    sim = {**simulated_report(setup, run_scenario(opts, lambda m: say(f"[simulated] {m}"), gpu=setup.gpu,
                                                  run=lambda c, wl: run_simulated(setup, c, wl), spec=lambda: None)),
           "threads": threads}
    comparisons = {name: compare(real["configs"][name], sim["configs"][name]) for name in real["configs"]
                   if "summary" in real["configs"][name] and "summary" in sim["configs"].get(name, {})}
    ok = bool(comparisons) and all(c["passed"] for c in comparisons.values())
    if json_out:
        return json.dumps({"real": real, "simulated": sim, "comparison": comparisons}), ok
    parts = [format_table(real), "", format_table(sim)]
    parts += [f"\n{name}: {format_comparison(c)}" for name, c in comparisons.items()]
    return "\n".join(parts), ok
