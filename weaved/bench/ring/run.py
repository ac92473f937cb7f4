"""The ring bench end to end: the compute worker, then the loopback workers, then one report."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

from weaved.bench.ring import RingBenchOptions
from weaved.bench.ring.cost_model import Rates, Shape, projection
from weaved.bench.ring.procs import run_workers
from weaved.bench.ring.sizes import HeadGroup, transfer_s

Say = Callable[[str], None]


def _jobs(opts: RingBenchOptions) -> tuple[dict, list[dict]]:
    base = {k: v for k, v in dataclasses.asdict(opts).items() if k != "model"}
    base["model"] = str(opts.model)
    world = max(opts.worlds)
    return {**base, "part": "compute"}, [{**base, "part": "loopback", "rank": r, "world": world} for r in range(world)]


def margins(compute: dict, link: dict | None, hgroup: HeadGroup, gbps: float) -> list[dict]:
    """Per shard length: attention time of one head group against its message's transfer time."""
    rows = []
    t_10g = transfer_s(hgroup.packet_bytes, gbps)
    rate = (link or {}).get("rate_bytes_per_s")
    t_loop = hgroup.packet_bytes / rate if rate else None
    one_way = ((link or {}).get("one_way_s") or {}).get("packet")
    for s in compute["shards"]:
        a = s["attend_s"]
        rows.append({
            "context": s["context"], "nodes": s["nodes"], "keys": s["keys"], "attend_s": a,
            "attend_median_s": s.get("attend_median_s"), "merge_s": s["merge_s"],
            "gflops_per_s": s["flops"] / a / 1e9, "kv_gb_per_s": s["kv_bytes"] / a / 1e9,
            "transfer_10g_s": t_10g, "transfer_loopback_s": t_loop, "one_way_loopback_s": one_way,
            "margin_10g": a / t_10g, "margin_loopback": a / t_loop if t_loop else None,
            "margin_loopback_one_way": a / one_way if one_way else None,
        })
    return rows


def decode_rows(loop: dict, worlds: tuple[int, ...]) -> list[dict]:
    rows = []
    for n in sorted(set(worlds)):
        d = loop.get(f"decode{n}") or {}
        ring, bcast, single = d.get("ring"), d.get("broadcast"), d.get("single")
        rows.append({
            "nodes": n, "ring_step_s": ring and ring["step_s"], "broadcast_step_s": bcast and bcast["step_s"],
            "ring_home_wait_s": ring and ring["home_wait_s"], "broadcast_home_wait_s": bcast and bcast["home_wait_s"],
            "broadcast_over_ring": (bcast["step_s"] / ring["step_s"]) if ring and bcast else None,
            "single_node_step_s": single and single["step_s"],
            "steps_s": {k: v["steps_s"] for k, v in d.items()},
        })
    return rows


def rates_from(compute: dict, gbps: float, latency_s: float) -> Rates:
    """Attention's rate from the longest shard measured (the memory-bound regime a 32K context is in)."""
    longest = max(compute["shards"], key=lambda s: s["keys"])
    rows = compute["rows"]
    fixed, per_row = Rates.dense_line({int(b): t for b, t in compute["dense_step_s"].items()})
    return Rates(longest["attend_s"] / (rows * longest["keys"]), longest["merge_s"] / rows, fixed, per_row,
                 gbps, latency_s)


def run_ring_bench(opts: RingBenchOptions, say: Say = lambda m: None, latency_s: float = 30e-6) -> dict:
    from weaved.model.loader import open_model

    _, cfg = open_model(opts.model)
    if cfg.n_kv_heads % opts.heads_per_group:
        raise ValueError(f"heads_per_group must divide the model's {cfg.n_kv_heads} kv heads")
    hgroup = HeadGroup.of(cfg, opts.rows, opts.heads_per_group)
    compute_job, loop_jobs = _jobs(opts)
    errors: list[str] = []
    say(f"compute: one head group's attention at {len(opts.shards)} shard lengths, {opts.threads} thread(s)")
    (compute,) = run_workers([compute_job], ["compute.json"], opts.threads, opts.deadline_s, say)
    if compute["status"] != "ok":
        errors.append(f"compute: {compute['error']}\n{compute.get('trace', '')}")
        compute = None
    else:
        compute["rows"] = opts.rows
    say(f"loopback: link rate, then Q-Ring and broadcast decode on {', '.join(map(str, opts.worlds))} processes")
    names = [f"rank{r}.json" for r in range(len(loop_jobs))]
    results = run_workers(loop_jobs, names, 1, opts.deadline_s, say)
    for r, res in enumerate(results):
        if res["status"] != "ok":
            errors.append(f"loopback rank {r}: {res['error']}\n{res.get('trace', '')}")
    loop = results[0] if results[0]["status"] == "ok" else {}
    link = loop.get("link")
    report: dict = {
        "scenario": "ring",
        "model": {"name": opts.model.stem, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
                  "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "kv_bytes_per_token": cfg.kv_bytes_per_token},
        "options": json.loads(json.dumps(dataclasses.asdict(opts), default=str)),  # tuples as lists, the path a str
        "head_group": {"rows": hgroup.rows, "q_heads": hgroup.q_heads, "kv_heads": hgroup.kv_heads,
                       "head_dim": hgroup.head_dim, "packet_bytes": hgroup.packet_bytes,
                       "tail_bytes": hgroup.tail_bytes, "query_bytes": hgroup.query_bytes},
        "link": {"gbps": opts.link_gbps, "loopback_gbps": link and link["rate_bytes_per_s"] * 8 / 1e9,
                 "loopback_one_way_s": link and link["one_way_s"]},
        "margins": margins(compute, link, hgroup, opts.link_gbps) if compute else [],
        "dense_step_s": compute and compute["dense_step_s"],
        "decode": decode_rows(loop, opts.worlds),
        "projection": None,
        "errors": errors,
    }
    if compute:
        rates = rates_from(compute, opts.link_gbps, latency_s)
        report["projection"] = {"agents": opts.agents, "context": opts.context, "gbps": opts.link_gbps,
                                "latency_s": latency_s, "rates": dataclasses.asdict(rates),
                                "rows": projection(Shape.of(cfg, opts.heads_per_group), rates, opts.agents,
                                                   opts.context)}
    return report
