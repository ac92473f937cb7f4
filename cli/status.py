"""``weave status``: the daemon's model, pools, KV tiers, hardware and peers."""

from __future__ import annotations

import typer
from weaved.cli import fmt
from weaved.cli.common import ApiKeyOpt, JsonOpt, SocketOpt, connect, echo, print_json


def pools_table(pools: list[dict]) -> str:
    headers = ("POOL", "BACKEND", "DEVICE", "STRATEGY", "VARIANT", "BATCH", "QUEUE", "TOK/S", "PREEMPTED")
    rows = [(p["name"], p.get("backend"), p.get("device"), p.get("strategy"),
             fmt.variant(p.get("variant") or {}), p.get("batch_depth"), p.get("queue_depth"),
             fmt.rate(p.get("tokens_per_s")), p.get("preemptions")) for p in pools]
    return fmt.table(headers, rows, right=(5, 6, 7, 8))


def _source(st: dict) -> str:
    """Where the profile came from, when it is a file of the operator's (a shipped one is its name)."""
    return f" ({st['profile_file']})" if st.get("profile_file") else ""


def kv_line(kv: dict) -> str:
    ram = fmt.size(kv.get("ram_bytes")) if kv.get("ram_measured", True) else "unmeasured"
    device = ""
    if kv.get("device_free_bytes") is not None:  # GPU pools' paged KV: in use (prefix blocks cached) and free
        device = f"{fmt.size(kv.get('device_bytes'))} on GPU pools ({fmt.size(kv['device_free_bytes'])} free), "
    pre = kv.get("prefixes") or {}
    prefixes = (f"; {pre['files']} shared prefix file(s): {fmt.size(pre.get('bytes'))} of their "
                f"{fmt.size(pre.get('cap_bytes'))} cap" if pre.get("files") else "")
    free = f" ({fmt.size(kv['disk_free_bytes'])} free)" if kv.get("disk_free_bytes") is not None else ""
    return (f"{kv.get('sessions', 0)} session file(s): {fmt.size(kv.get('file_bytes'))} on disk{free}, "
            f"{ram} in RAM, {device}{fmt.size(kv.get('reserved_bytes'))} reserved of a "
            f"{fmt.size(kv.get('cap_bytes'))} cap{prefixes}")


def hardware_lines(hw: dict) -> list[str]:
    cores = hw.get("cpu_percent") or []
    avg = sum(cores) / len(cores) if cores else 0.0
    lines = [f"cpu       {len(cores)} core(s), {avg:.0f}% busy on average",
             f"memory    {fmt.size(hw.get('memory_used'))} used of {fmt.size(hw.get('memory_total'))}; "
             f"daemon {fmt.size(hw.get('rss'))} resident"]
    gpus = hw.get("gpus") or []
    if not gpus:
        lines.append("gpu       none")
    for g in gpus:
        util = g.get("utilization")
        busy = f", {util:.0f}% busy" if util is not None else ""
        lines.append(f"gpu       {g.get('name', '?')}: {fmt.size(g.get('memory_used'))} of "
                     f"{fmt.size(g.get('memory_total'))}{busy}")
    return lines


def ring_lines(st: dict) -> list[str]:
    """The rings this node homes (its qring pools) and the groups it serves for its peers."""
    lines = []
    for p in st.get("pools") or ():
        r = p.get("ring")
        if not r:
            continue
        where = f"{r['ring']} with {', '.join(r['members']) or 'no peers'}" if r.get("ring") else "not formed"
        lines.append(f"ring      {p['name']}: {where}, {r.get('sessions', 0)} session(s); "
                     f"formed {r.get('formed', 0)}x, lost {r.get('lost', 0)}x, "
                     f"rebuilt {r.get('rebuilt_sessions', 0)} session(s) ({r.get('rebuilt_tokens', 0)} tokens), "
                     f"{r.get('pipeline_prefills', 0)} pipeline prefill(s)")
    for g in st.get("groups") or ():
        lines.append(f"member    of {g['group']} (home {g['home']}), rank {g['rank']} of {g['world']}, {g['state']}")
    return lines


def rates_line(r: dict) -> str:
    """The CPU pool's rates the router and admission use, and where they come from."""
    where = (f"calibrated {fmt.seconds(r.get('age_s'))} ago, fit within {r.get('fit_error', 0):.0%}"
             if r.get("source") == "calibrated" else "given by the profile")
    return (f"CPU prefill {fmt.rate(r.get('prefill_tokens_per_s'))} tok/s, decode "
            f"{fmt.rate(r.get('decode_tokens_per_s'))} tok/s at a full batch ({where})")


def status_text(st: dict) -> str:
    model = st.get("model") or {}
    every = st.get("sessions") or ()
    sessions = [s for s in every if not s.get("ephemeral")]
    busy = sum(1 for s in sessions if s.get("state") not in ("idle", None))
    stateless = sum(1 for s in every if s.get("ephemeral"))  # requests without a session, running
    lines = [
        f"model     {model.get('name', '?')} ({model.get('arch', '?')}, "
        f"{model.get('context_length', '?')}-token context)",
        f"profile   {st.get('profile', '?')}{_source(st)}, up {fmt.seconds(st.get('uptime_s'))}",
        *([f"data      {st['data_dir']} (durability {st.get('durability', '?')})"] if st.get("data_dir") else []),
        f"sessions  {len(sessions)} ({busy} generating)"
        + (f"; {stateless} request(s) without a session running" if stateless else ""),
        *([f"          {len(st['unrecovered'])} not recovered (why: `weave status --json`; "
           f"`weave rm ID` deletes one): {', '.join(u['id'] for u in st['unrecovered'][:3])}"
           + (", ..." if len(st["unrecovered"]) > 3 else "")] if st.get("unrecovered") else []),
        f"kv        {kv_line(st.get('kv') or {})}",
        *hardware_lines(st.get("hardware") or {}),
    ]
    rates = st.get("rates")
    if rates:
        lines.append(f"rates     {rates_line(rates)}")
    mig = st.get("migrations")
    if mig:
        reasons = ", ".join(f"{n} {r}" for r, n in sorted((mig.get("by_reason") or {}).items()))
        lines.append(f"moves     {mig.get('count', 0)} KV move(s) between backends, {fmt.size(mig.get('bytes'))} "
                     f"copied in {fmt.seconds(mig.get('seconds'))}" + (f" ({reasons})" if reasons else ""))
    peers = st.get("peers") or []
    lines.append("peers     " + ("none" if not peers else "; ".join(fmt.peer_text(p) for p in peers)))
    lines += ring_lines(st)
    lines += ["", pools_table(st.get("pools") or [])]
    lines += [f"note: {n}" for n in st.get("pool_notes") or ()]
    return "\n".join(lines)


def status(socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False) -> None:
    """Show the daemon: model, pools, KV tiers, hardware and peers."""
    with connect(socket, api_key) as client:
        st = client.status()
    print_json(st) if json else echo(status_text(st))


def clear_prefixes(socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False) -> None:
    """Empty the stored prefixes: the shared KV of prompts (first turns, forks, stateless conversations)
    that outlives the sessions that made it, as a cache, until evicted - files sessions still map stay."""
    with connect(socket, api_key) as client:
        out = client.clear_prefixes()
    if json:
        print_json(out)
    else:
        echo(f"removed {out.get('files', 0)} stored prefix file(s), {fmt.size(out.get('bytes'))}, and "
             f"{out.get('short_blocks', 0)} short prefix block(s) from memory; {out.get('kept_files', 0)} "
             f"file(s) kept: sessions map them")


def register(app: typer.Typer) -> None:
    app.command()(status)
    app.command("clear-prefixes")(clear_prefixes)
