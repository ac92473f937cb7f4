"""The batch entry points of the numba attention: a batch of sequences' KV arrays checked, its new
K/V rows stored as float16, and its causal (or sliding-window) attention addressed row by row for
``_attention_rows.attend_rows``."""

from __future__ import annotations

import numpy as np
from numba import njit
from weaved.kernels._attention_ir import f2h

from ._attention_rows import attend_rows
from ._rowwise import OPTS


@njit(**OPTS)
def _check_batch(kvs, layer, seq_starts, pos0, T, n_kv, D):
    """(0, -1) if the batch is consistent, else (error code, sequence or -1)."""
    S = pos0.shape[0]
    if seq_starts.shape[0] != S + 1 or len(kvs) != S:
        return 1, -1
    if seq_starts[0] != 0 or seq_starts[S] != T:
        return 2, -1
    for s in range(S):
        a = kvs[s]
        if seq_starts[s + 1] < seq_starts[s]:
            return 2, s
        if pos0[s] < 0:
            return 3, s
        if not (0 <= layer < a.shape[0]) or a.shape[1] != 2 or a.shape[2] != n_kv or a.shape[4] != D:
            return 4, s
        if pos0[s] + seq_starts[s + 1] - seq_starts[s] > a.shape[3]:
            return 5, s
    return 0, -1


@njit(**OPTS)
def kv_store_batch(kvs, layer, seq_starts, pos0, k, v):
    """Check the batch, then store row seq_starts[s] + i of k, v (float32 [T, n_kv, D]) as float16 at
    kvs[s][layer, 0 / 1, :, pos0[s] + i]; returns (error code, sequence) as ``_check_batch``."""
    code, bad = _check_batch(kvs, layer, seq_starts, pos0, k.shape[0], k.shape[1], k.shape[2])
    if code:
        return code, bad
    for s in range(pos0.shape[0]):
        a = kvs[s]
        for t in range(seq_starts[s], seq_starts[s + 1]):
            p = pos0[s] + (t - seq_starts[s])
            for h in range(k.shape[1]):
                for d in range(k.shape[2]):
                    a[layer, 0, h, p, d] = f2h(k[t, h, d])
                for d in range(k.shape[2]):
                    a[layer, 1, h, p, d] = f2h(v[t, h, d])
    return 0, -1


@njit(**OPTS)
def attend_batch(q, kvs, layer, seq_starts, pos0, scale, window, out, lse, n_slices, max_items):
    """Check the batch, then causal attention: row seq_starts[s] + i at position p = pos0[s] + i sees
    keys 0..p of kvs[s][layer], or with ``window`` > 0 the last ``window`` of them (p - window < j <=
    p); returns (error code, sequence) as ``_check_batch`` (6: heads not a multiple).  A windowed row
    addresses its keys from its first one, so its chunks start there: still a function of the row."""
    T, H, D = q.shape
    if len(kvs) == 0:
        return 1, -1
    n_kv = kvs[0].shape[2]
    if H % n_kv:
        return 6, -1
    code, bad = _check_batch(kvs, layer, seq_starts, pos0, T, n_kv, D)
    if code:
        return code, bad
    kaddr = np.empty((T, n_kv), np.int64)
    vaddr = np.empty((T, n_kv), np.int64)
    row_nkeys = np.empty(T, np.int64)
    for s in range(pos0.shape[0]):
        a = kvs[s]
        for g in range(n_kv):
            ka = a[layer, 0, g].ctypes.data
            va = a[layer, 1, g].ctypes.data
            for t in range(seq_starts[s], seq_starts[s + 1]):
                kaddr[t, g] = ka
                vaddr[t, g] = va
        for t in range(seq_starts[s], seq_starts[s + 1]):
            n = pos0[s] + (t - seq_starts[s]) + 1
            lo = n - window if 0 < window < n else 0  # the row's first key
            row_nkeys[t] = n - lo
            for g in range(n_kv):
                kaddr[t, g] += lo * D * 2  # float16 rows of D values
                vaddr[t, g] += lo * D * 2
    attend_rows(q, kaddr, vaddr, row_nkeys, scale, out, lse, n_slices, max_items)
    return 0, -1
