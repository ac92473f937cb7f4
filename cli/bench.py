"""``weave bench``: Weave's CPU backend against llama.cpp, same model file, same threads, one run.

Runs in-process (no daemon).  Everything heavy (numba, llama.cpp, the model) is imported inside the
command, so registering it costs nothing to the client commands.
"""

from __future__ import annotations

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
    return os.cpu_count() or 2


def _default_runner(cfg: BenchConfig) -> dict[str, Any]:
    from weaved.bench.runner import run_bench

    return run_bench(cfg)


def register(app: typer.Typer, run: Runner | None = None) -> None:
    """Add ``bench`` to ``app``.  ``run`` measures a config (the real benchmark when None)."""
    runner = run or _default_runner

    @app.command("bench")
    def bench(
        model: Annotated[
            Path | None,
            typer.Option(
                "--model", exists=True, dir_okay=False, help="GGUF file (default: the default model)."
            ),
        ] = None,
        threads: Annotated[
            int | None, typer.Option("--threads", min=1, help="Threads for both sides (default: CPU count).")
        ] = None,
        quick: Annotated[bool, typer.Option("--quick", help="One repetition, fewer tokens per run.")] = False,
        json_out: Annotated[
            bool, typer.Option("--json", help="Print one JSON object instead of a table.")
        ] = False,
        only: Annotated[
            str | None,
            typer.Option(
                "--only", help="Comma list of measurements: prefill, decode, decode_2k, batch16, batch64."
            ),
        ] = None,
    ) -> None:
        """Measure Weave and llama.cpp on the same model and threads; print both and their ratio."""
        from weaved.bench import KEYS, BenchConfig
        from weaved.bench.report import format_table

        keys = parse_only(only) or KEYS
        from weaved.model.default import default_model_path, ensure_native

        # Both sides run the very file Weave runs: a model of another quantization is converted
        # (once, cached) and llama.cpp measures the converted file too.
        say = lambda msg: typer.echo(msg, err=True)
        model = Path(default_model_path() if model is None else ensure_native(model, log=say))
        n = threads or default_threads()
        cfg = BenchConfig.quick(model, n, keys) if quick else BenchConfig(model=model, threads=n, keys=keys)
        report = runner(cfg)
        if json_out:
            typer.echo(json.dumps(report))
        else:
            typer.echo(format_table(report, reps=cfg.rounds * cfg.reps))
        if any("error" in report[side] for side in ("weave", "llama_cpp")):
            raise typer.Exit(1)
