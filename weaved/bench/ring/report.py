"""The ring bench's report as text: margins per shard length, loopback decode, the projection."""

from __future__ import annotations


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}x"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)).rstrip()
    return [fmt(headers), *(fmt(r) for r in rows)]


def format_table(report: dict) -> str:
    hg, link, m = report["head_group"], report["link"], report["model"]
    loop = "-" if link["loopback_gbps"] is None else f"{link['loopback_gbps']:.1f}"
    lines = [
        f"Q-Ring on this CPU: {m['name']} ({m['n_layers']} layers, {m['n_heads']} query / {m['n_kv_heads']} kv heads, "
        f"head_dim {m['head_dim']})",
        f"head group: {hg['kv_heads']} kv head(s) + {hg['q_heads']} query heads, {hg['rows']} rows; message "
        f"{hg['packet_bytes']} B (q|k|v|acc), last hop {hg['tail_bytes']} B",
        f"links: {link['gbps']:g} Gbps modelled; loopback measured {loop} Gbps",
        "",
        "per head group: attention time (best of reps) vs transfer time of its message (margin = attention / "
        "transfer)",
    ]
    rows = [[f"{_k(r['context'])}/{r['nodes']}", str(r["keys"]), _ms(r["attend_s"]), _ms(r.get("attend_median_s")),
             _ms(r["merge_s"]),
             f"{r['kv_gb_per_s']:.1f}", _ms(r["transfer_10g_s"]), _x(r["margin_10g"]), _ms(r["transfer_loopback_s"]),
             _x(r["margin_loopback"]), _ms(r["one_way_loopback_s"]), _x(r["margin_loopback_one_way"])]
            for r in report["margins"]]
    lines += _table(["ctx/N", "keys", "attn ms", "(median)", "merge ms", "KV GB/s", "10G ms", "margin", "loop ms",
                     "margin", "1-way ms", "margin"], rows)
    lines += ["", "loopback decode step (one process per node, 1 thread each): Q-Ring vs broadcast-and-merge-once"]
    rows = [[str(r["nodes"]), _ms(r["ring_step_s"]), _ms(r["broadcast_step_s"]), _x(r["broadcast_over_ring"]),
             _ms(r["ring_home_wait_s"]), _ms(r["broadcast_home_wait_s"]), _ms(r["single_node_step_s"])]
            for r in report["decode"]]
    lines += _table(["nodes", "ring ms", "bcast ms", "bcast/ring", "ring wait ms", "bcast wait ms", "1 node ms"], rows)
    proj = report.get("projection")
    if proj:
        lines += ["", f"projection: {proj['agents']} agents at {_k(proj['context'])} context, {proj['gbps']:g} Gbps, "
                      f"{proj['latency_s'] * 1e6:.0f} us per message (docs/ring-cost-model.md)"]
        rows = []
        for r in proj["rows"]:
            sh, ev = r["single_home"], r["every_node_home"]
            bc = r["broadcast_single_home"]
            rows.append([str(r["nodes"]), f"{r['kv_per_node_bytes'] / 2**30:.1f}", _x(r["head_group"]["margin"]),
                         _ms(sh["step_s"]), f"{sh['tokens_per_s']:.1f}", _ms(sh["exposed_transfer_s"]),
                         f"{bc['tokens_per_s']:.1f}",
                         _ms(ev["step_s"]), ev["bound"], f"{ev['tokens_per_s']:.1f}",
                         f"{ev['tokens_per_s_per_node']:.1f}"])
        lines += _table(["N", "KV/node GiB", "margin", "1-home step ms", "tok/s", "exposed ms", "bcast tok/s",
                         "all-home step ms", "bound", "tok/s", "tok/s/node"], rows)
    for e in report.get("errors") or ():
        lines += ["", f"error: {e.splitlines()[0]}"]
    return "\n".join(lines)
