"""The two baseline policies the agents benchmark compares Weave's router with (docs/benchmarks.md).

- ``isolation``: the same pools, but a session is bound to a pool by its class when it is created and
  never moves; a change of SLA (a check-in) changes neither its pool nor its priority.  Interactive
  sessions go to a GPU pool when the host has one, everything else to a CPU pool.
- ``fifo``: every session in one continuous-batching pool (the profile's first standard pool), one
  priority, served first come first served (the engine orders by arrival).

Both are pure functions like ``weaved.routing.tree.place`` and are reached through it (``policy`` in the
profile's ``[routing]`` table).
"""

from __future__ import annotations

from weaved.routing.types import (
    PRIORITY,
    Placement,
    PoolState,
    RoutingError,
    SessionRequest,
    SLAClass,
    SystemState,
    least_loaded,
    pools_of,
    with_room,
)

FIFO_PRIORITY = 0  # one priority for everyone: the engine falls back to arrival order


def _standard(state: SystemState) -> list[PoolState]:
    pools = [p for p in state.pools if p.strategy == "standard"]
    if not pools:
        raise RoutingError("no pool with the standard strategy in this node's state; the profile needs one")
    return pools


def place_fifo(req: SessionRequest, state: SystemState) -> Placement:
    pool = _standard(state)[0]
    return Placement("standard", "standard", pool.name, pool.name, FIFO_PRIORITY,
                     (f"policy fifo: every session in pool {pool.name!r}, first come first served",))


def place_isolated(req: SessionRequest, state: SystemState) -> Placement:
    need = max(1, req.prompt_tokens)
    cls = req.sla.cls
    kind = "gpu" if cls is SLAClass.INTERACTIVE and pools_of(state, "gpu") else "cpu"
    pools = pools_of(state, kind) or _standard(state)
    pool = with_room(pools, need, plain_first=kind == "cpu") or least_loaded(pools)
    assert pool is not None
    why = f"policy isolation: {cls.value} sessions are bound to the {kind.upper()} pool {pool.name!r}"
    return Placement("standard", "standard", pool.name, pool.name, PRIORITY[cls], (why,))


def keep_isolated(current: Placement, req: SessionRequest) -> Placement:
    why = (f"SLA changed to {req.sla.cls.value}; policy isolation: the session stays in pool "
           f"{current.decode_pool!r} at priority {current.priority}")
    return Placement(current.prefill_strategy, current.decode_strategy, current.prefill_pool, current.decode_pool,
                     current.priority, (why,))
