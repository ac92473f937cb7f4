"""Capacity: the largest number of background agents a configuration serves while at least the SLA
share (95 %) of the turns of every class meet their SLA.

Found by raising the agent count run by run: doubling from ``start`` until a run fails (or ``max_agents``
passes), then bisecting between the largest count that passed and the smallest that failed.  At most
``max_runs`` runs, so the search always ends; when it ends before the bisection closes, the result is a
lower bound and says so (``exact`` False).  The search assumes more agents never help, which holds for
the shares up to run-to-run noise: a noisy run near the edge moves the answer by a step, not more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Probe:
    agents: int
    passed: bool
    detail: dict = field(default_factory=dict)  # the run's per-class shares, limiting class, ...


@dataclass(frozen=True)
class CapacityResult:
    capacity: int  # the largest count that passed (0: even the smallest tried failed)
    failed_at: int | None  # the smallest count that failed (None: none did)
    max_agents: int
    probes: tuple[Probe, ...]

    @property
    def exact(self) -> bool:
        """The search closed: the next count up failed, or the first count (1) failed."""
        return self.failed_at is not None and self.failed_at - self.capacity <= 1

    @property
    def capped(self) -> bool:
        """Every count up to ``max_agents`` passed: the capacity is at least that."""
        return self.failed_at is None and self.capacity >= self.max_agents

    def label(self) -> str:
        if self.exact:
            return str(self.capacity)
        if self.capped:
            return f">={self.capacity} (max)"
        hi = f", <{self.failed_at}" if self.failed_at is not None else ""
        return f">={self.capacity}{hi} (runs ran out)"

    def to_dict(self) -> dict:
        return {"capacity": self.capacity, "exact": self.exact, "capped": self.capped, "failed_at": self.failed_at,
                "max_agents": self.max_agents, "label": self.label(),
                "runs": [{"agents": p.agents, "passed": p.passed, **p.detail} for p in self.probes]}


def search_capacity(run: Callable[[int], tuple[bool, dict]], *, start: int, max_agents: int,
                    max_runs: int) -> CapacityResult:
    """``run(n) -> (passed, detail)`` runs the workload with ``n`` agents."""
    if not 1 <= start <= max_agents or max_runs < 1:
        raise ValueError(f"need 1 <= start ({start}) <= max_agents ({max_agents}) and max_runs >= 1")
    lo, hi = 0, None  # largest count that passed, smallest that failed
    n = start
    probes: list[Probe] = []
    while len(probes) < max_runs:
        passed, detail = run(n)
        probes.append(Probe(n, passed, dict(detail)))
        if passed:
            lo = n
        else:
            hi = n
        if hi is None:
            if n >= max_agents:
                break
            n = min(2 * n, max_agents)
        else:
            if hi - lo <= 1:
                break
            n = (lo + hi) // 2
    return CapacityResult(lo, hi, max_agents, tuple(probes))


def relative(capacity: dict[str, CapacityResult], baseline: str) -> dict[str, float | None]:
    """Each configuration's capacity over ``baseline``'s (None when the baseline's is 0 or missing)."""
    base = capacity.get(baseline)
    if base is None or base.capacity == 0:
        return {name: None for name in capacity}
    return {name: round(c.capacity / base.capacity, 3) for name, c in capacity.items()}
