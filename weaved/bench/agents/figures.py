"""The daemon's own figures at the end of a run: pools' counters, migrations, KV bytes by tier.

Read from ``daemon.status()`` taken when the run was closed (before shutdown).  Migrations come from
``status()["migrations"]`` (``{"count", "bytes", "seconds"}``); a daemon whose status does not report
them yet is read from its mover's counters instead, and a daemon with neither reports None - the
report prints "n/a" rather than a zero that would look like a measurement.
"""

from __future__ import annotations


def daemon_figures(status: dict, daemon=None) -> dict:
    pools = [{k: p.get(k) for k in ("name", "backend", "device", "steps", "tokens_generated", "tokens_prefilled",
                                    "preemptions")} for p in status.get("pools", [])]
    migrations, source = status.get("migrations"), "status"
    if migrations is None:
        counters = getattr(getattr(daemon, "mover", None), "counters", None)
        migrations, source = (counters.to_dict(), "mover") if counters is not None else (None, None)
    kv = status.get("kv") or {}
    return {
        "pools_figures": pools,
        "preemptions": sum(p.get("preemptions") or 0 for p in pools),
        "tokens_prefilled": sum(p.get("tokens_prefilled") or 0 for p in pools),
        "prefix_reused": ((kv.get("prefixes") or {}).get("reused_tokens")),
        "migrations": _migrations(migrations), "migrations_source": source,
        "kv": {k: kv.get(k) for k in ("file_bytes", "ram_bytes", "device_bytes", "ram_measured", "sessions")},
    }


def _migrations(m: dict | None) -> dict | None:
    if m is None:
        return None
    out = {"count": int(m.get("count", 0)), "bytes": int(m.get("bytes", 0)), "seconds": float(m.get("seconds", 0.0))}
    if "by_reason" in m:
        out["by_reason"] = dict(m["by_reason"])
    return out
