"""``weave bench --scenario agents``: replay the reference agent workload against each configuration,
one after the other, then search each configuration's capacity.

Every run gets a fresh ``Daemon`` in a fresh temporary data directory (no KV, journal or page cache
carried from one run to the next) and is shut down before the next starts: two daemons on two cores
would measure each other.  A configuration that cannot load, or whose run fails, is reported with its
error and the others go on.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from weaved.bench.agents.capacity import CapacityResult, relative, search_capacity
from weaved.bench.agents.configs import (
    CONFIG_NAMES,
    GpuSupport,
    ResolvedConfig,
    build_profile,
    detect_gpu_support,
    resolve,
)
from weaved.bench.agents.metrics import SLATargets, summarize
from weaved.bench.agents.workload import AgentWorkload, Plan

Progress = Callable[[str], None]
NO_GPU_NOTICE = ("no GPU pool in this run (no CUDA GPU): every configuration runs on the CPU pool - the policies "
                 "on this host's CPU, not co-execution (--simulate l40s-epyc --shape NAME simulates a GPU host)")


@dataclass(frozen=True)
class ScenarioOptions:
    model: Path
    workload: AgentWorkload = AgentWorkload()
    configs: tuple[str, ...] = CONFIG_NAMES
    threads: int | None = None  # CPU pool kernel threads (None: the profile's)
    capacity: bool = True
    capacity_duration_s: float = 90.0  # each capacity run is shorter than the main run
    capacity_start: int = 4
    capacity_max_agents: int = 64
    capacity_max_runs: int = 6
    data_root: Path | None = None  # where the temporary data directories go (None: the system's)
    speculative: bool = True  # also measure the speculative variant's speed-up on repetitive text
    spec_tokens: int = 128  # tokens per speculative measurement run
    spec_reps: int = 3

    def __post_init__(self) -> None:
        unknown = [c for c in self.configs if c not in CONFIG_NAMES]
        if unknown or not self.configs:
            raise ValueError(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIG_NAMES)}")
        if self.capacity_duration_s <= 0 or self.capacity_max_runs < 1:
            raise ValueError("capacity_duration_s must be > 0 and capacity_max_runs >= 1")
        if not 1 <= self.capacity_start <= self.capacity_max_agents:
            raise ValueError("need 1 <= capacity_start <= capacity_max_agents")

    @classmethod
    def quick(cls, model: Path, **overrides) -> ScenarioOptions:
        """A few minutes: a short main run, and (if asked for) a small capacity search."""
        base = {"workload": AgentWorkload.quick(), "capacity": False, "capacity_duration_s": 30.0,
                "capacity_start": 2, "capacity_max_agents": 16, "capacity_max_runs": 3, "spec_tokens": 64,
                "spec_reps": 1}
        return cls(model=model, **{**base, **overrides})


def run_once(opts: ScenarioOptions, cfg: ResolvedConfig, workload: AgentWorkload, progress: Progress) -> dict:
    """One replay of ``workload`` on a fresh daemon running ``cfg``: its summary and the daemon's figures."""
    from weaved.bench.agents.figures import daemon_figures
    from weaved.bench.agents.replay import Replay
    from weaved.bench.agents.tokens import TokenPool
    from weaved.bench.agents.warmup import warm_up
    from weaved.daemon.core import Daemon

    with tempfile.TemporaryDirectory(prefix="weave-agents-", dir=opts.data_root) as tmp:
        profile = build_profile(cfg, Path(tmp), opts.threads)
        d = Daemon(profile, opts.model, data_dir=Path(tmp) / "data", log_fn=lambda m: None)
        try:
            d.load()
            missing = [p for p in cfg.pools if p not in d.pools]
            if missing:
                raise RuntimeError(f"pool(s) {missing} did not load: {'; '.join(d.pool_notes) or 'no reason given'}")
            tokens = TokenPool.from_tokenizer(lambda t: d.tokenizer.encode(t, add_bos=False, special=False),
                                              workload.seed)
            warm_up(d, tokens)
            progress(f"{cfg.name}: {workload.agents} agents for {workload.duration_s:g} s")
            result = Replay(d, Plan(workload), tokens).run()
        finally:
            d.shutdown()
        figures = daemon_figures(result.status, d)
    return run_result(cfg, workload, result, figures, d.pool_notes)


def run_result(cfg: ResolvedConfig, workload: AgentWorkload, result, figures: dict, pool_notes) -> dict:
    """One run's entry in the report: the replay's ``ReplayResult`` summarized, the daemon's figures."""
    summary = summarize(result.records, SLATargets.from_workload(workload), result.t_end)
    return {"agents": workload.agents, "duration_s": round(result.t_end, 2), "pools": list(cfg.pools),
            "summary": summary, **figures, "replay": result.counts, "errors": result.errors,
            "pool_notes": list(pool_notes)}


RunOnce = Callable[[ResolvedConfig, AgentWorkload], dict]


def measure_speculative(opts: ScenarioOptions, progress: Progress) -> dict:
    """The speculative variant's decode speed-up on repetitive and on natural text (weaved.bench.speculative)."""
    import os

    from weaved.bench.speculative import measure

    progress("speculative variant: plain vs speculative decode")
    try:
        return measure(opts.model, opts.threads or os.cpu_count() or 2, n_gen=opts.spec_tokens, reps=opts.spec_reps)
    except Exception as exc:  # noqa: BLE001 - reported beside the rest
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_scenario(opts: ScenarioOptions, progress: Progress = lambda m: None, *, gpu: GpuSupport | None = None,
                 run: RunOnce | None = None, spec: Callable[[], dict] | None = None) -> dict:
    """The scenario's report (a JSON-able dict; see ``report.py`` for its shape).  ``run`` and ``spec``
    replace the real replay and the speculative measurement (tests)."""
    gpu = gpu or detect_gpu_support()
    run = run or (lambda cfg, w: run_once(opts, cfg, w, progress))
    w = opts.workload
    configs: dict[str, dict] = {}
    resolved: dict[str, ResolvedConfig] = {}
    for name in opts.configs:
        r = resolve(name, gpu)
        if isinstance(r, str):
            configs[name] = {"unavailable": r}
            progress(f"{name}: skipped ({r})")
            continue
        resolved[name] = r
        progress(f"{name}: {r.spec.description} [pools: {', '.join(r.pools)}]")
        configs[name] = {"description": r.spec.description, "policy": r.spec.policy, "note": r.note,
                         **_guarded(run, r, w, progress)}
    capacity: dict[str, CapacityResult] = {}
    if opts.capacity:
        for name, r in resolved.items():
            if "error" in configs[name]:
                continue
            progress(f"{name}: capacity search")
            capacity[name] = _capacity(opts, r, run, progress)
    return {
        "scenario": "agents", "model": str(opts.model), "threads": opts.threads,
        "gpu": {"torch_backend": gpu.torch_backend, "cuda": gpu.cuda},
        "notice": NO_GPU_NOTICE if not gpu.pool_possible else None,
        "workload": dataclasses.asdict(w), "plan": {"checkins": len(Plan(w).checkins)},
        "configs": configs,
        "capacity": _capacity_report(opts, capacity),
        "speculative": (spec or (lambda: measure_speculative(opts, progress)))() if opts.speculative else None,
    }


def _guarded(run: RunOnce, cfg: ResolvedConfig, w: AgentWorkload, progress: Progress) -> dict:
    try:
        return run(cfg, w)
    except Exception as exc:  # noqa: BLE001 - reported; the other configurations still run
        progress(f"{cfg.name} failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}


def _capacity(opts: ScenarioOptions, cfg: ResolvedConfig, run: RunOnce, progress: Progress) -> CapacityResult:
    def probe(n: int) -> tuple[bool, dict]:
        w = dataclasses.replace(opts.workload, agents=n, duration_s=opts.capacity_duration_s)
        out = _guarded(run, cfg, w, progress)
        if "error" in out:
            return False, {"error": out["error"]}
        s = out["summary"]
        shares = {c: v["share_met"] for c, v in s["classes"].items()}
        progress(f"{cfg.name}: {n} agents -> {'pass' if s['meets_sla'] else 'fail'} {shares}")
        return s["meets_sla"], {"shares": shares, "limiting_class": s["limiting_class"]}

    return search_capacity(probe, start=min(opts.capacity_start, opts.capacity_max_agents),
                           max_agents=opts.capacity_max_agents, max_runs=opts.capacity_max_runs)


def _capacity_report(opts: ScenarioOptions, capacity: dict[str, CapacityResult]) -> dict | None:
    if not opts.capacity:
        return None
    rel = relative(capacity, "fifo")
    co = None
    if "weave" in capacity and "gpu-only" in capacity and capacity["gpu-only"].capacity > 0:
        co = round(capacity["weave"].capacity / capacity["gpu-only"].capacity, 3)
    return {"duration_s": opts.capacity_duration_s, "share": opts.workload.sla_share,
            "background_ttlt_s": opts.workload.background_ttlt_s,
            "by_config": {n: c.to_dict() for n, c in capacity.items()},
            "relative_to_fifo": rel, "weave_over_gpu_only": co}
