"""Running the bench's worker processes: a job file each, a deadline for all, every leftover killed.

Why processes: the kernel thread count is fixed when numba starts (``NUMBA_NUM_THREADS``), so the
compute part gets its own interpreter with the bench's threads, and the loopback part needs one
process per node anyway (one kernel thread each: two or three of them share this machine's cores,
which is the honest setting for a loopback ring on one host).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from weaved.bench.subprocs import run_processes

Say = Callable[[str], None]


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    return env


def run_workers(jobs: list[dict], names: list[str], threads: int, deadline_s: float, say: Say) -> list[dict]:
    """Start one worker per job, wait for all up to ``deadline_s``, kill the rest; each worker's
    result (``{"status": "error", ...}`` for one that wrote none)."""
    with tempfile.TemporaryDirectory(prefix="weave-ring-") as tmp:
        out = Path(tmp)
        cmds, logs = [], []
        for i, job in enumerate(jobs):
            job = {**job, "out": str(out), "port_file": str(out / "port")}
            (out / f"job{i}.json").write_text(json.dumps(job))
            cmds.append([sys.executable, "-m", "weaved.bench.ring.worker", str(out / f"job{i}.json")])
            logs.append(out / f"log{i}.txt")
        codes = run_processes(cmds, logs, deadline_s=deadline_s, env=_env(threads),
                              on_overdue=lambda i: say(f"a worker is still running after {deadline_s:.0f} s: "
                                                       "stopping it"))
        results = []
        for i, name in enumerate(names):
            f = out / name
            if f.exists():
                results.append(json.loads(f.read_text()))
            else:
                tail = (out / f"log{i}.txt").read_text(errors="replace")[-2000:]
                results.append({"status": "error", "error": f"the worker wrote no result (exit {codes[i]})",
                                "trace": tail})
        return results
