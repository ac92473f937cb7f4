"""Room in a GPU pool's device KV: when a step or a promotion needs more blocks than the device's KV
pool has free, idle sessions holding device copies there are demoted first - the least urgent class
first, then the least recently active - until the blocks are free.  Their KV stays in their files (the
device copy was written through), so nothing is lost and nothing is recomputed; each demotion is a
``demotion`` event with reason ``device memory`` (and a ``migration`` event for the freed copy).  Only
when no idle session is left does the turn that needed the room fail, with a 503.
"""

from __future__ import annotations

import logging

from weaved.backends.base import Backend
from weaved.engine.sequence import SLARank
from weaved.routing.types import SLAClass

log = logging.getLogger("weave.daemon")

REASON = "device memory"
_RANK = {SLAClass.INTERACTIVE: SLARank.INTERACTIVE, SLAClass.BACKGROUND: SLARank.BACKGROUND,
         SLAClass.BATCH: SLARank.BATCH}


class DeviceRoom:
    """``Daemon.make_device_room`` (a mixin of the daemon: its lock, sessions, pools and ``demote``)."""

    def idle_device_bytes(self, backend: Backend) -> int:
        """Device KV that ``backend`` holds for idle sessions: room the router may count as free, since
        ``make_device_room`` takes it back when a step needs it (caller holds the daemon's lock)."""
        return sum(backend.device_kv_bytes_of(s.kv) for s in self.sessions.values()
                   if s.kv_at in self.pools and self.pools[s.kv_at].backend is backend and not s.busy)

    def make_device_room(self, backend: Backend, need_bytes: int) -> bool:
        """(an engine thread, holding no lock) Demote idle sessions whose KV ``backend`` holds until it
        has ``need_bytes`` free; whether it has them now."""
        with self._lock:
            idle = [(s, s.last_active) for s in self.sessions.values()
                    if s.kv_at in self.pools and self.pools[s.kv_at].backend is backend and s.settled]
        idle.sort(key=lambda e: (-_RANK[e[0].sla.cls], e[1]))
        for s, since in idle:
            free = backend.device_kv_free_bytes()
            if free is None or free >= need_bytes:
                break
            try:
                self.demote(s.id, reason=REASON, idle_since=since)  # (not if a turn started meanwhile)
            except Exception:  # e.g. deleted meanwhile: the next one
                log.exception("demoting %s for device memory failed", s.id)
        free = backend.device_kv_free_bytes()
        return free is not None and free >= need_bytes
