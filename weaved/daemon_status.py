"""``/v1/status``: everything ``weave top`` shows, as one JSON-able dict."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weaved.daemon import Daemon


def _tps(engine, window_s: float = 10.0) -> float:
    now = time.monotonic()
    recent = [(t, n) for t, n in list(engine.tps_window) if now - t <= window_s]
    if not recent:
        return 0.0
    span = max(now - recent[0][0], 1e-3)
    return sum(n for _, n in recent) / span


def _gpus(d: Daemon) -> list[dict]:
    """The CUDA devices GPU pools run on (torch is already imported when there are any)."""
    devices = sorted({p.config.cuda_device for p in d.pools.values() if p.config.cuda_device is not None})
    if not devices:
        return []
    import torch

    out = []
    for i in devices:
        free, total = torch.cuda.mem_get_info(i)
        out.append({"index": i, "name": torch.cuda.get_device_name(i), "memory_total": total,
                    "memory_used": total - free})
    return out


def _hardware(d: Daemon) -> dict:
    import psutil

    vm = psutil.virtual_memory()
    return {
        "cpu_percent": psutil.cpu_percent(interval=None, percpu=True),
        "memory_total": vm.total,
        "memory_used": vm.total - vm.available,
        "rss": psutil.Process(os.getpid()).memory_info().rss,
        "gpus": _gpus(d),
    }


def _device_bytes(d: Daemon) -> int:
    """KV copies held by GPU pools' backends (each backend counted once)."""
    backends = {id(p.backend): p.backend for p in d.pools.values()}
    return sum(b.device_kv_bytes() for b in backends.values())


def _spec_counters(engine) -> dict:
    if getattr(engine, "speculative", None) is None:
        return {}
    c = engine.counters
    return {"speculative": {"drafted": c.drafted, "accepted": c.accepted, "verify_steps": c.verify_steps}}


def status_dict(d: Daemon) -> dict:
    pools = []
    for pool in d.pools.values():
        p, e = pool.config, pool.engine
        running, waiting = pool.turns()
        pools.append({
            "name": p.name, "backend": e.backend.name, "device": p.device, "strategy": p.strategy,
            "device_kind": pool.device_kind, "stand_in": pool.stand_in,
            "variant": {"speculative": p.speculative, "max_batch": p.max_batch, "prefill_chunk": p.prefill_chunk,
                        "token_budget": p.token_budget},
            "batch_depth": len(running), "queue_depth": len(waiting),
            "tokens_per_s": round(_tps(e), 2),
            "steps": e.counters.steps, "tokens_generated": e.counters.tokens_generated,
            "tokens_prefilled": e.counters.tokens_prefilled, "preemptions": e.counters.preemptions,
            **_spec_counters(e),
            **({"ring": e.backend.describe()} if p.strategy == "qring" else {}),
        })
    now = time.monotonic()
    sessions = []
    with d._lock:
        for s in d.sessions.values():
            t = s.turn
            running = t is not None and not t.status.done
            ttft = (t.first_token_at - t.arrival) if (t is not None and t.first_token_at) else None
            slack = (t.deadline(now) - now) if running else None
            tps = None
            if t is not None and t.first_token_at and len(t.generated) > 1:
                tps = (len(t.generated) - 1) / max((t.last_token_at or now) - t.first_token_at, 1e-6)
            sessions.append({
                "id": s.id, "class": s.sla.cls.value, "pool": s.pool, "kv_at": s.kv_at,
                "backend": d.engines[s.pool].backend.name if s.pool in d.engines else None,
                "context_tokens": s.context_tokens, "state": t.status.value if running else "idle",
                "tokens_per_s": round(tps, 2) if tps else None, "ttft_s": round(ttft, 4) if ttft else None,
                "deadline_slack_s": round(slack, 3) if slack is not None and slack != float("inf") else None,
                "reason": "; ".join(s.placement.reasons), "ephemeral": s.ephemeral,
            })
    return {
        "model": {"name": d.model_name, "path": str(d.model_path), "arch": d.config.arch,
                  "context_length": d.config.context_length},
        "profile": d.profile.name, "uptime_s": round(time.time() - d.started, 1),
        "pools": pools, "pool_notes": d.pool_notes, "sessions": sessions,
        "kv": {**d.store.tiers(), "device_bytes": _device_bytes(d)}, "hardware": _hardware(d),
        "peers": d.peers.list() if getattr(d, "peers", None) is not None else [],
        "migrations": d.mover.counters.to_dict() if hasattr(d, "mover") else None,
        # the groups this daemon serves for its peers' rings (it is their home's member)
        "groups": d.member_groups.status() if getattr(d, "member_groups", None) is not None else [],
    }
