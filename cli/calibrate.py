"""``weave calibrate``: measure the CPU pool's step-time model for a model on this host, in-process.

The daemon calibrates on its own on first use of a model (and reads the stored result after); this
command measures afresh - after a hardware or kernel change, or to see the numbers - and stores the
result where ``weave serve`` finds it.  Heavy imports happen inside the command.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Annotated

import typer
from weaved.cli.common import JsonOpt, print_json
from weaved.cli.fmt import printable
from weaved.cli.serve import ModelOpt, ProfileOpt, say_line

HELP = (
    "Measure how long the CPU pool's engine steps take for a model on this host - prefill chunks and "
    "decode batches at several sizes and contexts, a few seconds - fit the step-time model the router "
    "and the scheduler predict with, and store it in the data directory (and the machine's cache), where "
    "'weave serve' reads it. 'weave serve' calibrates by itself on first use of a model; run this to "
    "measure again, e.g. after a hardware change. Prints the rates in use and how well the model fits."
)


def _text(result: dict) -> str:
    lines = [f"{'pool':10s} {'prefill tok/s':>14s} {'decode tok/s':>13s}  (a 1,024-token prompt in the pool's "
             f"chunks; its full batch at 1,024 positions)"]
    lines += [f"{p['name']:10s} {p['prefill_tokens_per_s']:14.1f} {p['decode_tokens_per_s']:13.1f}"
              for p in result["pools"]]
    pre, dec = result["step_model"]["prefill"], result["step_model"]["decode"]
    lines.append(f"step model: prefill {pre['base_s'] * 1e3:.2f} ms + {pre['per_token_s'] * 1e6:.1f} us/token "
                 f"+ {pre['per_token_context_s'] * 1e9:.2f} ns/(token x key); decode {dec['base_s'] * 1e3:.2f} ms"
                 f" + {dec['per_token_s'] * 1e6:.1f} us/sequence + {dec['per_token_context_s'] * 1e9:.2f} ns/key")
    fit = result["fit_error"]
    if result["stored"] is None:
        lines.append(f"fit within {fit:.0%} of every measured step: too poor to store; run it again on a quiet host")
    else:
        lines.append(f"fit within {fit:.0%} of every measured step; stored as {result['stored']}")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    """Add ``calibrate`` to ``app``."""

    @app.command("calibrate", help=HELP, short_help="Measure the CPU pool's step times for a model on this host "
                                                      "and store the step-time model 'weave serve' predicts with.")
    def calibrate(
        model: ModelOpt = None,
        profile: ProfileOpt = None,
        data_dir: Annotated[str | None, typer.Option("--data-dir", metavar="<path>",
                                                     help="Where the calibration is stored (default: the "
                                                          "profile's data directory).",
                                                     show_default=False)] = None,
        json: JsonOpt = False,
    ) -> None:
        say = partial(say_line, err=json)  # (with --json, stdout holds the JSON alone)
        import dataclasses

        from weaved.cli.serve import resolve_model

        from weaved.calibration.store import CalibrationStore
        from weaved.config.load import load_profile
        from weaved.config.tables import ProfileError
        from weaved.daemon.data_lock import data_dir_owner
        from weaved.daemon.pools import build_pools
        from weaved.daemon.rates import FIT_LIMIT, calibration_of
        from weaved.kv.store import model_fingerprint
        from weaved.model.default import cache_dir
        from weaved.model.loader import open_model

        try:
            prof = load_profile(profile)
        except ProfileError as e:  # the --profile given: bad usage
            typer.echo(printable(f"weave: error: {e}"), err=True)
            raise typer.Exit(2) from None
        if data_dir is not None and not data_dir.strip():  # (an empty $VAR: not the current directory)
            typer.echo("weave: error: --data-dir is empty: name a directory, or leave the option out for the "
                       "profile's", err=True)
            raise typer.Exit(2)
        where = Path(data_dir).expanduser() if data_dir is not None else prof.host.data_dir
        try:  # (before minutes of measuring: a result that cannot be stored is refused now)
            where.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            typer.echo(printable(f"weave: error: cannot make the data directory {where}: {e.strerror or e}; pass "
                                 "another --data-dir"), err=True)
            raise typer.Exit(2) from None
        owner = data_dir_owner(where)
        if owner is not None:  # measuring beside a serving daemon measures the daemon's load too
            who = f"a daemon (pid {owner})" if owner else "a daemon"
            say(f"note: {who} is serving from {where}: its work shares the cores this measures, and it "
                 f"uses the new rates from its next start")
        path = resolve_model(model, err=json)
        gguf, cfg = open_model(path)
        cpu_cfgs = [p for p in prof.pools if p.backend == "cpu" and p.strategy == "standard"]
        if not cpu_cfgs:
            typer.echo("weave: error: the profile has no CPU pool to calibrate", err=True)
            raise typer.Exit(1)
        only_cpu = dataclasses.replace(prof, pools=tuple(cpu_cfgs))
        pools, _ = build_pools(only_cpu, gguf, cfg, commit=lambda *a: None, reserve=lambda *a: None,
                               on_event=lambda *a: None, progress=say)
        store = CalibrationStore(where, cache_dir() / "calibration")
        cal = calibration_of(next(iter(pools.values())).backend, model_fingerprint(cfg),
                             max(p.config.prefill_chunk for p in pools.values()),
                             max(p.config.max_batch for p in pools.values()), store, say, force=True)
        rows = []
        for p in pools.values():
            prefill, decode = cal.rates(p.config.prefill_chunk, p.config.max_batch)
            rows.append({"name": p.name, "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode})

        def part(f) -> dict:
            return {"base_s": f.base, "per_token_s": f.per_token, "per_token_context_s": f.per_token_context}

        mine = store.path(cal.key)
        stored = None if cal.fit_error > FIT_LIMIT else str(mine)  # (a poor fit serves one run, never stored)
        result = {"model": str(path), "pools": rows, "fit_error": cal.fit_error, "stored": stored,
                  "step_model": {"prefill": part(cal.cost.prefill), "decode": part(cal.cost.decode)}}
        if json:
            print_json(result)
        else:
            typer.echo(_text(result))
        if stored is not None and not mine.is_file():  # (the daemon reads the data directory's copy first)
            typer.echo(printable(f"weave: error: could not write {mine}; the rates above are not stored"), err=True)
            raise typer.Exit(1)
