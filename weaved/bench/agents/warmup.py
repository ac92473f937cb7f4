"""Warm a fresh daemon up before the run's clock starts.

The first forward of a backend can compile or load kernels (numba's cache; on the torch backend,
CUDA's lazy initialisation) - tens of seconds seen here once, which would land on whichever turn came
first and make the first configuration of a run look slower than the rest.  One short throwaway turn
per SLA class (background and batch go to the CPU pool, interactive to the GPU pool when the policy
has one) runs every pool the workload will use through prefill and decode, then the sessions are deleted.
"""

from __future__ import annotations

import threading

from weaved.bench.agents.agent_turns import greedy
from weaved.bench.agents.tokens import TokenPool
from weaved.routing.types import SLA, SLAClass

WARMUP_SLAS = (SLA(SLAClass.BACKGROUND), SLA(SLAClass.INTERACTIVE, 500.0), SLA(SLAClass.BATCH))


def warm_up(daemon, tokens: TokenPool, *, prompt: int = 300, generate: int = 4, timeout_s: float = 600.0) -> None:
    """Run the warm-up turns concurrently (so batched decode is warmed too) and wait for them (bounded)."""
    done: list[threading.Event] = []
    sids: list[str] = []
    try:
        for i, sla in enumerate(WARMUP_SLAS):
            sid = daemon.create_session(sla, max_context=prompt + generate + 32, prompt_tokens=prompt)["id"]
            sids.append(sid)
            ev = threading.Event()
            done.append(ev)
            daemon.start_turn(session_id=sid, prompt=tokens.take(prompt, "warmup", i), params=greedy(generate),
                              emit=lambda e, ev=ev: ev.set() if e.get("type") in ("done", "error") else None)
        for ev in done:
            if not ev.wait(timeout_s):
                raise TimeoutError(f"the warm-up turns did not finish in {timeout_s:g} s")
    finally:
        for sid in sids:
            try:
                daemon.delete_session(sid)
            except Exception:  # noqa: BLE001 - a leftover warm-up session only costs disk
                pass
