"""Stepping a simulated daemon's engines in virtual time.

Each backend runs one step at a time (its pools share it, as for real); a backend with work starts its
next step when it is free, and the step takes what the cost model says (``SimBackend.forward``
advances the clock, so a step's tokens are stamped at its end).  Steps run in the order they start;
the driver returns to its caller - the replay, which submits turns and promotes sessions - at the
time the caller asked for, or at the end of the earliest turn that ended (``wake``), never before
every step that starts earlier has run: what the caller does at time T reaches only steps that start
at T or later.  Idle demotion runs every ``housekeeping_s`` of virtual time, as the daemon's
housekeeper thread would.

A step's time is the cost model's forward plus - with ``engine_time`` - the wall time the engine's own
work took around it here (scheduling, sampling, the journal's commits, events): the daemon's code runs
for real in the simulation, so its overhead is measured, not modelled.  Without it a run is exactly
reproducible (tests); with it, close to a real run on this host.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from weaved.sim.daemon import SimHost

MAX_STEPS = 50_000_000  # a bound on one call's loop; a sane run never comes near it
EPSILON_S = 1e-4  # a pass of an engine that ran no step still moves its backend on by this much


class Driver:
    def __init__(self, sim: SimHost, housekeeping_s: float = 5.0, engine_time: bool = True):
        self.sim = sim
        self.d = sim.daemon
        self.clock = sim.clock
        self.free_at: dict[int, float] = {}  # backend id -> when it can start its next step
        self.last_ran: dict[str, float] = {}  # engine -> when its last step ended (round robin on a backend)
        self.frontier = 0.0  # the caller's time: no step starts before it
        self.housekeeping_s = housekeeping_s
        self._next_housekeeping = housekeeping_s
        self.steps = 0
        self.engine_time = engine_time
        self.engine_s = 0.0  # the engines' own work, measured (what engine_time adds)

    def run_until(self, until: float, wake: Callable[[], float | None] = lambda: None) -> None:
        """Run every step that starts before ``until`` or before ``wake()`` (re-read after each step),
        then leave the clock at that time."""
        engines = self.d.engines
        for _ in range(MAX_STEPS):
            horizon = until
            w = wake()
            if w is not None:
                horizon = min(horizon, max(w, self.frontier))
            if self._next_housekeeping < horizon:
                horizon = self._next_housekeeping
            best = None
            for name, e in engines.items():
                if not e.has_work():
                    continue
                b = id(e.backend)
                key = (max(self.free_at.get(b, 0.0), self.frontier), self.last_ran.get(name, -1.0), name)
                if best is None or key < best[0]:
                    best = (key, b)
            if best is None or best[0][0] >= horizon:
                self.frontier = max(self.frontier, horizon)
                self.clock.set(self.frontier)
                if self.frontier >= self._next_housekeeping:
                    self._next_housekeeping += self.housekeeping_s
                    self.d.demote_idle(self.frontier)
                    continue
                return
            (t, _, name), b = best
            self.clock.set(t)
            wall = time.perf_counter()
            engines[name].run_once()
            wall = time.perf_counter() - wall
            end = self.clock.now()
            if self.engine_time:
                end += wall
                self.engine_s += wall
            end = max(end, t + EPSILON_S)
            self.free_at[b] = end
            self.last_ran[name] = end
            self.steps += 1
        raise RuntimeError(f"the simulation did not reach {until} s within {MAX_STEPS} steps")
