"""Runs the two sides of the benchmark in alternating rounds, each side in its own spawned process.

Why rounds: on a shared or virtual machine the speed available drifts by tens of percent over
minutes (measured here: the same build's single-stream decode at 137 and at 206 tokens/s in two
runs a few minutes apart, nothing else running).  Measuring all of one side and then all of the
other turns that drift into a fake ratio; alternating weave, llama.cpp, weave, ... and reporting
each side's median over the rounds exposes both sides to the same conditions.

Why processes: llama.cpp (its ggml thread pool) and numba (its own pool) would otherwise live in one
process, where idle spinning workers of one steal cores from the other, and the resident memory of
one would count in the other's figure.  A fresh ``spawn`` process per side starts clean (no
inherited thread pools, which ``fork`` could copy in a broken state) and exits before the next side
starts, so the two pools never exist at the same time.  The cost is a second interpreter start,
outside every timed region.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from weaved.bench import SIDES, BenchConfig
from weaved.bench.harness import Progress, filler_tokens, stderr_progress
from weaved.bench.report import build_report

# measure(side, cfg, tokens) -> {key: value}; the default runs the side in a subprocess.
Measure = Callable[[str, BenchConfig, Sequence[int]], dict[str, float]]

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def measure_side(side: str, cfg: BenchConfig, tokens: Sequence[int]) -> dict[str, float]:
    """Measure one side in this process (the subprocess's entry point)."""
    progress = stderr_progress(side)
    if side == "weave":
        from weaved.bench.weave_side import measure_weave

        return measure_weave(cfg, tokens, progress)
    if side == "llama_cpp":
        from weaved.bench.llama_side import measure_llama

        return measure_llama(cfg, tokens, progress)
    raise ValueError(f"unknown side {side!r}; expected one of {SIDES}")


@contextlib.contextmanager
def _thread_env(threads: int) -> Iterator[None]:
    """Environment a spawned child inherits: every library's pool sized to the thread budget."""
    saved = {k: os.environ.get(k) for k in _THREAD_VARS}
    os.environ.update({k: str(threads) for k in _THREAD_VARS})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure_in_subprocess(side: str, cfg: BenchConfig, tokens: Sequence[int]) -> dict[str, float]:
    """``measure_side`` in a fresh spawned process; its progress goes straight to our stderr."""
    with _thread_env(cfg.threads):
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            return pool.submit(measure_side, side, cfg, list(tokens)).result()


def _warn_if_busy(threads: int, progress: Progress) -> str | None:
    """Say so when other work already occupies the cores: llama.cpp's workers spin while they wait,
    so a loaded machine distorts its figures far more than Weave's.  (CPU use sampled over half a
    second, not the load average, which lags by a minute.)"""
    import psutil

    cpus = os.cpu_count() or 1
    busy = psutil.cpu_percent(interval=0.5) / 100.0 * cpus  # CPUs' worth of work running now
    if busy + threads > cpus + 0.5:
        warning = (f"{busy:.1f} of {cpus} CPUs were busy before starting; with {threads} more threads "
                   f"the figures are unreliable")
        progress(f"warning: {warning}")
        return warning
    return None


def run_bench(
    cfg: BenchConfig,
    measure: Measure | None = None,
    tokens: Sequence[int] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Measure Weave and llama.cpp in ``cfg.rounds`` alternating rounds and build the report from each
    side's median over the rounds (see ``report``).

    A side that raises is reported as ``{"error": message}`` so the other side's figures survive.
    """
    progress = progress or stderr_progress("bench")
    busy = None
    if measure is None:
        measure = measure_in_subprocess
        busy = _warn_if_busy(cfg.threads, progress)
    if tokens is None:
        progress("tokenizing the filler prompts")
        tokens = filler_tokens(cfg.model, cfg.tokens_needed)
    rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for r in range(cfg.rounds):
        for side in SIDES:
            if rounds[side] and "error" in rounds[side][-1]:
                continue  # a side that failed once is not run again
            progress(f"round {r + 1}/{cfg.rounds}: measuring {side} ({', '.join(cfg.keys)})")
            try:
                rounds[side].append(dict(measure(side, cfg, tokens)))
            except BrokenProcessPool:
                rounds[side].append({"error": _crash_message(side)})
            except Exception as exc:  # noqa: BLE001 - reported in the output, the other side still runs
                rounds[side].append({"error": f"{type(exc).__name__}: {exc}"})
                progress(f"{side} failed: {rounds[side][-1]['error']}")
    results = {side: _median_over_rounds(rs) for side, rs in rounds.items()}
    report = build_report(str(cfg.model), cfg.threads, results["weave"], results["llama_cpp"])
    if busy is not None:  # (in the report too: a script reading --json sees why the figures are off)
        report["warnings"] = [busy]
    return report


def _crash_message(side: str) -> str:
    """What to say when a side's process died (a signal, not an exception): for llama.cpp, whether its
    build carries the AMX kernels that crash on some machines, and how to rebuild it without them."""
    msg = "its process crashed (killed by a signal) while measuring"
    if side != "llama_cpp":
        return msg
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode(errors="replace")
    except Exception:  # noqa: BLE001 - the hint is optional
        return msg
    if "AMX_INT8 = 1" in info:
        msg += ("; this llama-cpp-python was built with AMX kernels, which crash on some machines: "
                "rebuild it without them as the README's install command does (CMAKE_ARGS, --no-cache-dir "
                "--force-reinstall)")
    return msg


def _median_over_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each key's median over the rounds; a side that failed reports its error."""
    for r in rounds:
        if "error" in r:
            return r
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
