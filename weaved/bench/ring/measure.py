"""The compute side, measured in one process with the bench's kernel threads: one head group's
partial attention over KV shards, the online-softmax merge a member adds to the travelling
accumulator, and the home's dense work of a decode step.

Every row attends its own session's shard (a separate array, as in a ring step), so the KV is read
from memory once per row and the measurement sees this CPU's memory bandwidth, not a cache-warm
shard reused by every row.  Values are random: attention's cost does not depend on them.  Each
figure is the best of ``reps`` timed calls after one unrecorded call (compilation, page faults), the
median reported beside it: on a shared machine a parallel kernel can wait a whole scheduler time
slice (measured here: ~24 ms) for a thread whose core another process holds, which says nothing
about the kernel; the best call is the kernel's own time, and the conservative one for a margin
(faster attention hides less transfer).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from weaved.bench.ring.sizes import HeadGroup


def _times_s(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(best, median) seconds of ``reps`` calls after an unrecorded one."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def attention_times(hgroup: HeadGroup, keys: int, reps: int, seed: int = 0) -> dict:
    """Seconds of one head group's partial attention (``ShardBatch.attend``) of ``hgroup.rows`` rows,
    each over its own shard of ``keys`` keys, and of merging its result into an accumulator."""
    from weaved.federation.partial import ShardBatch, merge

    rng = np.random.default_rng(seed)
    T, Gq, hg, D = hgroup.rows, hgroup.q_heads, hgroup.kv_heads, hgroup.head_dim
    template = (rng.standard_normal((1, 2, hg, keys, D), np.float32) * 0.5).astype(np.float16)
    shards = [template.copy() for _ in range(T)]  # one per session: no row reads another's KV
    batch = ShardBatch(shards, np.arange(T), np.full(T, keys, np.int64))
    q = rng.standard_normal((T, Gq, D), np.float32)
    scale = 1.0 / float(np.sqrt(D))
    out, lse = batch.attend(q, 0, 0, hg, scale)
    acc_out, acc_lse = out.copy(), lse - 1.0
    attend_s, attend_median_s = _times_s(lambda: batch.attend(q, 0, 0, hg, scale), reps)
    merge_s, _ = _times_s(lambda: merge(acc_out, acc_lse, out, lse), reps)
    return {"attend_s": attend_s, "attend_median_s": attend_median_s, "merge_s": merge_s,
            "flops": hgroup.flops(keys), "kv_bytes": hgroup.kv_bytes(keys)}


def dense_step_s(runner, batch: int, reps: int, seed: int = 0) -> float:
    """Seconds of the home's dense work for one decode step of ``batch`` rows: embedding, every
    layer's norm, q|k|v product, RoPE, output product and feed-forward, and the logits - all but
    attention (which the ring spreads)."""
    cfg = runner.config
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, batch).astype(np.int32)
    positions = np.full(batch, 1000, np.int64)
    att = np.zeros((batch, cfg.n_heads, cfg.head_dim), np.float32)

    def step() -> None:
        x = runner.embed(ids)
        for li in range(cfg.n_layers):
            runner.pre_attention(li, x, positions)
            runner.post_attention(li, x, att)
        runner.logits(x)

    return _times_s(step, reps)[0]


def measure_compute(job: dict) -> dict:
    """The compute worker's job: every shard length of ``job["shards"]`` and the dense step."""
    from weaved.backends.cpu import CPUBackend
    from weaved.federation.layers import LayerRunner

    be = CPUBackend.from_file(job["model"], threads=job["threads"])
    cfg = be.config
    hgroup = HeadGroup.of(cfg, job["rows"], job["heads_per_group"])
    shards = []
    for context, nodes in job["shards"]:
        keys = -(-context // nodes)
        shards.append({"context": context, "nodes": nodes, "keys": keys,
                       **attention_times(hgroup, keys, job["reps"])})
    runner = LayerRunner(be)
    dense = {str(b): dense_step_s(runner, b, max(2, job["reps"] // 5)) for b in job["dense_batches"]}
    return {"shards": shards, "dense_step_s": dense, "threads": job["threads"]}
