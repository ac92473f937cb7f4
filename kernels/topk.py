"""The k largest values of a row of logits, by position: the sampler's top-k and top-logprobs selection.

Exact comparisons only, so the result is the one a sort would give: the k largest values, ties at the
k-th value going to the lowest positions, ordered by descending value and then ascending position.
It reads the row once for its 64-value blocks' maxima (one vectorized pass), takes the k-th largest
of those as a floor (k blocks reach it, so at least k values do), reads again only the blocks that
reach it (about k of them) and sorts the few values at or above the floor.  numpy's way - block
maxima, a mask of the row, a partition, an index array of the vocabulary's size - makes five passes.
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

BLOCK = 64  # values per block of the first pass (a block's maximum is one vector reduction)


@njit(cache=True, nogil=True, fastmath={"nnan"})
def _block_maxima(vals, size):
    """The maximum of each ``size``-value block of ``vals`` (the last block may be shorter).  Without NaN
    the maximum is exact in any order (nnan: no NaN here); full blocks of ``BLOCK`` run as 16 lanes
    with unsigned indices, which LLVM vectorizes (a plain running maximum measured 2.3x slower)."""
    n = vals.shape[0]
    nb = (n + size - 1) // size
    out = np.empty(nb, vals.dtype)
    full = n // size if size == BLOCK else 0
    acc = np.empty(16, vals.dtype)
    for b in range(full):
        base = uint64(b) * uint64(BLOCK)
        for j in range(16):
            acc[j] = vals[base + uint64(j)]
        for r in range(1, BLOCK // 16):
            for j in range(16):
                v = vals[base + uint64(16 * r + j)]
                acc[j] = v if v > acc[j] else acc[j]
        m = acc[0]
        for j in range(1, 16):
            m = acc[j] if acc[j] > m else m
        out[b] = m
    for b in range(full, nb):
        lo = b * size
        m = vals[lo]
        for i in range(lo + 1, min(n, lo + size)):
            m = vals[i] if vals[i] > m else m
        out[b] = m
    return out


@njit(cache=True, nogil=True)
def top_k_row(vals, k):
    """``top_k_positions`` in compiled code (vals contiguous, k >= 1; no checks)."""
    n = vals.shape[0]
    size = max(1, min(BLOCK, n // (4 * k)))
    bm = _block_maxima(vals, size)
    nb = bm.shape[0]
    if nb <= k:
        return np.argsort(-vals, kind="mergesort")
    # the k-th largest block maximum: k blocks reach it, so >= k values lie at or above it, all in the
    # blocks whose maximum reaches it (about k of them): only those are read again
    floor = np.partition(bm, nb - k)[nb - k]
    reach = 0
    for b in range(nb):
        if bm[b] >= floor:
            reach += 1
    cand = np.empty(reach * size, np.int64)  # not [n]: a vocabulary-sized allocation is an mmap and a munmap
    m = 0
    for b in range(nb):
        if bm[b] >= floor:
            for i in range(b * size, min(n, b * size + size)):
                if vals[i] >= floor:
                    cand[m] = i
                    m += 1
    cv = np.empty(m, vals.dtype)
    for j in range(m):
        cv[j] = vals[cand[j]]
    kth = np.partition(cv, m - k)[m - k]
    above = 0
    for j in range(m):
        if cv[j] > kth:
            above += 1
    ties = k - above  # of the values equal to the k-th, the first ones by position
    keep = np.empty(k, np.int64)
    t = 0
    for j in range(m):
        v = cv[j]
        if v > kth or (v == kth and ties > 0):
            if v == kth:
                ties -= 1
            keep[t] = cand[j]
            t += 1
    kv = np.empty(k, vals.dtype)
    for j in range(k):
        kv[j] = vals[keep[j]]
    return keep[np.argsort(-kv, kind="mergesort")]  # descending, ties in position order


def top_k_positions(vals: np.ndarray, k: int) -> np.ndarray:
    """Positions (int64 [min(k, n)]) of the ``k`` largest of ``vals`` (float32 or float64 [n], no NaN),
    sorted by descending value, ties by ascending position; every position when k >= n."""
    if vals.ndim != 1 or vals.dtype not in (np.float32, np.float64):
        raise ValueError(f"top_k_positions takes a float32/float64 row, got {vals.dtype} {vals.shape}")
    if k < 1:
        raise ValueError(f"top_k_positions needs k >= 1, got {k}")
    return top_k_row(np.ascontiguousarray(vals), int(k))
