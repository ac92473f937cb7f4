"""What this machine streams from memory: the read bandwidth a decode step's weights are held to.

A decode step reads every weight once, so its ceiling is the rate the cores can stream a buffer far
larger than the caches.  This reads one with every thread of the benchmark's budget (numba's pool,
a static split like the gemm's) and reports the best of a few passes in GB/s (10^9 bytes).
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange, uint64

from weaved.kernels.threads import on_kernel_thread

STREAM_BYTES = 1 << 30  # far above any last-level cache


@njit(parallel=True, nogil=True, cache=True)
def _max_lanes(a, nch):
    """The max of int32 ``a`` (length a multiple of 64), each thread over its slice in 64 lanes.  The
    max is exact in any order, and unsigned indices with a fixed lane loop let LLVM vectorize it (a
    plain ``s += a[i]`` loop is bound by its index checks: it measured a third of this)."""
    n = a.shape[0] // 64
    parts = np.zeros(nch, np.int64)
    for c in prange(nch):
        acc = np.zeros(64, np.int32)
        for r in range(n * c // nch, n * (c + 1) // nch):
            base = uint64(r) * uint64(64)
            for j in range(64):
                v = a[base + uint64(j)]
                if v > acc[j]:
                    acc[j] = v
        parts[c] = acc.max()
    return parts.max()


@on_kernel_thread  # (the process's parallel regions start from one thread: ``on_kernel_thread``)
def stream_gbs(threads: int, nbytes: int = STREAM_BYTES, passes: int = 5) -> float:
    """Best read rate over ``passes`` passes of a ``nbytes`` buffer with ``threads`` threads."""
    a = np.ones(nbytes // 4 // 64 * 64, np.int32)
    _max_lanes(a[:1024], threads)  # compile (or load) outside the timing
    best = 0.0
    for _ in range(passes):
        t0 = time.perf_counter()
        _max_lanes(a, threads)
        best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best
