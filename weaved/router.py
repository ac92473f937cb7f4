"""The router: how and where a session runs (DESIGN.md §7, the whitepaper's routing tree made concrete).

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

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from weaved.profile import PoolConfig, RoutingThresholds

__all__ = ["SLAClass", "SLA", "SessionRequest", "PoolState", "SystemState", "Placement", "RoutingError",
           "RoutingThresholds", "PRIORITY", "TOP_PRIORITY", "place", "promote", "pool_state",
           "predict_cpu_ttft_s"]


class SLAClass(StrEnum):
    INTERACTIVE = "interactive"
    BACKGROUND = "background"
    BATCH = "batch"


# Engine priorities: higher runs first.  An order between classes, not a tunable threshold.
PRIORITY = {SLAClass.BATCH: 0, SLAClass.BACKGROUND: 1, SLAClass.INTERACTIVE: 2}
TOP_PRIORITY = max(PRIORITY.values())


class RoutingError(Exception):
    """The node cannot serve this session; the message says why and what would make it work."""


def _finite_positive(v: float | None, what: str) -> None:
    number = isinstance(v, int | float) and not isinstance(v, bool)
    if v is not None and not (number and math.isfinite(v) and v > 0):
        raise ValueError(f"{what} must be a positive number or None, got {v!r}")


def _count(v: int, what: str, low: int = 0) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {v!r}")


@dataclass(frozen=True)
class SLA:
    cls: SLAClass
    ttft_ms: float | None = None  # time-to-first-token target of a turn
    ttlt_s: float | None = None  # time-to-last-token budget of a turn (the engine's deadline)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "cls", SLAClass(self.cls))
        except ValueError:
            names = [c.value for c in SLAClass]
            raise ValueError(f"SLA class must be one of {names}, got {self.cls!r}") from None
        _finite_positive(self.ttft_ms, "ttft_ms")
        _finite_positive(self.ttlt_s, "ttlt_s")


@dataclass(frozen=True)
class SessionRequest:
    sla: SLA
    prompt_tokens: int  # tokens to prefill now (for a live session: its current context)
    max_context: int | None = None  # the context the session expects to reach, if the caller knows

    def __post_init__(self) -> None:
        if not isinstance(self.sla, SLA):
            raise ValueError(f"sla must be an SLA, got {self.sla!r}")
        _count(self.prompt_tokens, "prompt_tokens")
        if self.max_context is not None:
            _count(self.max_context, "max_context", 1)

    @property
    def context_tokens(self) -> int:
        """The most KV the session is expected to need."""
        return max(self.prompt_tokens, self.max_context or 0)


@dataclass(frozen=True)
class PoolState:
    """One pool as the engine sees it now."""

    name: str
    backend: str  # "cpu" | "torch"
    device_kind: str  # "cpu" | "gpu"
    strategy: str  # "standard" | "qring"
    speculative: bool
    batch_depth: int  # sequences in the running batch
    queue_depth: int  # sequences admitted but waiting
    free_kv_tokens: int  # KV the pool can still give to sessions
    max_batch: int
    spec_max_concurrency: int = 0  # the speculative variant's threshold (from the pool's profile entry)
    queued_prefill_tokens: int = 0  # prompt tokens waiting in the queue ahead of a new session
    prefill_chunk: int = 0  # prompt tokens per sequence per step; 0: a prompt prefills in one step

    def __post_init__(self) -> None:
        if self.device_kind not in ("cpu", "gpu") or self.strategy not in ("standard", "qring"):
            raise ValueError(f"pool {self.name!r}: bad device_kind {self.device_kind!r} "
                             f"or strategy {self.strategy!r}")
        for f in ("batch_depth", "queue_depth", "free_kv_tokens", "spec_max_concurrency",
                  "queued_prefill_tokens", "prefill_chunk"):
            _count(getattr(self, f), f"pool {self.name!r} {f}")
        _count(self.max_batch, f"pool {self.name!r} max_batch", 1)

    @property
    def concurrency(self) -> int:
        return self.batch_depth + self.queue_depth

    @property
    def load(self) -> float:
        return self.concurrency / self.max_batch

    def has_room(self, kv_tokens: int) -> bool:
        """A free batch slot and free KV for ``kv_tokens``."""
        return self.concurrency < self.max_batch and self.free_kv_tokens >= kv_tokens

    def describe(self) -> str:
        return (f"{self.name!r} ({self.batch_depth}/{self.max_batch} running, {self.queue_depth} queued, "
                f"{self.free_kv_tokens} KV tokens free)")


def pool_state(cfg: PoolConfig, *, free_kv_tokens: int, batch_depth: int = 0, queue_depth: int = 0,
               queued_prefill_tokens: int = 0, device_kind: str | None = None) -> PoolState:
    """A PoolState from a profile's pool and its live counters.  ``device_kind`` defaults to "gpu" for a
    pool on a cuda device; pass "gpu" to let a torch pool on the CPU stand in for one (tests, benches)."""
    return PoolState(
        name=cfg.name, backend=cfg.backend, strategy=cfg.strategy, speculative=cfg.speculative,
        device_kind=device_kind or ("cpu" if cfg.cuda_device is None else "gpu"),
        batch_depth=batch_depth, queue_depth=queue_depth, free_kv_tokens=free_kv_tokens,
        max_batch=cfg.max_batch, spec_max_concurrency=cfg.spec_max_concurrency,
        queued_prefill_tokens=queued_prefill_tokens, prefill_chunk=cfg.prefill_chunk,
    )


@dataclass(frozen=True)
class SystemState:
    pools: tuple[PoolState, ...]
    peers_alive: int  # federated peers answering health checks
    ring_batch_depth: int  # decode sessions sharing the Q-Ring across the federation now
    node_kv_tokens: int  # the most context this node holds (its KV cap / the model's KV bytes per token)
    pipeline_possible: bool  # peers with capacity to fill a prefill pipeline

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(self.pools))
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        _count(self.peers_alive, "peers_alive")
        _count(self.ring_batch_depth, "ring_batch_depth")
        _count(self.node_kv_tokens, "node_kv_tokens", 1)
        if self.pipeline_possible and self.peers_alive == 0:
            raise ValueError("pipeline_possible needs at least one live peer")


@dataclass(frozen=True)
class Placement:
    prefill_strategy: str  # "standard" | "pipeline"
    decode_strategy: str  # "standard" | "qring"
    prefill_pool: str  # pool running the prefill (for a pipeline: this node's stage)
    decode_pool: str
    priority: int  # higher runs first (PRIORITY)
    reasons: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"prefill_strategy": self.prefill_strategy, "decode_strategy": self.decode_strategy,
                "prefill_pool": self.prefill_pool, "decode_pool": self.decode_pool,
                "priority": self.priority, "reasons": list(self.reasons)}


# --- pool choice ----------------------------------------------------------------------------------

def _of(state: SystemState, kind: str, strategy: str = "standard") -> list[PoolState]:
    return [p for p in state.pools if p.strategy == strategy and (kind == "any" or p.device_kind == kind)]


def _least_loaded(pools: list[PoolState], plain_first: bool = False) -> PoolState | None:
    """Least loaded, then most free KV; non-speculative pools first when ``plain_first`` (throughput work
    leaves the speculative variant to latency-sensitive sessions)."""
    key = lambda p: (plain_first and p.speculative, p.load, -p.free_kv_tokens, p.name)
    return min(pools, key=key, default=None)


def _with_room(pools: list[PoolState], need: int, plain_first: bool = False) -> PoolState | None:
    return _least_loaded([p for p in pools if p.has_room(need)], plain_first)


def _gpu_for_latency(state: SystemState, need: int, reasons: list[str]) -> PoolState | None:
    room = [p for p in _of(state, "gpu") if p.has_room(need)]
    spec = [p for p in room if p.speculative and p.concurrency < p.spec_max_concurrency]
    if spec:
        g = _least_loaded(spec)
        assert g is not None
        reasons.append(f"speculative variant {g.describe()}: concurrency {g.concurrency} < its threshold "
                       f"{g.spec_max_concurrency}")
        return g
    g = _least_loaded(room, plain_first=True)
    if g is not None:
        busy = " (speculative variants are at their concurrency threshold)" if any(
            p.speculative for p in _of(state, "gpu")) else ""
        reasons.append(f"GPU pool {g.describe()}{busy}")
    return g


def _cpu(state: SystemState, need: int, reasons: list[str] | None) -> PoolState:
    """The CPU pool with room, else the least loaded one (queued), else any standard pool.  The choice
    is explained in ``reasons`` unless that is None (the caller explains it)."""
    cpus = _of(state, "cpu")
    c = _with_room(cpus, need)
    if c is None:
        c = _least_loaded(cpus) or _least_loaded(_of(state, "any"), plain_first=True)
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


def predict_cpu_ttft_s(pool: PoolState, prompt_tokens: int, th: RoutingThresholds) -> float:
    """Seconds until the first token on a CPU pool: the queued prompts and this one at the pool's prefill
    rate, plus the decode tokens the running batch takes in each step the prefill spans."""
    tokens = pool.queued_prefill_tokens + prompt_tokens
    steps = math.ceil(tokens / pool.prefill_chunk) if pool.prefill_chunk else 1
    return tokens / th.cpu_prefill_tokens_per_s + steps * pool.batch_depth / th.cpu_decode_tokens_per_s


def _needs_latency(sla: SLA, prefill_tokens: int, need: int, state: SystemState, th: RoutingThresholds,
                   reasons: list[str]) -> bool:
    if sla.cls is SLAClass.INTERACTIVE:
        reasons.append("interactive: latency-sensitive")
        return True
    if sla.ttft_ms is None:
        return False
    c = _with_room(_of(state, "cpu"), need) or _least_loaded(_of(state, "cpu"))
    if c is None:
        reasons.append(f"TTFT target {sla.ttft_ms:g} ms and no CPU pool: latency path")
        return True
    ms = predict_cpu_ttft_s(c, prefill_tokens, th) * 1000.0
    ok = ms <= sla.ttft_ms * th.ttft_margin
    reasons.append(f"TTFT target {sla.ttft_ms:g} ms: CPU pool {c.name!r} predicts {ms:.0f} ms, "
                   f"{'within' if ok else 'over'} {th.ttft_margin:.0%} of the target")
    return not ok


# --- the decision tree ----------------------------------------------------------------------------

def _node_limit(state: SystemState, th: RoutingThresholds) -> int:
    if th.node_kv_tokens is None:
        return state.node_kv_tokens
    return min(th.node_kv_tokens, state.node_kv_tokens)


def _ring(state: SystemState) -> PoolState | None:
    """The Q-Ring pool to join, if peers are alive to form a ring."""
    return _least_loaded(_of(state, "any", "qring")) if state.peers_alive > 0 else None


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
    gpu = _with_room(_of(state, "gpu"), need, plain_first=True)
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
    why = "every GPU pool is full" if _of(state, "gpu") else "no GPU pool on this host"
    where = repr(pool.name) if pool is local else pool.describe()
    reasons.append(f"long prompt ({req.prompt_tokens} tokens) but {why}: prefill on {where}")
    return "standard", pool.name


def _latency(req: SessionRequest, state: SystemState, reasons: list[str]) -> Placement:
    need = max(1, req.prompt_tokens)
    g = _gpu_for_latency(state, need, reasons)
    if g is not None:
        return Placement("standard", "standard", g.name, g.name, PRIORITY[req.sla.cls], tuple(reasons))
    if _of(state, "gpu"):
        reasons.append("every GPU pool is full: the CPU pool at top priority instead")
    else:
        reasons.append("no GPU pool on this host: the CPU pool at top priority")
    c = _cpu(state, need, reasons)
    return Placement("standard", "standard", c.name, c.name, TOP_PRIORITY, tuple(reasons))


def _throughput(req: SessionRequest, state: SystemState, th: RoutingThresholds,
                reasons: list[str]) -> Placement:
    need = max(1, req.prompt_tokens)
    reasons.append(f"{req.sla.cls.value}: throughput-tolerant")
    ring = _ring(state)
    cpu = _with_room(_of(state, "cpu"), need)
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
                       f"with {state.peers_alive} peer(s)")
    else:
        decode, strategy = _cpu(state, need, reasons), "standard"
    prefill_strategy, prefill_pool = _prefill(req, state, th, decode, reasons)
    return Placement(prefill_strategy, strategy, prefill_pool, decode.name, PRIORITY[req.sla.cls],
                     tuple(reasons))


def _beyond_node(req: SessionRequest, state: SystemState, th: RoutingThresholds, limit: int) -> Placement:
    ctx = req.context_tokens
    reasons = [f"context up to {ctx} tokens exceeds what this node holds ({limit} tokens): Q-Ring decode, "
               f"whatever the class"]
    if state.peers_alive == 0:
        raise RoutingError(
            f"the session needs up to {ctx} tokens of context but this node holds at most {limit}; Q-Ring "
            f"decode would spread its KV across peers, but no peer is alive. Federate peers ([[peers]] in "
            f"the profile), raise the node's KV cap, or ask for a smaller max_context.")
    ring = _ring(state)
    if ring is None:
        raise RoutingError(
            f"the session needs up to {ctx} tokens of context but this node holds at most {limit}, and this "
            f"node has no Q-Ring pool to spread it across its {state.peers_alive} peer(s); add a "
            f'[[pools]] table with strategy = "qring" to the profile.')
    reasons.append(f"Q-Ring decode on {ring.name!r} with {state.peers_alive} peer(s)")
    if req.sla.cls is SLAClass.INTERACTIVE:
        reasons.append("interactive: no latency-optimised distributed decode exists, "
                       "so top priority in the ring")
        need = max(1, req.prompt_tokens)
        g = _with_room(_of(state, "gpu"), need, plain_first=True)
        pool = g or _cpu(state, need, None)
        reasons.append(f"prefill on {pool.describe()} for latency")
        return Placement("standard", "qring", pool.name, ring.name, TOP_PRIORITY, tuple(reasons))
    prefill_strategy, prefill_pool = _prefill(req, state, th, ring, reasons)
    return Placement(prefill_strategy, "qring", prefill_pool, ring.name, PRIORITY[req.sla.cls],
                     tuple(reasons))


def place(req: SessionRequest, state: SystemState, thresholds: RoutingThresholds) -> Placement:
    """Place a new session.  Pure: the same inputs always give the same placement."""
    if thresholds.policy != "sla":  # a benchmark baseline (weaved.router_baselines)
        from weaved.router_baselines import place_fifo, place_isolated

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
        from weaved.router_baselines import keep_isolated

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
        why = "every GPU pool is full" if _of(state, "gpu") else "no GPU pool on this host"
        return stay(TOP_PRIORITY, f"{why}: priority raised to {TOP_PRIORITY} within {here.describe()} "
                                  f"instead")
    if here.device_kind == "cpu":
        return stay(prio, f"stays on {here.describe()} at priority {prio}")
    c = _with_room(_of(state, "cpu"), need)
    if c is not None:
        reasons.append(f"moves from GPU pool {here.name!r} to CPU pool {c.describe()}, freeing the GPU (its "
                       f"KV is written back to the session's file)")
        return Placement("standard", "standard", c.name, c.name, prio, tuple(reasons))
    return stay(prio, f"no CPU pool has room: stays on GPU pool {here.name!r} at priority {prio}")
