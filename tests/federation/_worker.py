"""One member of a multi-process federation test: ``python -m tests.federation._worker JOB.json``.

Scenarios (``job["scenario"]``):
- ``ring``: rank 0 prefills the prompts on one node, opens them on a Q-Ring (rows sent), decodes
  greedily on the ring and records, beside the ring's logits, the single node's logits for the same
  tokens (each side its own KV) and the single node's own greedy continuation; then decodes from the
  same inputs (the ring resynchronised to the single node's KV after every step); then one
  multi-token turn.
- ``pipeline``: a pipeline prefill (layers split by ``speeds``) gathered on rank 0 and on the last
  rank, compared with the single node; then a second prefill scattered onto a Q-Ring formed over
  the same store, and decode on that ring.
- ``fail``: a ring decodes until ``victim`` exits (``how`` = exit) or stops answering (hang) in the
  middle of step ``at_step``; the survivors report ``PeerLost``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from weaved.backends.base import Logits, SeqChunk
from weaved.backends.cpu import CPUBackend
from weaved.federation import qring
from weaved.federation.comm import GroupSpec, PeerGroup, PeerLost, host_store
from weaved.federation.handoff import Handoff
from weaved.federation.layers import LayerRunner
from weaved.federation.pipeline import PipelineMember, split_layers
from weaved.federation.qring import RingChunk, RingMember
from weaved.kv.cache import KVCache


class Ctx:
    def __init__(self, job: dict):
        self.job, self.rank, self.world = job, job["rank"], job["world"]
        self.out = Path(job["out"])
        self.arrays: dict[str, np.ndarray] = {}
        self.result: dict = {"rank": self.rank, "status": "ok"}
        self.store = None
        port_file = Path(job["port_file"])
        if self.rank == 0:
            self.store = host_store(timeout_s=job.get("timeout_s", 10.0))
            tmp = port_file.with_suffix(".tmp")
            tmp.write_text(str(self.store.port))
            tmp.rename(port_file)
            self.port = self.store.port
        else:
            end = time.monotonic() + 60
            while not port_file.exists():
                if time.monotonic() > end:
                    raise TimeoutError("rank 0 never published its store")
                time.sleep(0.05)
            self.port = int(port_file.read_text())

    def group(self, name: str) -> PeerGroup:
        j = self.job
        spec = GroupSpec(name, self.rank, self.world, port=self.port, timeout_s=j.get("timeout_s", 10.0),
                         idle_timeout_s=j.get("idle_timeout_s", 60.0))
        return PeerGroup.form(spec, self.store)

    def backend(self) -> CPUBackend:
        return CPUBackend.from_file(self.job["model"], threads=1)


def _copy(kv: KVCache) -> KVCache:
    return KVCache(kv.data.copy(), kv.length)


def _decode(ctx: Ctx, be: CPUBackend, ring: RingMember, refs: list[KVCache], first: list[np.ndarray], tag: str):
    """Greedy decode on the ring; the single node follows with the same tokens (teacher forcing)."""
    steps = ctx.job["steps"]
    S = len(refs)
    ring_l = [[] for _ in range(S)]
    ref_l = [[] for _ in range(S)]
    toks = [[int(np.argmax(f))] for f in first]
    for t in range(steps):
        # a ragged batch: the last session sits out every third step (batches of changing shape)
        active = [s for s in range(S) if not (S > 1 and s == S - 1 and t % 3 == 1)]
        got = ring.step([RingChunk(s, np.array([toks[s][-1]], np.int32)) for s in active])
        ref = be.forward([SeqChunk(refs[s], np.array([toks[s][-1]], np.int32)) for s in active])
        for s, a, b in zip(active, got, ref, strict=True):
            ring_l[s].append(a[0])
            ref_l[s].append(b[0])
            toks[s].append(int(np.argmax(a[0])))
    for s in range(S):
        ctx.arrays[f"{tag}_ring_logits_{s}"] = np.stack(ring_l[s])
        ctx.arrays[f"{tag}_ref_logits_{s}"] = np.stack(ref_l[s])
        ctx.arrays[f"{tag}_ring_tokens_{s}"] = np.array(toks[s], np.int64)  # [0]: from the prefill's logits


def _greedy_single(be: CPUBackend, prompt: list[int], steps: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    kv = be.new_kv(cap)
    (row,) = be.forward([SeqChunk(kv, np.array(prompt, np.int32))])
    toks, logits = [], []
    for _ in range(steps):
        toks.append(int(np.argmax(row[0])))
        logits.append(row[0])
        (row,) = be.forward([SeqChunk(kv, np.array([toks[-1]], np.int32))])
    return np.array(toks, np.int64), np.stack(logits)


def _resync(ring: RingMember, refs: list[KVCache], cap: int) -> None:
    """Give the ring the single node's KV again (close, reopen with rows sent)."""
    for s, kv in enumerate(refs):
        ring.close_session(s)
        ring.open_session(s, cap, kv=_copy(kv))


def _same_inputs(ctx: Ctx, be: CPUBackend, ring: RingMember, refs: list[KVCache], first: list[np.ndarray]) -> None:
    """Each step from the same inputs, token and KV: the single node's greedy token, and the ring
    resynchronised to the single node's KV after every step (so only one step's arithmetic differs)."""
    cap = ctx.job["capacity"]
    _resync(ring, refs, cap)
    toks = [int(np.argmax(f)) for f in first]
    got_l, ref_l = [[] for _ in refs], [[] for _ in refs]
    for _ in range(ctx.job.get("same_steps", ctx.job["steps"])):
        got = ring.step([RingChunk(s, np.array([t], np.int32)) for s, t in enumerate(toks)])
        ref = be.forward([SeqChunk(kv, np.array([t], np.int32)) for kv, t in zip(refs, toks, strict=True)])
        for s in range(len(refs)):
            got_l[s].append(got[s][0])
            ref_l[s].append(ref[s][0])
        toks = [int(np.argmax(r[0])) for r in ref]
        _resync(ring, refs, cap)
    for s in range(len(refs)):
        ctx.arrays[f"same_ring_logits_{s}"], ctx.arrays[f"same_ref_logits_{s}"] = np.stack(got_l[s]), np.stack(ref_l[s])


def scenario_ring(ctx: Ctx) -> None:
    be, j = ctx.backend(), ctx.job
    g = ctx.group("ring-1")
    if ctx.rank != 0:
        member = RingMember(g, be.config)
        member.serve()
        for sid, kv in member.shards.kv.items():  # what this rank held at the end
            ctx.arrays[f"shard_{sid}"] = kv.data[:, :, :, : kv.length].copy()
        return
    ring = RingMember(g, be.config, LayerRunner(be), heads_per_group=j.get("heads_per_group", 1))
    cap = j["capacity"]
    refs, first = [], []
    for s, p in enumerate(j["prompts"]):
        kv = be.new_kv(cap)
        (last,) = be.forward([SeqChunk(kv, np.array(p, np.int32))])
        refs.append(_copy(kv))
        first.append(last[0])
        ring.open_session(s, cap, kv=kv)
    start = [_copy(kv) for kv in refs]
    _decode(ctx, be, ring, refs, first, "dec")  # free running: each side its own KV
    for s, p in enumerate(j["prompts"]):  # the single node's own greedy continuation (first ring logits included)
        toks, logits = _greedy_single(be, p, j["steps"] + 1, cap)
        ctx.arrays[f"single_tokens_{s}"], ctx.arrays[f"single_logits_{s}"] = toks, logits
    _same_inputs(ctx, be, ring, start, first)
    turn = np.array(j["turn"], np.int32)  # a new turn of several tokens for every session, all rows' logits
    got = ring.step([RingChunk(s, turn, Logits.ALL) for s in range(len(start))])
    ref = be.forward([SeqChunk(start[s], turn, Logits.ALL) for s in range(len(start))])
    for s in range(len(start)):
        ctx.arrays[f"turn_ring_{s}"], ctx.arrays[f"turn_ref_{s}"] = got[s], ref[s]
    for s, kv in ring.shards.kv.items():
        ctx.arrays[f"shard_{s}"] = kv.data[:, :, :, : kv.length].copy()
        ctx.arrays[f"full_kv_{s}"] = start[s].data[:, :, :, : start[s].length].copy()
    ctx.result["wait_s"] = ring.stats.wait_seconds
    ring.stop()


def scenario_pipeline(ctx: Ctx) -> None:
    be, j = ctx.backend(), ctx.job
    cfg = be.config
    ranges = split_layers(cfg.n_layers, j["speeds"])
    ctx.result["ranges"] = ranges
    pg, rg = ctx.group("pipe-1"), ctx.group("ring-1")  # two groups over one store
    prompts = [np.array(p, np.int32) for p in j["prompts"]]
    cap, S = j["capacity"], len(prompts)
    if ctx.rank != 0:
        ring = RingMember(rg, cfg)
        held = {}

        def on_kv(sid: int, kv: KVCache, length: int) -> None:
            if sid >= 100:  # the scattered sessions: shards for the ring
                ring.shards.adopt(sid, kv, length)
            else:
                held[sid] = kv
                ctx.arrays[f"gathered_{sid}"] = kv.data[:, :, :, : kv.length].copy()

        pm = PipelineMember(pg, be, on_kv=on_kv)
        t = threading.Thread(target=ring.serve, daemon=True)  # a daemon serves both groups at once
        t.start()
        pm.serve()
        t.join(60)
        return
    pm = PipelineMember(pg, be)
    ring = RingMember(rg, cfg, LayerRunner(be))
    refs = [be.new_kv(cap) for _ in prompts]
    ref_last = be.forward([SeqChunk(kv, p) for kv, p in zip(refs, prompts, strict=True)])
    for s in range(S):
        ctx.arrays[f"ref_kv_{s}"] = refs[s].data[:, :, :, : refs[s].length].copy()
    for dst in (0, ctx.world - 1):
        res = pm.prefill(list(range(S)), prompts, ranges=ranges, capacities=[cap] * S, mb_tokens=j["mb_tokens"],
                         handoff=Handoff.GATHER, dst=dst)
        same = all(np.array_equal(a, b) for a, b in zip(res.logits, ref_last, strict=True))
        ctx.result[f"logits_equal_dst{dst}"] = same
        if dst == 0:
            ctx.result["kv_equal_dst0"] = all(
                np.array_equal(res.kv[s].data[:, :, :, : len(p)], refs[s].data[:, :, :, : len(p)])
                and res.kv[s].length == len(p) for s, p in enumerate(prompts))
    res = pm.prefill([100 + s for s in range(S)], prompts, ranges=ranges, capacities=[cap] * S,
                     mb_tokens=j["mb_tokens"], handoff=Handoff.SCATTER)
    ctx.result["scatter_logits_equal"] = all(np.array_equal(a, b) for a, b in zip(res.logits, ref_last, strict=True))
    for s, p in enumerate(prompts):
        ring.shards.adopt(100 + s, res.kv[100 + s], len(p))
        ring.open_session(100 + s, cap, held_length=len(p))
    pm.stop()
    _decode(ctx, be, _Renamed(ring, 100), refs, [r[0] for r in ref_last], "dec")
    ring.stop()
    for s, p in enumerate(j["prompts"]):
        ctx.arrays[f"single_tokens_{s}"], ctx.arrays[f"single_logits_{s}"] = _greedy_single(be, p, j["steps"] + 1, cap)


class _Renamed:
    """A ring seen through session ids shifted by ``base`` (the test's sessions are 0..S-1)."""

    def __init__(self, ring: RingMember, base: int):
        self.ring, self.base = ring, base

    def step(self, chunks: list[RingChunk]) -> list[np.ndarray]:
        return self.ring.step([RingChunk(c.sid + self.base, c.tokens, c.logits) for c in chunks])


def scenario_fail(ctx: Ctx) -> None:
    be, j = ctx.backend(), ctx.job
    g = ctx.group("ring-f")
    victim, at_step, how = j["victim"], j["at_step"], j["how"]
    if ctx.rank == victim:
        _arm_failure(ctx, at_step, how, be.config.n_layers)
    if ctx.rank != 0:
        RingMember(g, be.config).serve()
        return
    ring = RingMember(g, be.config, LayerRunner(be))
    for s, p in enumerate(j["prompts"]):
        kv = be.new_kv(j["capacity"])
        be.forward([SeqChunk(kv, np.array(p, np.int32))])
        ring.open_session(s, j["capacity"], kv=kv)
    for t in range(j["steps"]):
        ctx.result["steps_done"] = t
        ring.step([RingChunk(s, np.array([t + 1], np.int32)) for s in range(len(j["prompts"]))])


def _arm_failure(ctx: Ctx, at_step: int, how: str, n_layers: int) -> None:
    """Make this process die or go silent in the middle (layer 1) of ring step ``at_step``."""
    state = {"layer_calls": 0}
    target = at_step * n_layers + 2

    def fail() -> None:
        ctx.result["status"] = "victim"
        if how == "exit":
            os._exit(3)
        time.sleep(3600)  # hang: alive, connected, silent

    if ctx.rank == 0:
        orig = RingMember._home_attention

        def home_attention(self, li, *a):
            state["layer_calls"] += 1
            if state["layer_calls"] == target:
                fail()
            return orig(self, li, *a)

        RingMember._home_attention = home_attention
    else:
        orig_store = qring.StepRows.store

        def store(self, layer, h0, *a):
            if h0 == 0:
                state["layer_calls"] += 1
                if state["layer_calls"] == target:
                    fail()
            return orig_store(self, layer, h0, *a)

        qring.StepRows.store = store


SCENARIOS = {"ring": scenario_ring, "pipeline": scenario_pipeline, "fail": scenario_fail}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(job["out"])
    ctx = None
    t0 = time.monotonic()
    try:
        ctx = Ctx(job)
        SCENARIOS[job["scenario"]](ctx)
    except PeerLost as e:
        ctx.result.update(status="peerlost", error=str(e))
    except Exception:
        res = ctx.result if ctx else {"rank": job["rank"]}
        res.update(status="error", error=traceback.format_exc())
        ctx = ctx or type("C", (), {"result": res, "arrays": {}, "rank": job["rank"]})()
    ctx.result["seconds"] = time.monotonic() - t0
    r = job["rank"]
    if ctx.arrays:
        np.savez(out / f"rank{r}.npz", **ctx.arrays)
    tmp = out / f"rank{r}.json.tmp"
    tmp.write_text(json.dumps(ctx.result, default=str))
    tmp.rename(out / f"rank{r}.json")
    print(f"rank {r}: {ctx.result['status']}", flush=True)


if __name__ == "__main__":
    main()
