"""What this machine streams from memory: the read bandwidth a decode step's weights are held to.

A decode step reads every weight once, so its ceiling is the rate the cores can stream a buffer far
larger than the caches.  This reads one with every thread of the benchmark's budget (numba's pool,
a static split like the gemm's) and reports the best of a few passes in GB/s (10^9 bytes).
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange

STREAM_BYTES = 1 << 30  # far above any last-level cache


@njit(parallel=True, nogil=True, cache=True)
def _sum_chunks(a, nch):
    n = a.shape[0]
    parts = np.zeros(nch, np.int64)
    for c in prange(nch):
        s = np.int64(0)
        for i in range(n * c // nch, n * (c + 1) // nch):
            s += a[i]
        parts[c] = s
    return parts.sum()


def stream_gbs(threads: int, nbytes: int = STREAM_BYTES, passes: int = 5) -> float:
    """Best read rate over ``passes`` passes of a ``nbytes`` buffer with ``threads`` threads."""
    a = np.ones(nbytes // 8, np.int64)
    _sum_chunks(a[:1024], threads)  # compile (or load) outside the timing
    best = 0.0
    for _ in range(passes):
        t0 = time.perf_counter()
        _sum_chunks(a, threads)
        best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best
