"""The router's decision tree: how and where a session runs (docs/architecture.md, "Routing").

``place`` is a pure function of its inputs (no I/O, no clock, no global state): it returns a
``Placement`` (prefill and decode strategy, the pools that run them, a priority, and the reasons in
plain words) in microseconds, or raises ``RoutingError`` when the node cannot serve the session at all.

1. A context (``max_context`` or the prompt) larger than one node holds -> Q-Ring decode across the
   peers, whatever the class; no peers -> RoutingError.
2. Interactive, or a TTFT target the CPU pool is predicted to miss -> standard prefill and decode on a
   GPU pool (its speculative variant while that pool's concurrency is below the variant's threshold).
   No GPU pool, or every GPU pool full -> the CPU pool at top priority.
3. Background and batch -> short prompts: a CPU pool.  Long prompts: prefill on a GPU pool, or a
   pipeline across peers when one can be filled, then decode on a CPU pool (the pipeline gathers the
   KV here) or on the Q-Ring (it scatters the KV into the ring's shards).  Q-Ring decode when the
   ring's batch depth reaches its threshold.

Every number comes from ``RoutingThresholds`` (the profile's [routing] table); none is a constant here.
``promote`` re-evaluates a live session whose SLA changed (promotion or demotion).
"""

from __future__ import annotations

from weaved.config.profile import RoutingThresholds
from weaved.routing.baselines import keep_isolated, place_fifo, place_isolated
from weaved.routing.predict import predict_ttft_s, predict_ttlt_s
from weaved.routing.types import (
    PRIORITY,
    SLA,
    TOP_PRIORITY,
    Placement,
    PoolState,
    RoutingError,
    SessionRequest,
    SLAClass,
    SystemState,
    by_load,
    least_loaded,
    pools_of,
    with_room,
)


def _gpu_for_latency(state: SystemState, need: int, reasons: list[str]) -> PoolState | None:
    room = [p for p in pools_of(state, "gpu") if p.has_room(need)]
    spec = [p for p in room if p.speculative and p.concurrency < p.spec_max_concurrency]
    if spec:
        g = least_loaded(spec)
        assert g is not None
        reasons.append(f"speculative variant {g.describe()}: concurrency {g.concurrency} < its threshold "
                       f"{g.spec_max_concurrency}")
        return g
    g = least_loaded(room, plain_first=True)
    if g is not None:
        busy = " (speculative variants are at their concurrency threshold)" if any(
            p.speculative for p in pools_of(state, "gpu")) else ""
        reasons.append(f"GPU pool {g.describe()}{busy}")
    return g


def _cpu(state: SystemState, need: int, reasons: list[str] | None) -> PoolState:
    """The CPU pool with room, else the least loaded one (queued), else any standard pool.  The choice
    is explained in ``reasons`` unless that is None (the caller explains it)."""
    cpus = pools_of(state, "cpu")
    c = with_room(cpus, need)
    if c is None:
        c = least_loaded(cpus) or least_loaded(pools_of(state, "any"), plain_first=True)
    if c is None:
        raise RoutingError("no pool with the standard strategy in this node's state; the profile needs one")
    if reasons is None:
        return c
    if c.has_room(need) and c.device_kind == "cpu":
        reasons.append(f"CPU pool {c.describe()}")
        return c
    reasons.append(f"no CPU pool has room: queued on {c.describe()}" if c.device_kind == "cpu"
                   else f"no CPU pool on this host: {c.describe()}")
    return c


def _needs_latency(sla: SLA, prefill_tokens: int, need: int, state: SystemState, th: RoutingThresholds,
                   reasons: list[str]) -> bool:
    if sla.cls is SLAClass.INTERACTIVE:
        reasons.append("interactive: latency-sensitive")
        return True
    if sla.ttft_ms is None:
        return False
    c = with_room(pools_of(state, "cpu"), need) or least_loaded(pools_of(state, "cpu"))
    if c is None:
        reasons.append(f"TTFT target {sla.ttft_ms:g} ms and no CPU pool: latency path")
        return True
    ms = predict_ttft_s(c, prefill_tokens, th) * 1000.0
    ok = ms <= sla.ttft_ms * th.ttft_margin
    reasons.append(f"TTFT target {sla.ttft_ms:g} ms: CPU pool {c.name!r} predicts {ms:.0f} ms, "
                   f"{'within' if ok else 'over'} {th.ttft_margin:.0%} of the target")
    return not ok


# --- the decision tree ----------------------------------------------------------------------------

def _node_limit(state: SystemState, th: RoutingThresholds) -> int:
    if th.node_kv_tokens is None:
        return state.node_kv_tokens
    return min(th.node_kv_tokens, state.node_kv_tokens)


def _raise_limit(state: SystemState, th: RoutingThresholds) -> str:
    """Which setting the node's limit comes from, as advice: the profile's own figure when it is the lower."""
    if th.node_kv_tokens is not None and th.node_kv_tokens < state.node_kv_tokens:
        return "raise the profile's [routing] node_kv_tokens"
    return "raise the node's KV cap ([host] kv_cap_bytes)"


def _ring(state: SystemState) -> PoolState | None:
    """The Q-Ring pool to join, if peers are alive to form a ring."""
    return least_loaded(pools_of(state, "any", "qring")) if state.peers_alive > 0 else None


def _prefill(req: SessionRequest, state: SystemState, th: RoutingThresholds, decode: PoolState,
             reasons: list[str]) -> tuple[str, str]:
    """(prefill strategy, pool) for a throughput-tolerant session whose decode runs on ``decode``."""
    need = max(1, req.prompt_tokens)
    local = decode if decode.strategy == "standard" else None
    if req.prompt_tokens < th.long_prompt_tokens:
        pool = local or _cpu(state, need, None)
        where = repr(pool.name) if pool is local else pool.describe()
        reasons.append(f"short prompt ({req.prompt_tokens} < {th.long_prompt_tokens} tokens): "
                       f"prefill on {where}")
        return "standard", pool.name
    gpu = with_room(pools_of(state, "gpu"), need, plain_first=True)
    if state.pipeline_possible and req.prompt_tokens >= th.pipeline_min_prompt_tokens:
        stage = gpu or local or _cpu(state, need, None)
        reasons.append(f"long prompt ({req.prompt_tokens} >= {th.pipeline_min_prompt_tokens} tokens) fills a "
                       f"pipeline across {state.peers_alive} peer(s): pipeline prefill, this node's stage on "
                       f"{stage.describe()}")
        return "pipeline", stage.name
    if state.pipeline_possible:
        reasons.append(f"prompt too short to fill a pipeline ({req.prompt_tokens} < "
                       f"{th.pipeline_min_prompt_tokens} tokens)")
    if gpu is not None:
        reasons.append(f"long prompt ({req.prompt_tokens} >= {th.long_prompt_tokens} tokens): prefill on GPU "
                       f"pool {gpu.describe()}, then its KV goes to the decode pool")
        return "standard", gpu.name
    pool = local or _cpu(state, need, None)
    why = "every GPU pool is full" if pools_of(state, "gpu") else "no GPU pool on this host"
    where = repr(pool.name) if pool is local else pool.describe()
    reasons.append(f"long prompt ({req.prompt_tokens} tokens) but {why}: prefill on {where}")
    return "standard", pool.name


def _latency(req: SessionRequest, state: SystemState, reasons: list[str]) -> Placement:
    need = max(1, req.prompt_tokens)
    g = _gpu_for_latency(state, need, reasons)
    if g is not None:
        return Placement("standard", "standard", g.name, g.name, PRIORITY[req.sla.cls], tuple(reasons))
    if pools_of(state, "gpu"):
        reasons.append("every GPU pool is full: the CPU pool at top priority instead")
    else:
        reasons.append("no GPU pool on this host: the CPU pool at top priority")
    c = _cpu(state, need, reasons)
    return Placement("standard", "standard", c.name, c.name, TOP_PRIORITY, tuple(reasons))


def budget_s(sla: SLA, th: RoutingThresholds) -> float:
    """A throughput-tolerant turn's TTLT budget: its SLA's, else its class's default."""
    return sla.ttlt_s or (th.batch_ttlt_s if sla.cls is SLAClass.BATCH else th.background_ttlt_s)


def _cpu_too_slow(sla: SLA, prompt_tokens: int, cpu: PoolState, state: SystemState, th: RoutingThresholds,
                  reasons: list[str], answer_tokens: int | None = None, context: int = 0) -> bool:
    """Whether a throughput-tolerant turn would miss its TTLT budget on ``cpu`` (the budget the SLA names,
    else its class's default) while the host has a GPU pool - throughput-tolerant is not "never"."""
    if not pools_of(state, "gpu"):
        return False
    budget = budget_s(sla, th)
    answer = th.answer_tokens if answer_tokens is None else answer_tokens
    s = predict_ttlt_s(cpu, prompt_tokens, answer, th, context)
    if s <= budget * th.ttft_margin:
        return False
    reasons.append(f"CPU pool {cpu.name!r} predicts {s:.0f} s for a turn ({prompt_tokens} prompt + "
                   f"{answer} answer tokens), over {th.ttft_margin:.0%} of its {budget:g} s budget")
    return True


def _throughput(req: SessionRequest, state: SystemState, th: RoutingThresholds,
                reasons: list[str]) -> Placement:
    need = max(1, req.prompt_tokens)
    reasons.append(f"{req.sla.cls.value}: throughput-tolerant")
    ring = _ring(state)
    cpu = with_room(pools_of(state, "cpu"), need)
    if cpu is not None and _cpu_too_slow(req.sla, req.prompt_tokens, cpu, state, th, reasons):
        g = with_room(pools_of(state, "gpu"), need, plain_first=True)
        if g is not None:
            reasons.append(f"decode on GPU pool {g.describe()}")
            return Placement("standard", "standard", g.name, g.name, PRIORITY[req.sla.cls], tuple(reasons))
        reasons.append("no GPU pool has room: the CPU pool all the same")
    if ring is not None and state.ring_batch_depth >= th.ring_batch_depth:
        decode, strategy = ring, "qring"
        reasons.append(f"Q-Ring decode on {ring.name!r}: the ring batches {state.ring_batch_depth} sessions "
                       f"(>= {th.ring_batch_depth})")
    elif cpu is not None:
        decode, strategy = cpu, "standard"
        reasons.append(f"decode on CPU pool {cpu.describe()}")
    elif ring is not None:
        decode, strategy = ring, "qring"
        reasons.append(f"no CPU pool has room: Q-Ring decode on {ring.name!r} "
                       f"across the {state.peers_alive} live peer(s)")
    else:
        decode, strategy = _cpu(state, need, reasons), "standard"
    prefill_strategy, prefill_pool = _prefill(req, state, th, decode, reasons)
    return Placement(prefill_strategy, strategy, prefill_pool, decode.name, PRIORITY[req.sla.cls],
                     tuple(reasons))


def spill_targets(state: SystemState, need: int, th: RoutingThresholds) -> list[PoolState]:
    """The GPU pools a throughput-tolerant turn needing ``need`` positions may spill to, least loaded
    first: a free batch slot, and KV beyond the ``gpu_interactive_reserve`` kept for interactive sessions."""
    return by_load([p for p in pools_of(state, "gpu") if p.has_room(need, th.gpu_interactive_reserve)],
                   plain_first=True)


def place_turn(current: Placement, sla: SLA, prompt_tokens: int, context: int, answer_tokens: int,
               state: SystemState, th: RoutingThresholds) -> Placement | None:
    """Where the next turn of a live throughput-tolerant session runs, when not where it is (None: stays).

    The turn feeds ``prompt_tokens`` after ``context`` positions, then ``answer_tokens``.  A session
    decoding on a CPU pool predicted to finish the turn past its TTLT budget (with the pool's load now)
    spills to a GPU pool with room (beyond the ``gpu_interactive_reserve`` of its device KV, which stays
    free for interactive sessions); a session a GPU pool holds returns to a CPU pool predicted to finish
    it well within the budget (``return_share`` of the margin): the CPU takes the throughput work it
    can, the GPU what it cannot.  Interactive sessions, Q-Ring sessions and the baselines stay.
    """
    if th.policy != "sla" or sla.cls is SLAClass.INTERACTIVE or current.decode_strategy != "standard":
        return None
    here = next((p for p in state.pools if p.name == current.decode_pool), None)
    if here is None:
        return None
    need = context + prompt_tokens + answer_tokens
    reasons = [f"{sla.cls.value} turn: {prompt_tokens} prompt tokens after {context}, {answer_tokens} to answer"]
    if here.device_kind == "cpu":
        if not _cpu_too_slow(sla, prompt_tokens, here, state, th, reasons, answer_tokens, context):
            return None
        targets = spill_targets(state, need, th)
        if not targets:  # none has room beyond what it keeps for interactive sessions
            return None
        g = targets[0]
        reasons.append(f"spills to GPU pool {g.describe()}: one host-to-device KV copy")
        return Placement("standard", "standard", g.name, g.name, current.priority, tuple(reasons))
    c = with_room(pools_of(state, "cpu"), need)
    if c is None:
        return None
    budget = budget_s(sla, th)
    s = predict_ttlt_s(c, prompt_tokens, answer_tokens, th, context)
    if s > budget * th.ttft_margin * th.return_share:
        return None
    reasons.append(f"CPU pool {c.describe()} predicts {s:.1f} s, within {th.ttft_margin * th.return_share:.0%} of its "
                   f"{budget:g} s budget: back on the CPU, freeing the GPU (nothing is copied: its rows are in "
                   f"its file)")
    return Placement("standard", "standard", c.name, c.name, current.priority, tuple(reasons))


def _beyond_node(req: SessionRequest, state: SystemState, th: RoutingThresholds, limit: int) -> Placement:
    ctx = req.context_tokens
    reasons = [f"context up to {ctx} tokens exceeds what this node holds ({limit} tokens): Q-Ring decode, "
               f"whatever the class"]
    if state.peers_alive == 0:
        raise RoutingError(
            f"the session needs up to {ctx} tokens of context but this node holds at most {limit}; Q-Ring "
            f"decode would spread its KV across peers, but no peer serving this model is alive (weave peers "
            f"lists them). Federate peers that serve it ([[peers]] in the profile), {_raise_limit(state, th)}, "
            f"or ask for a smaller max_context.")
    ring = _ring(state)
    if ring is None:
        raise RoutingError(
            f"the session needs up to {ctx} tokens of context but this node holds at most {limit}, and this "
            f"node has no Q-Ring pool to spread it across its {state.peers_alive} peer(s); add a "
            f'[[pools]] table with strategy = "qring" to the profile.')
    reasons.append(f"Q-Ring decode on {ring.name!r} across the {state.peers_alive} live peer(s)")
    if req.sla.cls is SLAClass.INTERACTIVE:
        reasons.append("interactive: no latency-optimised distributed decode exists, "
                       "so top priority in the ring")
        need = max(1, req.prompt_tokens)
        g = with_room(pools_of(state, "gpu"), need, plain_first=True)
        pool = g or _cpu(state, need, None)
        reasons.append(f"prefill on {pool.describe()} for latency")
        return Placement("standard", "qring", pool.name, ring.name, TOP_PRIORITY, tuple(reasons))
    prefill_strategy, prefill_pool = _prefill(req, state, th, ring, reasons)
    return Placement(prefill_strategy, "qring", prefill_pool, ring.name, PRIORITY[req.sla.cls],
                     tuple(reasons))


def place(req: SessionRequest, state: SystemState, thresholds: RoutingThresholds) -> Placement:
    """Place a new session.  Pure: the same inputs always give the same placement."""
    if thresholds.policy != "sla":  # a benchmark baseline (weaved.routing.baselines)
        return place_fifo(req, state) if thresholds.policy == "fifo" else place_isolated(req, state)
    limit = _node_limit(state, thresholds)
    if req.context_tokens > limit:
        return _beyond_node(req, state, thresholds, limit)
    reasons: list[str] = []
    need = max(1, req.prompt_tokens)
    if _needs_latency(req.sla, req.prompt_tokens, need, state, thresholds, reasons):
        return _latency(req, state, reasons)
    return _throughput(req, state, thresholds, reasons)


def promote(current: Placement, req: SessionRequest, state: SystemState, thresholds: RoutingThresholds,
            turn_tokens: int = 0) -> Placement:
    """Re-evaluate a live session whose SLA changed to ``req.sla`` (a promotion or a demotion).

    ``req.prompt_tokens`` is the session's context now (it must fit where the session goes);
    ``turn_tokens`` the prompt of the turn it runs next (what a TTFT target is predicted for).  A Q-Ring
    session stays bound to its ring (its KV shards live on the ring's nodes) and only changes priority.
    A standard session moves between this node's CPU and GPU pools when the destination has room (one KV
    copy, nothing recomputed); when it has none, the session stays and only its priority changes.
    """
    if thresholds.policy != "sla":  # the baselines never move a session nor change its priority
        return keep_isolated(current, req)
    pools = {p.name: p for p in state.pools}
    here = pools.get(current.decode_pool)
    if here is None:
        raise RoutingError(f"the session's pool {current.decode_pool!r} is not in this node's state")
    cls, prio = req.sla.cls, PRIORITY[req.sla.cls]
    reasons = [f"SLA changed to {cls.value}"]
    if current.decode_strategy == "qring":
        prio = TOP_PRIORITY if cls is SLAClass.INTERACTIVE else prio
        reasons.append(f"Q-Ring decode stays bound to {here.name!r} (its KV shards live on the ring's "
                       f"nodes): priority {prio} within the ring")
        return Placement("standard", "qring", current.prefill_pool, here.name, prio, tuple(reasons))
    need = max(1, req.prompt_tokens)
    stay = lambda p, why: Placement("standard", "standard", here.name, here.name, p, (*reasons, why))
    if _needs_latency(req.sla, turn_tokens, need, state, thresholds, reasons):
        if here.device_kind == "gpu":
            return stay(prio, f"already on GPU pool {here.name!r}")
        g = _gpu_for_latency(state, need, reasons)
        if g is not None:
            reasons.append(f"migrates from {here.name!r} to GPU pool {g.name!r}: one host-to-device KV copy, "
                           f"nothing recomputed")
            return Placement("standard", "standard", g.name, g.name, prio, tuple(reasons))
        why = "every GPU pool is full" if pools_of(state, "gpu") else "no GPU pool on this host"
        done = "raised to" if current.priority < TOP_PRIORITY else "kept at the highest,"
        return stay(TOP_PRIORITY, f"{why}: priority {done} {TOP_PRIORITY} within {here.describe()} instead")
    if here.device_kind == "cpu":
        return stay(prio, f"stays on {here.describe()} at priority {prio}")
    c = with_room(pools_of(state, "cpu"), need)
    if c is not None and _cpu_too_slow(req.sla, turn_tokens, c, state, thresholds, reasons):
        return stay(prio, f"stays on GPU pool {here.name!r} at priority {prio}")
    if c is not None:
        reasons.append(f"moves from GPU pool {here.name!r} to CPU pool {c.describe()}, freeing the GPU (its "
                       f"KV is already in the session's file: nothing is copied)")
        return Placement("standard", "standard", c.name, c.name, prio, tuple(reasons))
    return stay(prio, f"no CPU pool has room: stays on GPU pool {here.name!r} at priority {prio}")
