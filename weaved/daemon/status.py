"""``/v1/status``: everything ``weave top`` shows, as JSON-able dicts.

Each function here describes one part (a pool, a session, the host's hardware) from the objects
themselves; ``Daemon.status`` assembles them, holding its session lock while it reads the sessions.
"""

from __future__ import annotations

import os

from weaved.daemon.pools import Pool
from weaved.daemon.session import Session


def _tps(engine, window_s: float = 10.0) -> float:
    """Tokens a second over the last ``window_s``: the steps' ends are known, not their starts, so the
    first step in the window only opens the span (its tokens came before it)."""
    now = engine.now()
    recent = [(t, n) for t, n in list(engine.tps_window) if now - t <= window_s]
    if len(recent) < 2:
        return 0.0
    span = max(now - recent[0][0], 1e-3)
    return sum(n for _, n in recent[1:]) / span


def _gpus(pools: list[Pool]) -> list[dict]:
    """The devices GPU pools run on, as their backends describe them (each backend once)."""
    backends = {id(p.backend): p.backend for p in pools if p.device_kind == "gpu"}
    out = [info for b in backends.values() if (info := b.device_info()) is not None]
    return sorted(out, key=lambda g: g.get("index", 0))


def hardware_status(pools: list[Pool]) -> dict:
    """CPU load, memory, this process's resident size and the GPU pools' devices."""
    import psutil

    vm = psutil.virtual_memory()
    return {
        "cpu_percent": psutil.cpu_percent(interval=None, percpu=True),
        "memory_total": vm.total,
        "memory_used": vm.total - vm.available,
        "rss": psutil.Process(os.getpid()).memory_info().rss,
        "gpus": _gpus(pools),
    }


def device_kv_bytes(pools: list[Pool]) -> int:
    """KV copies held by GPU pools' backends (each backend counted once)."""
    backends = {id(p.backend): p.backend for p in pools}
    return sum(b.device_kv_bytes() for b in backends.values())


def device_kv_free_bytes(pools: list[Pool]) -> int | None:
    """Device KV still free in GPU pools' backends (each counted once); None without any."""
    backends = {id(p.backend): p.backend for p in pools}
    free = [f for f in (b.device_kv_free_bytes() for b in backends.values()) if f is not None]
    return sum(free) if free else None


def _spec_counters(engine) -> dict:
    if getattr(engine, "speculative", None) is None:
        return {}
    c = engine.counters
    return {"speculative": {"drafted": c.drafted, "accepted": c.accepted, "verify_steps": c.verify_steps}}


def pool_status(pool: Pool) -> dict:
    """One pool: its variant, what runs and waits in it, its rates and counters."""
    p, e = pool.config, pool.engine
    running, waiting = pool.turns()
    return {
        "name": p.name, "backend": e.backend.name, "device": p.device, "strategy": p.strategy,
        "device_kind": pool.device_kind, "stand_in": pool.stand_in,
        "variant": {"speculative": p.speculative, "max_batch": p.max_batch, "prefill_chunk": p.prefill_chunk,
                    "token_budget": p.token_budget},
        "batch_depth": len(running), "queue_depth": len(waiting),
        "tokens_per_s": round(_tps(e), 2),
        "steps": e.counters.steps, "tokens_generated": e.counters.tokens_generated,
        "tokens_prefilled": e.counters.tokens_prefilled, "preemptions": e.counters.preemptions,
        **_spec_counters(e),
        # how long its steps run against its calibrated step model (engine.step_drift; 1.0 as calibrated)
        **({"step_model_scale": round(e.step_drift.factor, 3)} if e.config.step_cost is not None else {}),
        **({"ring": e.backend.describe()} if p.strategy == "qring" else {}),
        **({"device_memory": plan.to_dict()} if (plan := getattr(e.backend, "device_plan", None)) else {}),
    }


def session_status(s: Session, pools: dict[str, Pool], now: float) -> dict:
    """One session: where it is, its state, its turn's rates and deadline slack (``now``: monotonic)."""
    t = s.turn
    running = t is not None and not t.status.done
    ttft = (t.first_token_at - t.arrival) if (t is not None and t.first_token_at) else None
    slack = (t.deadline(now) - now) if running else None
    tps = None
    if t is not None and t.first_token_at and len(t.generated) > 1:
        tps = (len(t.generated) - 1) / max((t.last_token_at or now) - t.first_token_at, 1e-6)
    return {
        "id": s.id, "class": s.sla.cls.value, "pool": s.pool, "kv_at": s.kv_at,
        "backend": pools[s.pool].backend.name if s.pool in pools else None,
        "context_tokens": s.context_tokens, "state": t.status.value if running else "idle",
        # a prompt being fed: tokens fed so far, of those its cached prefix did not cover
        "prefill": {"done": t.prefilled, "total": t.prefilled + len(t.pending)}
        if running and t.prefilling and t.prefilled else None,
        "tokens_per_s": round(tps, 2) if tps else None, "ttft_s": round(ttft, 4) if ttft else None,
        "deadline_slack_s": round(slack, 3) if slack is not None and slack != float("inf") else None,
        "reason": "; ".join(s.placement.reasons), "ephemeral": s.ephemeral,
    }


def kernel_status(at_load, serving) -> dict:
    """What numba compiled (``weaved.daemon.warmup.CompileWatch``s, None when not watched): in the
    load of this process, and since - a compilation while serving is a request that waited for it."""
    return {"compiled_at_load": at_load.kernels if at_load else 0,
            "compile_s_at_load": round(at_load.seconds, 1) if at_load else 0.0,
            "compiled_while_serving": serving.kernels if serving else 0}
