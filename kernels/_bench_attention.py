"""Timing of the attention kernels at SmolLM2-135M's shapes (30 layers, 9 heads, 3 kv heads, head
dim 64): one decode token at several context lengths, and a 512-token prefill chunk at the start of a
prompt and at the end of an 8k one, all 30 layers.

    python -m weaved.kernels._bench_attention [--threads N] [--repeat R]

Per token (decode) or per prompt (prefill), best of R runs, attention only: every layer stores the
new K/V rows and attends (no matmuls).  "wall" is elapsed time; "cpu" is the CPU time of the whole
process (all threads), which other programs on a shared machine inflate less.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from weaved.kernels.attention import attend, kv_list, kv_store
from weaved.kernels.threads import run_on_kernel_thread

N_LAYERS, N_HEADS, N_KV, HEAD_DIM = 30, 9, 3, 64


def _setup(ctx: int, new: int, rng: np.random.Generator):
    """A kv array holding ``ctx`` random positions, room for ``new`` more, and the batch of new rows."""
    kv = (rng.standard_normal((N_LAYERS, 2, N_KV, ctx + new, HEAD_DIM)) * 0.5).astype(np.float16)
    q = rng.standard_normal((new, N_HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((new, N_KV, HEAD_DIM)).astype(np.float32)
    return kv_list([kv]), q, k


def _time_pass(kvs, q, k, ctx: int, repeat: int) -> tuple[float, float]:
    """Best (wall, cpu) seconds of storing the new rows and attending, all layers."""
    T = q.shape[0]
    seq_starts = np.array([0, T], np.int64)
    pos0 = np.array([ctx], np.int64)
    out = np.empty_like(q)
    lse = np.empty(q.shape[:2], np.float32)
    scale = 1.0 / np.sqrt(HEAD_DIM)
    wall = cpu = np.inf
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        for layer in range(N_LAYERS):
            kv_store(kvs, layer, seq_starts, pos0, k, k)
            attend(q, kvs, layer, seq_starts, pos0, scale, out, lse)
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=numba.get_num_threads())
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    # numba's count is per thread, and the kernels' regions start on the kernel thread
    run_on_kernel_thread(lambda: numba.set_num_threads(args.threads))
    rng = np.random.default_rng(0)
    print(f"SmolLM2-135M attention, {N_LAYERS} layers, {args.threads} thread(s), best of {args.repeat}")
    for ctx in (128, 2000, 8000):
        kvs, q, k = _setup(ctx, 1, rng)
        _time_pass(kvs, q, k, ctx, 1)  # compile / warm up
        wall, cpu = _time_pass(kvs, q, k, ctx, args.repeat)
        print(f"decode  context {ctx:5d}: {wall * 1e3:7.2f} ms/token wall, {cpu * 1e3:7.2f} ms cpu")
    for ctx in (0, 7680):  # a first prompt chunk, and the last 512-token chunk of an 8k prompt
        kvs, q, k = _setup(ctx, 512, rng)
        _time_pass(kvs, q, k, ctx, 1)
        wall, cpu = _time_pass(kvs, q, k, ctx, max(1, args.repeat // 2))
        print(f"prefill 512 tokens at context {ctx:5d}: {wall * 1e3:8.2f} ms wall, {cpu * 1e3:8.2f} ms cpu "
              f"({wall / 512 * 1e6:.0f} us/token wall)")


if __name__ == "__main__":
    main()
