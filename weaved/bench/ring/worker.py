"""One process of the ring bench: ``python -m weaved.bench.ring.worker JOB.json``.

``job["part"]``:
- ``compute``: the per-head-group attention and the dense step (``measure``), one process, the
  bench's kernel threads.
- ``loopback``: rank ``job["rank"]`` of ``job["world"]`` processes, one kernel thread each.  Rank 0
  hosts the rendezvous store (port 0, published in ``port_file``) and drives: the link between ranks
  0 and 1, then for every ring size N a Q-Ring and a broadcast group over ranks 0..N-1 at the same
  time (rank 0 the home, with the model's weights, and a single node beside them for reference; the
  others hold shards only and serve both groups, one thread each), their steps taking turns.

Writes ``rank{r}.json`` (or ``compute.json``): ``{"status": "ok" | "error", ...}``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from pathlib import Path

from weaved.bench.ring.sizes import HeadGroup


def _store_port(job: dict):
    """(store or None, port): rank 0 hosts the store and publishes its port; the others read it."""
    from weaved.federation.comm import host_store

    port_file = Path(job["port_file"])
    if job["rank"] == 0:
        store = host_store(timeout_s=job["timeout_s"])
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        tmp.rename(port_file)
        return store, store.port
    end = time.monotonic() + job["timeout_s"]
    while not port_file.exists():
        if time.monotonic() > end:
            raise TimeoutError("rank 0 never published its store")
        time.sleep(0.05)
    return None, int(port_file.read_text())


def run_loopback(job: dict) -> dict:
    from weaved.bench.ring.broadcast import BroadcastMember
    from weaved.bench.ring.loopback import bulk_rate, decode_compare, pingpong_s
    from weaved.federation.comm import GroupSpec, PeerGroup
    from weaved.federation.qring import RingMember
    from weaved.model.loader import open_model

    rank = job["rank"]
    store, port = _store_port(job)

    def group(name: str, world: int) -> PeerGroup:
        spec = GroupSpec(name, rank, world, port=port, timeout_s=job["timeout_s"], idle_timeout_s=job["timeout_s"])
        return PeerGroup.form(spec, store)

    out: dict = {}
    _, cfg = open_model(job["model"])
    if rank < 2:
        g = group("link", 2)
        hgroup = HeadGroup.of(cfg, job["rows"], job["heads_per_group"])
        sizes = {"packet": hgroup.packet_bytes, "tail": hgroup.tail_bytes, "query": hgroup.query_bytes, "small": 64}
        one_way = {k: pingpong_s(g, n, job["pingpong_reps"]) for k, n in sizes.items()}
        rate = bulk_rate(g, job["bulk_bytes"])
        g.close()
        if rank == 0:
            out["link"] = {"bytes": sizes, "one_way_s": one_way, "rate_bytes_per_s": rate,
                           "bulk_bytes": job["bulk_bytes"]}
    runner = None
    if rank == 0:
        from weaved.backends.cpu import CPUBackend
        from weaved.federation.layers import LayerRunner

        runner = LayerRunner(CPUBackend.from_file(job["model"], threads=1))
    hpg = job["heads_per_group"]
    for n in sorted(set(job["worlds"])):  # every rank forms the same groups in the same order
        if rank >= n:
            continue
        ring, bcast = group(f"ring-{n}", n), group(f"broadcast-{n}", n)
        if rank == 0:
            members = {"ring": RingMember(ring, cfg, runner, heads_per_group=hpg),
                       "broadcast": BroadcastMember(bcast, cfg, runner, heads_per_group=hpg),
                       "single": RingMember(group(f"single-{n}", 1), cfg, runner, heads_per_group=hpg)}
            out[f"decode{n}"] = decode_compare(members, job["ring_sessions"], job["ring_context"], job["ring_steps"])
        else:  # a member of both at once, as a daemon in several rings is
            serving = [threading.Thread(target=cls(g, cfg, heads_per_group=hpg).serve, daemon=True)
                       for cls, g in ((RingMember, ring), (BroadcastMember, bcast))]
            for t in serving:
                t.start()
            for t in serving:
                t.join(job["timeout_s"] * 4)
    return out


def main(path: str) -> None:
    job = json.loads(Path(path).read_text())
    out_dir = Path(job["out"])
    name = "compute.json" if job["part"] == "compute" else f"rank{job['rank']}.json"
    try:
        if job["part"] == "compute":
            from weaved.bench.ring.measure import measure_compute

            result = {"status": "ok", **measure_compute(job)}
        else:
            result = {"status": "ok", **run_loopback(job)}
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        result = {"status": "error", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
    tmp = out_dir / (name + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(out_dir / name)


if __name__ == "__main__":
    main(sys.argv[1])
