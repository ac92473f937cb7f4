"""From ``weave bench --scenario agents`` options to a run and its printed report."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from weaved.bench.agents.configs import CONFIG_NAMES
from weaved.bench.agents.scenario import ScenarioOptions

Runner = Callable[[ScenarioOptions], dict]


def parse_configs(text: str | None) -> tuple[str, ...] | None:
    """``"weave,fifo"`` -> ``("weave", "fifo")`` (order kept, duplicates dropped); None when not given."""
    if text is None:
        return None
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part not in CONFIG_NAMES:
            raise ValueError(f"unknown configuration {part!r}; choose from {', '.join(CONFIG_NAMES)}")
        if part not in names:
            names.append(part)
    if not names:
        raise ValueError("empty list of configurations")
    return tuple(names)


def scenario_options(model: Path, *, threads: int | None, quick: bool, agents: int | None, duration: float | None,
                     seed: int | None, configs: tuple[str, ...] | None, capacity: bool | None) -> ScenarioOptions:
    """The scenario's options: the reference (or ``--quick``) values with the given ones on top."""
    opts = ScenarioOptions.quick(model) if quick else ScenarioOptions(model=model)
    overrides = {k: v for k, v in (("agents", agents), ("duration_s", duration), ("seed", seed)) if v is not None}
    workload = dataclasses.replace(opts.workload, **overrides)
    top: dict = {"workload": workload, "threads": threads}
    if configs is not None:
        top["configs"] = configs
    if capacity is not None:
        top["capacity"] = capacity
    return dataclasses.replace(opts, **top)


def default_runner(opts: ScenarioOptions) -> dict:
    import sys

    from weaved.bench.agents.scenario import run_scenario

    return run_scenario(opts, lambda m: print(f"[agents] {m}", file=sys.stderr, flush=True))


def run_and_format(opts: ScenarioOptions, json_out: bool, runner: Runner | None = None) -> tuple[str, bool]:
    """(text to print, whether every asked configuration ran)."""
    from weaved.bench.agents.report import format_table

    report = (runner or default_runner)(opts)
    text = json.dumps(report) if json_out else format_table(report)
    ok = all("error" not in c for c in report["configs"].values())
    return text, ok
