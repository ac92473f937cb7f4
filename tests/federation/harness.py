"""Start a federation test's members as processes on loopback and collect what each reports.

Each member is ``python -m tests.federation._worker JOB.json`` with its own rank; rank 0 hosts the
rendezvous store on a free port (port 0) and publishes it in a file the others read.  Every member
writes ``rank{r}.json`` (status ``ok`` / ``peerlost`` / ``error``) and whatever arrays its scenario
saves.  The harness waits for the members it expects to end, up to a deadline, then kills every
process still running, so a test always finishes even when a member hangs or dies.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from weaved.bench.subprocs import run_processes

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 180.0  # a busy 2-core host starting 3 interpreters with torch and numba


@dataclass
class Member:
    rank: int
    result: dict | None  # None: it wrote nothing (killed, crashed before the end)
    log: str
    returncode: int | None

    def arrays(self, out: Path) -> dict[str, np.ndarray]:
        f = out / f"rank{self.rank}.npz"
        return dict(np.load(f)) if f.exists() else {}


def run_members(tmp: Path, scenario: str, world: int, *, wait_for: list[int] | None = None,
                deadline_s: float = DEADLINE_S, **params) -> list[Member]:
    """Run ``scenario`` on ``world`` processes; ``wait_for`` lists the ranks expected to end by
    themselves (default all); the rest are killed once those have ended."""
    tmp.mkdir(parents=True, exist_ok=True)
    wait_for = list(range(world)) if wait_for is None else wait_for
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmds, logs = [], []
    for r in range(world):
        job = dict(params, scenario=scenario, rank=r, world=world, out=str(tmp), port_file=str(tmp / "port"))
        (tmp / f"job{r}.json").write_text(json.dumps(job))
        cmds.append([sys.executable, "-m", "tests.federation._worker", str(tmp / f"job{r}.json")])
        logs.append(tmp / f"rank{r}.log")
    codes = run_processes(cmds, logs, deadline_s=deadline_s, env=env, cwd=REPO, wait_for=wait_for)
    members = []
    for r, code in enumerate(codes):
        f = tmp / f"rank{r}.json"
        result = json.loads(f.read_text()) if f.exists() else None
        members.append(Member(r, result, (tmp / f"rank{r}.log").read_text(errors="replace"), code))
    return members


def describe(members: list[Member]) -> str:
    """Everything the members said, for an assertion message."""
    return "\n".join(f"--- rank {m.rank} rc={m.returncode} result={m.result}\n{m.log[-3000:]}" for m in members)


def softmax64(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) per row, from logits [n, vocab]."""
    p, q = softmax64(p_logits), softmax64(q_logits)
    return (p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))).sum(axis=-1)


def margin(logits: np.ndarray) -> float:
    """Top-1 minus top-2 logit of one row."""
    top = np.sort(logits.reshape(-1))[-2:]
    return float(top[1] - top[0])


def greedy_agree(ref_tokens: np.ndarray, ref_logits: np.ndarray, got_tokens: np.ndarray, tie: float = 0.3) -> bool:
    """Greedy continuations match, or first part where the reference's choice was a near-tie."""
    for t, (a, b) in enumerate(zip(ref_tokens, got_tokens, strict=True)):
        if a != b:
            return margin(ref_logits[t]) < tie
    return True
