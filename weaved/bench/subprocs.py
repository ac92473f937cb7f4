"""Running a set of worker processes under one deadline: each with its log file, every one still running
at the deadline killed, nothing left behind.  Used where several processes play the nodes of a ring or
a pipeline on one host (the ring benchmark, the federation tests)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def run_processes(cmds: list[list[str]], logs: list[Path], *, deadline_s: float, env: dict[str, str] | None = None,
                  cwd: str | Path | None = None, wait_for: list[int] | None = None,
                  on_overdue: Callable[[int], None] | None = None) -> list[int | None]:
    """Start every command (stdout and stderr to its log), wait up to ``deadline_s`` in all for those in
    ``wait_for`` (default: all), then kill whatever still runs.  Returns each process's exit code (negative:
    killed by that signal).  ``on_overdue(i)`` is told about each awaited process that missed the deadline."""
    wait_for = list(range(len(cmds))) if wait_for is None else wait_for
    procs, files = [], []
    try:
        for cmd, log in zip(cmds, logs, strict=True):
            f = open(log, "w")  # closed below, after the process has ended
            files.append(f)
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT))
        end = time.monotonic() + deadline_s
        for i in wait_for:
            try:
                procs[i].wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                if on_overdue is not None:
                    on_overdue(i)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        for f in files:
            f.close()
    return [p.returncode for p in procs]
