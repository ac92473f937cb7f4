"""The load's figures from its outcomes and samples, and their table."""

from __future__ import annotations

from collections import Counter

import numpy as np

from weaved.bench.load import SLAS
from weaved.bench.load.clients import Outcome


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def build(outcomes: list[Outcome], samples: list[tuple[float, float, int]], *, warmup_s: float, duration_s: float,
          batched_tps: float | None, clients: int, daemon_tokens: dict[str, float] | None = None,
          cores: dict[str, float] | None = None) -> dict:
    """Figures over what started after the warm-up: per class, outcomes by status, TTFT and latency
    percentiles, the share served within the class's SLA; overall, tokens per second against the engine's
    batched rate; the daemon's memory and descriptors at the end of the warm-up and at the end.
    ``daemon_tokens``: the daemon's own counts over the measured span, by kind (prompt, cached,
    completion): what the engine computed - the prompt tokens it fed (prompt less cached) and the tokens it
    generated - against the same batched rate.  ``cores``: the cores the daemon, the clients' process and
    nothing (idle) took over the same span - the batched rate had every core to itself."""
    measured = [o for o in outcomes if o.start >= warmup_s]
    classes = {}
    for cls in SLAS:
        mine = [o for o in measured if o.cls == cls]
        ok = [o for o in mine if o.status == "ok"]
        judged = [o for o in mine if o.status != "cancelled"]  # a deliberate cancel is neither
        classes[cls] = {
            "requests": len(mine), "by_status": dict(Counter(o.status for o in mine)),
            "ttft_p50_s": _pct([o.ttft_s for o in ok if o.ttft_s is not None], 50),
            "ttft_p99_s": _pct([o.ttft_s for o in ok if o.ttft_s is not None], 99),
            "latency_p50_s": _pct([o.latency_s for o in ok], 50),
            "latency_p99_s": _pct([o.latency_s for o in ok], 99),
            "within_sla": sum(o.within_sla for o in ok) / len(ok) if ok else None,
            # the target: every request served within its SLA or refused (503) - errors and late answers fail it
            "sla_or_503": (sum(o.within_sla for o in ok) + sum(o.status == "503" for o in judged)) / len(judged)
            if judged else None,
        }
    span = duration_s - warmup_s
    tokens = sum(o.tokens for o in measured if o.status in ("ok", "cancelled"))
    after = [s for s in samples if warmup_s <= s[0] <= duration_s]  # (not the idle daemon after the drain)
    memory = None
    if len(after) >= 2:
        (_, rss0, fd0), (_, rss1, fd1) = after[0], after[-1]
        memory = {"rss_mb_start": rss0, "rss_mb_end": rss1, "rss_growth": rss1 / rss0 - 1,
                  "fds_start": fd0, "fds_end": fd1, "fds_growth": fd1 / fd0 - 1,
                  "rss_mb_max": max(s[1] for s in after), "fds_max": max(s[2] for s in after)}
    errors = sum(1 for o in measured if o.status.startswith("error"))
    tps = tokens / span if span > 0 else 0.0
    engine = None
    if daemon_tokens is not None and span > 0:
        fed = max(0.0, daemon_tokens.get("prompt", 0.0) - daemon_tokens.get("cached", 0.0)) / span
        gen = daemon_tokens.get("completion", 0.0) / span
        engine = {"prompt_fed_per_s": fed, "generated_per_s": gen, "computed_per_s": fed + gen,
                  "vs_batched": (fed + gen) / batched_tps if batched_tps else None}
    return {"clients": clients, "duration_s": duration_s, "warmup_s": warmup_s, "classes": classes,
            "errors": errors, "error_kinds": dict(Counter(o.status for o in measured if o.status.startswith("error"))),
            "tokens_per_s": tps, "batched_tps": batched_tps,
            "vs_batched": tps / batched_tps if batched_tps else None, "engine": engine, "cores": cores,
            "memory": memory,
            "samples": [list(s) for s in samples]}


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_table(r: dict) -> str:
    lines = [f"{r['clients']} clients for {r['duration_s']:.0f} s (figures after a {r['warmup_s']:.0f} s warm-up)", "",
             f"{'class':<12} {'requests':>8} {'ok':>6} {'503':>5} {'cancel':>6} {'error':>5} "
             f"{'TTFT p50':>9} {'p99':>7} {'latency p50':>12} {'p99':>7} {'in SLA':>7} {'SLA|503':>8}"]
    for cls, c in r["classes"].items():
        st = c["by_status"]
        err = sum(v for k, v in st.items() if k.startswith("error"))
        lines.append(f"{cls:<12} {c['requests']:>8} {st.get('ok', 0):>6} {st.get('503', 0):>5} "
                     f"{st.get('cancelled', 0):>6} {err:>5} {_f(c['ttft_p50_s']):>9} {_f(c['ttft_p99_s']):>7} "
                     f"{_f(c['latency_p50_s']):>12} {_f(c['latency_p99_s']):>7} "
                     f"{_f(c['within_sla'], '{:.0%}'):>7} {_f(c['sla_or_503'], '{:.0%}'):>8}")
    batched = _f(r["batched_tps"], "{:.1f}")
    at = f" at {r['batched_batch']} sequences" if r.get("batched_batch") else ""
    lines += ["", f"generated {r['tokens_per_s']:.1f} tokens/s; the engine's batched rate{at} {batched} "
                  f"({_f(r['vs_batched'], '{:.0%}')})"]
    e = r.get("engine")
    if e:
        lines.append(f"the engine computed {e['computed_per_s']:.1f} tokens/s: {e['prompt_fed_per_s']:.1f} prompt "
                     f"tokens fed + {e['generated_per_s']:.1f} generated ({_f(e['vs_batched'], '{:.0%}')} of the "
                     f"batched rate)")
    c = r.get("cores")
    if c:
        lines.append(f"cores over the measured span: daemon {c['daemon']:.2f}, clients {c['clients']:.2f}, "
                     f"idle {c['idle']:.2f}")
    m = r["memory"]
    if m:
        lines.append(f"daemon: {m['rss_mb_start']:.0f} -> {m['rss_mb_end']:.0f} MB resident ({m['rss_growth']:+.1%}), "
                     f"{m['fds_start']} -> {m['fds_end']} open descriptors ({m['fds_growth']:+.1%})")
    if r["errors"]:
        lines.append(f"errors: {r['error_kinds']}")
    return "\n".join(lines)
