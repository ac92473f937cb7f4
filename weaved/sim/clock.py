"""Virtual time for the simulator: a number that moves only when told to."""

from __future__ import annotations


class VirtualClock:
    """Seconds since the simulation's start.  ``now`` reads it (pass the bound method wherever the
    daemon takes a clock); backends move it on with ``advance`` (a step's duration) and the driver
    sets it to when the next step starts with ``set`` - which may be before where the last step of
    another backend left it: backends run side by side, and each step is run whole when it starts."""

    def __init__(self, start: float = 0.0):
        self.t = float(start)

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time does not go back ({seconds} s)")
        self.t += seconds

    def set(self, t: float) -> None:
        if t < 0:
            raise ValueError(f"a simulation starts at 0 s, not {t}")
        self.t = float(t)
