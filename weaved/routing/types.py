"""The router's vocabulary: what a session asks for (``SLA``, ``SessionRequest``), what the node looks
like now (``PoolState``, ``SystemState``) and what the router answers (``Placement``), plus the pool
queries the decision tree (``tree``) and the baseline policies (``baselines``) share.

Every type is a frozen dataclass that checks its fields when built, so a placement is never computed
from a malformed state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from weaved.calibration.cost import StepCost
from weaved.config.profile import PoolConfig


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

    def to_dict(self) -> dict[str, Any]:
        """The API's and the journal's shape: ``{"class", "ttft_ms", "ttlt_s"}``."""
        return {"class": self.cls.value, "ttft_ms": self.ttft_ms, "ttlt_s": self.ttlt_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SLA:
        """The inverse of ``to_dict`` (missing targets are None)."""
        return cls(SLAClass(d["class"]), d.get("ttft_ms"), d.get("ttlt_s"))


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
    context_tokens: int = 0  # positions the running and queued turns' sequences hold, summed
    step_cost: StepCost | None = None  # the backend's calibrated step-time model (``routing.predict``)
    step_s: float = 0.0  # the pool's recent mean step time while it holds turns (0: idle or unknown)
    lateness: float = 1.0  # its recent turns' times over their forecasts (``routing.predict``)
    device_kv_tokens: int = 0  # a GPU pool: the positions its device's KV pool holds in all (0: host KV)

    def __post_init__(self) -> None:
        if self.device_kind not in ("cpu", "gpu") or self.strategy not in ("standard", "qring"):
            raise ValueError(f"pool {self.name!r}: bad device_kind {self.device_kind!r} "
                             f"or strategy {self.strategy!r}")
        if not (isinstance(self.step_s, int | float) and math.isfinite(self.step_s) and self.step_s >= 0):
            raise ValueError(f"pool {self.name!r}: step_s must be a finite number >= 0, got {self.step_s!r}")
        _finite_positive(self.lateness, f"pool {self.name!r} lateness")
        if self.step_cost is not None and not isinstance(self.step_cost, StepCost):
            raise ValueError(f"pool {self.name!r}: step_cost must be a StepCost, got {self.step_cost!r}")
        for f in ("batch_depth", "queue_depth", "free_kv_tokens", "spec_max_concurrency",
                  "queued_prefill_tokens", "prefill_chunk", "context_tokens", "device_kv_tokens"):
            _count(getattr(self, f), f"pool {self.name!r} {f}")
        _count(self.max_batch, f"pool {self.name!r} max_batch", 1)

    @property
    def concurrency(self) -> int:
        return self.batch_depth + self.queue_depth

    @property
    def load(self) -> float:
        return self.concurrency / self.max_batch

    def has_room(self, kv_tokens: int, reserve: float = 0.0) -> bool:
        """A free batch slot and free KV for ``kv_tokens`` - leaving ``reserve`` of the device's KV free,
        on a GPU pool."""
        keep = int(reserve * self.device_kv_tokens)
        return self.concurrency < self.max_batch and self.free_kv_tokens - keep >= kv_tokens

    def describe(self) -> str:
        return (f"{self.name!r} ({self.batch_depth}/{self.max_batch} running, {self.queue_depth} queued, "
                f"{self.free_kv_tokens} KV tokens free)")


def pool_state(cfg: PoolConfig, *, free_kv_tokens: int, batch_depth: int = 0, queue_depth: int = 0,
               queued_prefill_tokens: int = 0, device_kind: str | None = None, context_tokens: int = 0,
               step_cost: StepCost | None = None, step_s: float = 0.0, lateness: float = 1.0,
               device_kv_tokens: int = 0) -> PoolState:
    """A PoolState from a profile's pool and its live counters.  ``device_kind`` defaults to "gpu" for a
    pool on a cuda device; pass "gpu" to let a torch pool on the CPU stand in for one (tests, benches)."""
    return PoolState(
        name=cfg.name, backend=cfg.backend, strategy=cfg.strategy, speculative=cfg.speculative,
        device_kind=device_kind or ("cpu" if cfg.cuda_device is None else "gpu"),
        batch_depth=batch_depth, queue_depth=queue_depth, free_kv_tokens=free_kv_tokens,
        max_batch=cfg.max_batch, spec_max_concurrency=cfg.spec_max_concurrency,
        queued_prefill_tokens=queued_prefill_tokens, prefill_chunk=cfg.prefill_chunk,
        context_tokens=context_tokens, step_cost=step_cost, step_s=step_s, lateness=lateness,
        device_kv_tokens=device_kv_tokens,
    )


@dataclass(frozen=True)
class SystemState:
    pools: tuple[PoolState, ...]
    peers_alive: int  # federated peers answering health checks that serve this model
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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        """The inverse of ``to_dict``."""
        return cls(**{**d, "reasons": tuple(d.get("reasons", ()))})

    def to_dict(self) -> dict[str, Any]:
        return {"prefill_strategy": self.prefill_strategy, "decode_strategy": self.decode_strategy,
                "prefill_pool": self.prefill_pool, "decode_pool": self.decode_pool,
                "priority": self.priority, "reasons": list(self.reasons)}


# --- pool choice: queries over a SystemState, shared by the decision tree and the baselines --------

def pools_of(state: SystemState, kind: str, strategy: str = "standard") -> list[PoolState]:
    """The pools of ``state`` with ``strategy`` on devices of ``kind`` ("cpu", "gpu" or "any")."""
    return [p for p in state.pools if p.strategy == strategy and (kind == "any" or p.device_kind == kind)]


def by_load(pools: list[PoolState], plain_first: bool = False) -> list[PoolState]:
    """Least loaded first, then most free KV; non-speculative pools first when ``plain_first``
    (throughput work leaves the speculative variant to latency-sensitive sessions)."""
    return sorted(pools, key=lambda p: (plain_first and p.speculative, p.load, -p.free_kv_tokens, p.name))


def least_loaded(pools: list[PoolState], plain_first: bool = False) -> PoolState | None:
    """The first of ``by_load``, or None."""
    ordered = by_load(pools, plain_first)
    return ordered[0] if ordered else None


def with_room(pools: list[PoolState], need: int, plain_first: bool = False) -> PoolState | None:
    """The least loaded of ``pools`` with a free slot and KV for ``need`` tokens, or None."""
    return least_loaded([p for p in pools if p.has_room(need)], plain_first)
