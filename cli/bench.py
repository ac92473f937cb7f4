"""``weave bench``: Weave's CPU backend against llama.cpp, same model file, same threads, one run.

Runs in-process (no daemon).  Everything heavy (numba, llama.cpp, the model) is imported inside the
command, so registering it costs nothing to the client commands.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from weaved.bench import BenchConfig

Runner = Callable[["BenchConfig"], dict[str, Any]]


def parse_only(text: str | None) -> tuple[str, ...] | None:
    """``"prefill,decode_2k"`` -> ``("prefill_tps", "decode_2k_tps")``; None when not given.

    Keys may be written with or without their ``_tps`` suffix; unknown keys raise ``BadParameter``.
    """
    from weaved.bench import KEYS

    if text is None:
        return None
    keys = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key = part if part.endswith("_tps") else f"{part}_tps"
        if key not in KEYS:
            raise typer.BadParameter(f"unknown measurement {part!r}; choose from {', '.join(KEYS)}")
        if key not in keys:
            keys.append(key)
    if not keys:
        raise typer.BadParameter("empty list of measurements")
    return tuple(keys)


def default_threads() -> int:
    """The CPUs this process may run on (its affinity and cgroup's cpuset, not every CPU of the host)."""
    try:
        return len(os.sched_getaffinity(0)) or 2
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 2


def _default_runner(cfg: BenchConfig) -> dict[str, Any]:
    from weaved.bench.runner import run_bench

    return run_bench(cfg)


def register(app: typer.Typer, run: Runner | None = None,
             run_agents: Callable[[Any], dict[str, Any]] | None = None,
             run_ring: Callable[[Any], dict[str, Any]] | None = None,
             run_load: Callable[[Any], dict[str, Any]] | None = None) -> None:
    """Add ``bench`` to ``app``.  ``run`` measures a config (the real benchmark when None); ``run_agents``
    runs the agents scenario's options (``weaved.bench.agents``; the real replay when None); ``run_ring``
    the ring scenario's (``weaved.bench.ring``; the real measurement when None)."""
    runner = run or _default_runner

    @app.command("bench")
    def bench(
        model: Annotated[
            Path | None,
            typer.Option(
                "--model", exists=True, dir_okay=False, help="GGUF file (default: the default model)."
            ),
        ] = None,
        shape: Annotated[
            str | None,
            typer.Option("--shape", metavar="NAME[:LAYERS]",
                         help="Instead of --model: a model in the exact shape of a real one with random weights, "
                              "quantized to Q4_0 by llama.cpp and cached (smollm2-135m, llama-3.2-1b, llama-3.2-3b, "
                              "llama-3.1-8b, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-0.5b-yarn, qwen3-0.6b, qwen3-1.7b, "
                              "qwen3-32b, qwen3-30b-a3b); ':LAYERS' cuts it to that many layers.  With --simulate: "
                              "the shape the simulated host serves (nothing is built)."),
        ] = None,
        threads: Annotated[
            int | None,
            typer.Option("--threads", min=1, help="Threads for both sides (default: the CPUs this process may use)."),
        ] = None,
        quick: Annotated[bool, typer.Option("--quick", help="One repetition, fewer tokens per run.")] = False,
        json_out: Annotated[
            bool, typer.Option("--json", help="Print one JSON object instead of a table.")
        ] = False,
        only: Annotated[
            str | None,
            typer.Option(
                "--only", help="Comma list of measurements: prefill, decode, decode_2k, decode_8k, batch16, batch64."
            ),
        ] = None,
        scenario: Annotated[
            str, typer.Option("--scenario", help="llama: Weave's CPU engine vs llama.cpp; agents: the reference "
                                                 "agent workload (docs/benchmarks.md); ring: Q-Ring's compute "
                                                 "vs transfer margin and loopback decode (docs/ring-cost-model.md); "
                                                 "load: many concurrent clients against weave serve; grammar: "
                                                 "constrained decoding's mask cost per token (the default model's "
                                                 "and Gemma 3's vocabularies, or --model's); prefix: 16 agents "
                                                 "sharing 2,000 tokens of tools, then working on in conversations "
                                                 "of their own, with and without shared prefixes.")
        ] = "llama",
        agents: Annotated[int | None, typer.Option("--agents", min=1, help="agents: background agents.")] = None,
        duration: Annotated[
            float | None, typer.Option("--duration", min=0.1, help="agents: seconds per configuration run; load: "
                                                                  "seconds of load (default 600, 60 with --quick).")
        ] = None,
        seed: Annotated[int | None, typer.Option("--seed", min=0, help="agents: workload seed.")] = None,
        configs: Annotated[
            str | None, typer.Option("--configs", help="agents: comma list of weave, weave-noprefix, isolation, fifo, "
                                                       "gpu-only.")
        ] = None,
        capacity: Annotated[
            bool | None,
            typer.Option("--capacity/--no-capacity", help="agents: search each configuration's capacity "
                                                         "(default: on, off with --quick)."),
        ] = None,
        clients: Annotated[
            int | None, typer.Option("--clients", min=1, help="load: concurrent clients (default 64, 16 with --quick).")
        ] = None,
        validate: Annotated[
            bool, typer.Option("--validate", help="agents: replay the workload for real on this host's CPU pool and "
                                                  "simulated with this host's calibration of the same model, and "
                                                  "compare them (TTFT p50/p99, SLA share, tokens/s: 15 % bar).")
        ] = False,
        simulate: Annotated[
            str | None,
            typer.Option("--simulate", metavar="HOST",
                         help="agents: simulate HOST (this-host, l40s-epyc, h100-epyc) serving --shape (a shape "
                              "name: nothing is built) in virtual time - the daemon's own router, admission, "
                              "scheduler and engines over a cost model: this host's CPU calibration moved to the "
                              "shape and the host, a roofline for its GPU.  Every result is marked simulated."),
        ] = None,
    ) -> None:
        """Measure Weave and llama.cpp on the same model and threads; print both and their ratio.
        With --scenario agents: replay the reference agent workload against Weave and its baselines."""
        if scenario not in ("llama", "agents", "ring", "load", "grammar", "prefix"):
            raise typer.BadParameter(f"unknown scenario {scenario!r}; choose llama, agents, ring, load, grammar or "
                                     "prefix", param_hint="--scenario")
        if clients is not None and scenario != "load":  # (before the scenarios that would drop it)
            raise typer.BadParameter("--clients needs --scenario load")
        if validate:
            if scenario != "agents" or simulate is not None or shape is not None:
                raise typer.BadParameter("--validate runs --scenario agents on this host's model (--model), "
                                         "without --simulate or --shape", param_hint="--validate")
            if quick or only is not None:
                raise typer.BadParameter("--validate replays the whole workload: without --quick or --only",
                                         param_hint="--validate")
            _agents_validated(model, threads, json_out, (agents, duration, seed, configs, capacity))
            return
        if simulate is not None:
            if scenario != "agents":
                raise typer.BadParameter("--simulate applies to --scenario agents", param_hint="--simulate")
            _agents_simulated(simulate, shape, model, threads, quick, json_out, only,
                              (agents, duration, seed, configs, capacity))
            return
        if shape is not None:
            if model is not None:
                raise typer.BadParameter("give --model or --shape, not both", param_hint="--shape")
            model = _shape_model(shape)
        if scenario == "prefix":
            if any(v is not None for v in (agents, seed, configs, capacity, only, clients, duration, threads)):
                raise typer.BadParameter("the prefix scenario takes --model/--shape, --quick and --json")
            _prefix(model, quick, json_out)
            return
        if scenario == "grammar":
            if any(v is not None for v in (agents, seed, configs, capacity, only, clients, duration)):
                raise typer.BadParameter("the grammar scenario takes --model/--shape, --threads, --quick and --json")
            _grammar(model, threads, quick, json_out)
            return
        if scenario == "load":
            if any(v is not None for v in (agents, seed, configs, capacity, only, threads)):
                raise typer.BadParameter("the load scenario takes --model/--shape, --clients, --duration, --quick and "
                                         "--json (the daemon runs its profile's kernel threads, and the batched rate "
                                         "it is held to is measured with the same)")
            _load(model, threads, quick, json_out, clients, duration, run_load)
            return
        agent_opts = (agents, duration, seed, configs, capacity)
        if scenario == "agents":
            _agents(model, threads, quick, json_out, only, agent_opts, run_agents)
            return
        if any(v is not None for v in agent_opts):
            raise typer.BadParameter("--agents, --duration, --seed, --configs and --capacity need --scenario agents")
        if scenario == "ring":
            _ring(model, threads, quick, json_out, only, run_ring)
            return
        from weaved.bench import KEYS, BenchConfig
        from weaved.bench.report import format_table

        keys = parse_only(only) or KEYS

        # Both sides run the very file Weave runs: a model of another quantization is converted
        # (once, cached) and llama.cpp measures the converted file too.
        say = lambda msg: typer.echo(msg, err=True)
        model = _model_file(model, say)
        n = threads or default_threads()
        cfg = BenchConfig.quick(model, n, keys) if quick else BenchConfig(model=model, threads=n, keys=keys)
        report = runner(cfg)
        if json_out:
            typer.echo(json.dumps(report))
        else:
            typer.echo(format_table(report, reps=cfg.rounds * cfg.reps))
        if any("error" in report[side] for side in ("weave", "llama_cpp")):
            raise typer.Exit(1)


def _model_file(model: Path | None, say: Callable[[str], None]) -> Path:
    """The file every scenario runs: the default model, or ``model`` in the shared format (a model of
    another quantization is converted once, cached, with what that costs said through ``say``)."""
    from weaved.model.default import default_model_path, ensure_native

    if model is None:
        return Path(default_model_path())
    try:
        return Path(ensure_native(model, log=say))
    except ValueError as e:  # (not a GGUF Weave runs; a missing file is refused by the option itself)
        raise typer.BadParameter(str(e), param_hint="--model") from None


def _shape_model(spec: str) -> Path:
    """The cached GGUF of ``NAME[:LAYERS]`` (built on first use, with its progress on stderr)."""
    from weaved.bench.shape_files import shape_gguf
    from weaved.bench.shapes import SHAPES

    name, _, layers = spec.partition(":")
    if name not in SHAPES:
        raise typer.BadParameter(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}", param_hint="--shape")
    if layers and not layers.isdigit():
        raise typer.BadParameter(f"LAYERS must be a number, got {layers!r}", param_hint="--shape")
    try:
        return shape_gguf(name, int(layers) if layers else None, progress=lambda m: typer.echo(m, err=True))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--shape") from None


def _agents(model: Path | None, threads: int | None, quick: bool, json_out: bool, only: str | None,
            agent_opts: tuple, run_agents: Callable[[Any], dict[str, Any]] | None) -> None:
    """``weave bench --scenario agents`` (weaved.bench.agents; imported here, not at registration)."""
    from weaved.bench.agents.cli import parse_configs, run_and_format, scenario_options

    if only is not None:
        raise typer.BadParameter("--only applies to the llama scenario")
    agents, duration, seed, configs, capacity = agent_opts
    try:
        names = parse_configs(configs)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--configs") from None
    say = lambda msg: typer.echo(msg, err=True)
    model = _model_file(model, say)
    try:
        opts = scenario_options(model, threads=threads, quick=quick, agents=agents, duration=duration, seed=seed,
                                configs=names, capacity=capacity)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    text, ok = run_and_format(opts, json_out, run_agents)
    typer.echo(text)
    if not ok:
        raise typer.Exit(1)


def _agents_simulated(host: str, shape: str | None, model: Path | None, threads: int | None, quick: bool,
                      json_out: bool, only: str | None, agent_opts: tuple) -> None:
    """``weave bench --scenario agents --simulate HOST --shape NAME`` (weaved.sim)."""
    from weaved.bench.agents.cli import parse_configs
    from weaved.sim.run import simulate_and_format

    if only is not None:
        raise typer.BadParameter("--only applies to the llama scenario")
    if shape is None:
        raise typer.BadParameter("--simulate needs --shape: the model the simulated host serves",
                                 param_hint="--shape")
    agents, duration, seed, configs, capacity = agent_opts
    try:
        names = parse_configs(configs)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--configs") from None
    say = lambda msg: typer.echo(msg, err=True)
    try:
        text, ok = simulate_and_format(host, shape, _model_file(model, say), threads=threads or default_threads(),
                                       quick=quick, json_out=json_out, agents=agents, duration=duration, seed=seed,
                                       configs=names, capacity=capacity, say=say)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(text)
    if not ok:
        raise typer.Exit(1)


def _agents_validated(model: Path | None, threads: int | None, json_out: bool, agent_opts: tuple) -> None:
    """``weave bench --scenario agents --validate`` (weaved.sim.run)."""
    from weaved.bench.agents.cli import parse_configs
    from weaved.sim.run import validate_and_format

    agents, duration, seed, configs, capacity = agent_opts
    if capacity:
        raise typer.BadParameter("--validate compares single runs: no --capacity", param_hint="--capacity")
    try:
        names = parse_configs(configs)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--configs") from None
    say = lambda msg: typer.echo(msg, err=True)
    text, ok = validate_and_format(_model_file(model, say), threads=threads or default_threads(), json_out=json_out,
                                   agents=agents, duration=duration, seed=seed, configs=names, say=say)
    typer.echo(text)
    if not ok:
        raise typer.Exit(1)


def _ring(model: Path | None, threads: int | None, quick: bool, json_out: bool, only: str | None,
          run_ring: Callable[[Any], dict[str, Any]] | None) -> None:
    """``weave bench --scenario ring`` (weaved.bench.ring; imported here, not at registration)."""
    from weaved.bench.ring import RingBenchOptions
    from weaved.bench.ring.report import format_table

    if only is not None:
        raise typer.BadParameter("--only applies to the llama scenario")
    say = lambda msg: typer.echo(f"[ring] {msg}", err=True)
    model = _model_file(model, say)
    n = threads or default_threads()
    opts = RingBenchOptions.quick(model, n) if quick else RingBenchOptions(model=model, threads=n)
    if run_ring is None:
        from weaved.bench.ring.run import run_ring_bench

        report = run_ring_bench(opts, say)
    else:
        report = run_ring(opts)
    typer.echo(json.dumps(report) if json_out else format_table(report))
    if report.get("errors"):
        raise typer.Exit(1)


def _prefix(model: Path | None, quick: bool, json_out: bool) -> None:
    """``weave bench --scenario prefix`` (weaved.bench.prefix; imported here, not at registration)."""
    from weaved.bench.prefix import PrefixOptions, format_table, run_prefix_bench

    say = lambda msg: typer.echo(f"[prefix] {msg}", err=True)
    path = _model_file(model, say)
    opts = PrefixOptions.quick(path) if quick else PrefixOptions(path)
    report = run_prefix_bench(opts, say)
    typer.echo(json.dumps(report) if json_out else format_table(report))


def _grammar(model: Path | None, threads: int | None, quick: bool, json_out: bool) -> None:
    """``weave bench --scenario grammar`` (weaved.bench.grammar; imported here, not at registration)."""
    from weaved.bench.grammar import format_table, run_grammar_bench

    say = lambda msg: typer.echo(f"[grammar] {msg}", err=True)
    models = [_model_file(model, say)]
    if model is None:  # a 262k vocabulary beside the default's 49k, when its package is installed
        from weaved.model.default import gemma3_270m_path

        gemma = gemma3_270m_path()
        if gemma is not None:
            models.append(_model_file(gemma, say))
    report = run_grammar_bench(models, threads or default_threads(), quick, say)
    typer.echo(json.dumps(report) if json_out else format_table(report))


def _load(model: Path | None, threads: int | None, quick: bool, json_out: bool, clients: int | None,
          duration: float | None, run_load: Callable[[Any], dict[str, Any]] | None) -> None:
    """``weave bench --scenario load`` (weaved.bench.load; imported here, not at registration)."""
    from weaved.bench.load import LoadOptions
    from weaved.bench.load.report import format_table

    say = lambda msg: typer.echo(f"[load] {msg}", err=True)
    if run_load is None and importlib.util.find_spec("openai") is None:
        raise typer.BadParameter("the load scenario's clients use the openai package: pip install openai",
                                 param_hint="--scenario")
    model = _model_file(model, say)
    from weaved.config.load import load_profile

    n = threads or load_profile().threads.kernels  # (what the daemon it starts runs with)
    if quick:
        opts = LoadOptions.quick(model, n, clients, duration)
    else:
        d = duration or 600.0
        opts = LoadOptions(model=model, threads=n, clients=clients or 64, duration_s=d, warmup_s=min(60.0, d / 4))
    if run_load is None:
        from weaved.bench.load.run import run_load as real

        report = real(opts, say)
    else:
        report = run_load(opts)
    typer.echo(json.dumps(report) if json_out else format_table(report))
    if report.get("errors"):
        raise typer.Exit(1)
