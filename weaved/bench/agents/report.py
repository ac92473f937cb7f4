"""The agents scenario's output as plain-text tables (``--json`` prints the report dict itself).

Report shape (``run_scenario``): ``{"scenario", "model", "threads", "gpu", "notice", "workload", "plan",
"configs": {name: run | {"unavailable"} | {"error"}}, "capacity": None | {...}}``; a run holds
``summary`` (metrics.summarize), ``preemptions``, ``migrations``, ``kv``, ``pools_figures``, ``replay``
(what the replay did) and ``errors`` (daemon messages met on the way).
"""

from __future__ import annotations

from weaved.bench.agents.records import SLA_CLASSES


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _num(v, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _bytes(v) -> str:
    if v is None:
        return "-"
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if v >= size:
            return f"{v / size:.1f}{unit}"
    return f"{v}B"


def _migrations(m: dict | None) -> str:
    if m is None:
        return "n/a"
    return f"{m['count']} / {_bytes(m['bytes'])} / {m['seconds']:.2f}s"


def format_table(report: dict) -> str:
    w = report["workload"]
    lines = [f"agents scenario  model {report['model']}  threads {report['threads'] or 'profile'}"]
    sim = report.get("simulated")
    if sim:
        lines += _simulated(sim)
    if report.get("notice"):
        lines.append(f"NOTE: {report['notice']}")
    lines.append(f"workload: {w['agents']} agents, {w['duration_s']:g} s, seed {w['seed']}; "
                 f"{w['checkins_per_min']:g} check-ins/min ({report['plan']['checkins']} planned); "
                 f"{w['batch_concurrency']} batch jobs at a time")
    lines.append("SLA met (met/judged; unfinished turns left out): background ttlt "
                 f"{w['background_ttlt_s']:g}s, interactive ttft {w['interactive_ttft_ms']:g}ms + ITL p99 "
                 f"{w['interactive_itl_p99_ms']:g}ms, batch ttlt {w['batch_ttlt_s']:g}s")
    lines.append("")
    head = f"{'config':14s} {'pools':8s} " + " ".join(f"{c:>17s}" for c in SLA_CLASSES)
    head += f" {'tok/s':>7s} {'preempt':>7s}  {'migrations n/bytes/s':22s} {'KV file/RAM/dev':>18s}"
    head += f" {'prefilled':>10s} {'reused':>8s}"
    lines.append(head)
    runs = {n: c for n, c in report["configs"].items() if "summary" in c}
    for name, c in runs.items():
        s = c["summary"]
        shares = []
        for cls in SLA_CLASSES:
            k = s["classes"][cls]
            shares.append(f"{_pct(k['share_met'])} ({k['met']}/{k['met'] + k['missed']})")
        kv = c["kv"]
        tiers = "/".join(_bytes(kv[k]) for k in ("file_bytes", "ram_bytes", "device_bytes"))
        lines.append(f"{name:14s} {'+'.join(c['pools']):8s} " + " ".join(f"{x:>17s}" for x in shares)
                     + f" {_num(s['tokens_per_s'], '{:.1f}'):>7s} {c['preemptions']:>7d}  "
                     f"{_migrations(c['migrations']):22s} "
                     f"{tiers:>18s} {_num(c.get('tokens_prefilled'), '{:.0f}'):>10s} "
                     f"{_num(c.get('prefix_reused'), '{:.0f}'):>8s}")
    lines += ["", _latency_header()]
    for name, c in runs.items():
        for cls in SLA_CLASSES:
            k = c["summary"]["classes"][cls]
            lines.append(f"{name:14s} {cls:12s} {k['turns']:>5d} {k['met']:>4d} {k['missed']:>6d} "
                         f"{k['unfinished']:>6d} "
                         f"{_num(k['ttft_p50_ms']):>9s} {_num(k['ttft_p99_ms']):>9s} {_num(k['itl_p50_ms']):>8s} "
                         f"{_num(k['itl_p99_ms']):>8s}")
    lines += _notes(report)
    if report.get("capacity") is not None:
        lines += ["", *_capacity(report["capacity"])]
    spec = report.get("speculative")
    if spec is not None:
        from weaved.bench.speculative import format_result

        lines += ["", f"speculative variant: failed - {spec['error']}" if "error" in spec else format_result(spec)]
    return "\n".join(lines)


def _simulated(sim: dict) -> list[str]:
    """The banner of a simulated report: what was simulated, and with which cost model."""
    host = sim["host"]
    gpus = ", ".join(f"{g['name']} ({g['mem_bw'] / 1e9:.0f} GB/s, {g['matmul_flops'] / 1e12:.0f} Tops, "
                     f"link {g['link_bw'] / 1e9:.0f} GB/s)" for g in host["gpus"]) or "none"
    cpu = host["cpu"] if isinstance(host["cpu"], str) else (
        f"{host['cpu']['name']}: {host['cpu']['threads']} threads x {host['cpu']['speed']:g} of a calibrated thread, "
        f"{host['cpu']['mem_bw'] / 1e9:.0f} GB/s")
    cal = sim["cpu_calibration"]
    return [f"SIMULATED (virtual time, no tokens computed): host {host['name']}, shape {sim['shape']}",
            f"  GPU: {gpus}",
            f"  CPU: {cpu}; from this host's calibration on {cal['measured_on']} ({cal['threads']} threads)",
            f"  {sim['claim']}"]


def _latency_header() -> str:
    return (f"{'config':14s} {'class':12s} {'turns':>5s} {'met':>4s} {'missed':>6s} {'unfin':>6s} "
            f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s}   (ms)")


def _notes(report: dict) -> list[str]:
    out: list[str] = []
    for name, c in report["configs"].items():
        if "unavailable" in c:
            out.append(f"{name}: not run - {c['unavailable']}")
        if "error" in c:
            out.append(f"{name}: failed - {c['error']}")
        if c.get("note"):
            out.append(f"{name}: {c['note']}")
        if "summary" in c:
            s, r = c["summary"], c["replay"]
            out.append(f"{name}: {s['turns']} turns, {s['compactions']} compactions, check-ins "
                       f"{r['checkins_started']} started / {r['checkins_done']} done, promotions {r['promotions']}, "
                       f"demotions {r['demotions']}; check-in wait p50/p99 {_num(s['checkin_wait_p50_s'], '{:.2f}')}/"
                       f"{_num(s['checkin_wait_p99_s'], '{:.2f}')} s")
            if c.get("migrations_source") == "mover":
                out.append(f"{name}: migrations read from the daemon's mover (status() does not report them yet)")
            for e in c.get("errors", [])[:3]:
                out.append(f"{name}: daemon said: {e}")
    return ["", *out] if out else []


def _capacity(cap: dict) -> list[str]:
    lines = [f"capacity: most agents with >= {100 * cap['share']:.0f}% of the turns of every class within SLA "
             f"(runs of {cap['duration_s']:g} s)"]
    budget = cap.get("background_ttlt_s")
    if budget is not None and cap["duration_s"] < budget:
        lines.append(f"  (runs shorter than the background budget, {budget:g} s, judge a background turn only once "
                     f"it ends: the turns a pool cannot finish go uncounted, so a pass here may not hold)")
    rel = cap["relative_to_fifo"]
    for name, c in cap["by_config"].items():
        runs = ", ".join(f"{r['agents']}:{'pass' if r['passed'] else 'fail'}"
                         + (f"({r['limiting_class']})" if not r["passed"] and r.get("limiting_class") else "")
                         for r in c["runs"])
        ratio = rel.get(name)
        vs = f"x{ratio:.2f} vs fifo" if ratio is not None else "vs fifo: n/a"
        if ratio is not None and not (c["exact"] and cap["by_config"]["fifo"]["exact"]):
            vs += " (of bounds)"  # a ratio of lower bounds says little
        lines.append(f"{name:10s} {c['label']:>22s}  {vs:28s} runs {runs}")
    if cap.get("weave_over_gpu_only") is not None:
        lines.append(f"co-execution (weave / gpu-only capacity): x{cap['weave_over_gpu_only']:.2f} "
                     f"(the seed claims nearly x1.5)")
    return lines
