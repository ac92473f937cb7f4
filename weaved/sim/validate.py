"""How close the simulation is to the daemon: one workload replayed for real on this host's CPU pool and
simulated with this host's calibration, the figures side by side with their relative differences.

The bar is 15 % on the throughput and each class's TTFT p50 and p99, and 15 points on each class's SLA
share (a share is a percentage already: 5 % against 0 % is not "100 % off"); a class with few turns
(under 10 judged) is shown but not held to it - one turn moves its share by 10 points.
"""

from __future__ import annotations

BAR = 0.15
MIN_JUDGED = 10
CLASSES = ("background", "interactive", "batch")


def _rel(real: float | None, sim: float | None) -> float | None:
    if real is None or sim is None or max(abs(real), abs(sim)) == 0:
        return None
    return (sim - real) / max(abs(real), 1e-12)


def compare(real: dict, sim: dict) -> dict:
    """``real`` and ``sim``: one configuration's run (``summary`` as ``metrics.summarize`` gives it)."""
    rows = [{"metric": "tokens/s", "real": real["summary"]["tokens_per_s"], "sim": sim["summary"]["tokens_per_s"],
             "held": True}]
    for c in CLASSES:
        a, b = real["summary"]["classes"][c], sim["summary"]["classes"][c]
        judged = min(a["met"] + a["missed"], b["met"] + b["missed"])
        for key, name in (("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"), ("share_met", "SLA share")):
            rows.append({"metric": f"{c} {name}", "real": a[key], "sim": b[key], "held": judged >= MIN_JUDGED})
    for r in rows:
        share = r["metric"].endswith("SLA share")
        r["diff"] = (None if r["real"] is None or r["sim"] is None else r["sim"] - r["real"]) if share else \
            _rel(r["real"], r["sim"])
        r["points"] = share
        r["within"] = r["diff"] is not None and abs(r["diff"]) <= BAR
    held = [r for r in rows if r["held"] and r["diff"] is not None]
    return {"bar": BAR, "rows": rows, "passed": all(r["within"] for r in held), "held": len(held)}


def format_comparison(cmp: dict) -> str:
    lines = [f"simulation vs this host (bar {cmp['bar']:.0%}; classes with fewer than {MIN_JUDGED} judged turns "
             f"shown, not held to it)", f"{'metric':32s} {'real':>10s} {'simulated':>10s} {'diff':>8s}"]
    for r in cmp["rows"]:
        unit = "pt" if r["points"] else "%"
        diff = "-" if r["diff"] is None else f"{100 * r['diff']:+.1f}{unit}"
        mark = "" if not r["held"] else ("  ok" if r["within"] else "  OVER")
        lines.append(f"{r['metric']:32s} {_v(r['real']):>10s} {_v(r['sim']):>10s} {diff:>8s}{mark}")
    lines.append(f"{'within the bar' if cmp['passed'] else 'NOT within the bar'} on {cmp['held']} held figures")
    return "\n".join(lines)


def _v(x) -> str:
    return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) and x < 10 else f"{x:.1f}")
