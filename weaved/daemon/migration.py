"""Moving a session between pools: its KV changes backend, nothing is recomputed.

The session's file (its ``KVCache`` array) is the one copy every backend agrees on.  Leaving a GPU
pool releases the device copy (the torch backend wrote every row through to the file as it computed
it, so nothing is left to write); entering one adopts the file's rows with one host-to-device copy.
Two pools on one backend (the GPU's speculative and plain variants) share the device copy, so a move
between them copies nothing.

A running turn moves at a step boundary: the source engine hands the sequence over (``detach`` or a
prefill ``handoff``) and it continues in the destination engine with its sampler, pending token and
stream intact.  Each move with bytes to copy is an event (``/v1/events``) and is counted for
``/v1/status`` and ``/metrics``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from weaved.daemon.pools import Pool
from weaved.kv.cache import KVCache


@dataclass
class MigrationCounters:
    count: int = 0  # moves that changed backend
    bytes: int = 0  # bytes copied between memories
    seconds: float = 0.0
    by_reason: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"count": self.count, "bytes": self.bytes, "seconds": round(self.seconds, 6),
                "by_reason": dict(self.by_reason)}


class Mover:
    def __init__(self, publish: Callable[[str, dict], None], clock: Callable[[], float] = time.perf_counter):
        """``clock`` times the copies (a simulation's virtual clock, which its backends advance by them)."""
        self._publish = publish
        self._clock = clock
        self._lock = threading.Lock()
        self.counters = MigrationCounters()

    def move_kv(self, session_id: str, kv: KVCache, src: Pool | None, dst: Pool | None, reason: str) -> int:
        """Move ``kv`` from ``src``'s backend to ``dst``'s; returns bytes copied.  ``src`` None: the KV is
        only in its file (a restart, or after a release); ``dst`` None: it goes back to the file only
        (the device copy is freed).  Waits for at most one step of each backend (their locks), never
        holding both.  A move from the file that copies nothing (a new session's first turn) is not a
        migration and is not counted."""
        if src is not None and dst is not None and src.backend is dst.backend:
            return 0
        nbytes, dt, n_tokens = 0, 0.0, kv.length
        for pool, op in ((src, "release"), (dst, "adopt")):
            if pool is None:
                continue
            with pool.lock:  # the lock waits for a step in flight; only the copies are timed
                t0 = self._clock()
                nbytes += getattr(pool.backend, op)(kv)
                dt += self._clock() - t0
                n_tokens = kv.length  # the rows this copy moved (a step may append more once unlocked)
        if src is not None or nbytes:
            self._record(session_id, src, dst, nbytes, n_tokens, reason, dt)
        return nbytes

    def _record(self, session_id: str, src: Pool | None, dst: Pool | None, nbytes: int, n_tokens: int,
                reason: str, dt: float) -> None:
        with self._lock:
            c = self.counters
            c.count += 1
            c.bytes += nbytes
            c.seconds += dt
            c.by_reason[reason] = c.by_reason.get(reason, 0) + 1
        self._publish("migration", {"session": session_id, "from": src.name if src else "file",
                                    "to": dst.name if dst else "file",
                                    "from_backend": src.backend.name if src else "file",
                                    "to_backend": dst.backend.name if dst else "file",
                                    "bytes": nbytes, "seconds": round(dt, 6), "kv_tokens": n_tokens,
                                    "reason": reason})
