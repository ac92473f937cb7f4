"""y = x @ W.T for F16 / F32 weights (packed float32 [nt, n_in, RT], rows in lanes), plain numba.

Each output element is one fma chain over k = 0..n_in-1 in order, whatever the number of tokens or
the thread split: batch invariant.  Vectorization runs across the 32 rows of a tile, never across k.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._llvm import fma_f32
from ._pack import RT

_OPTS = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False)


@njit(**_OPTS)
def _chunk(n, nch, k):
    return n * k // nch, n * (k + 1) // nch


@njit(**_OPTS)
def _rows(W, t0, t1, n_out, X, Y):
    T, n_in = X.shape
    rt = W.shape[2]  # = RT, but a run-time value: a constant trip count of 32 gets fully unrolled
    acc = np.empty(RT, np.float32)  # into scalar code instead of vectorized across the rows
    for t in range(t0, t1):
        nr = min(RT, n_out - t * RT)
        wt = W[t]
        for c in range(T):
            for r in range(rt):
                acc[r] = np.float32(0.0)
            for k in range(n_in):
                xv = X[c, k]
                for r in range(rt):
                    acc[r] = fma_f32(wt[k, r], xv, acc[r])
            for r in range(nr):
                Y[c, t * RT + r] = acc[r]


@njit(**_OPTS)
def linear_float_serial(W, n_out, X, Y):
    _rows(W, 0, W.shape[0], n_out, X, Y)


@njit(parallel=True, **_OPTS)
def linear_float_par(W, n_out, X, Y, nch):
    for k in prange(nch):
        t0, t1 = _chunk(W.shape[0], nch, k)
        _rows(W, t0, t1, n_out, X, Y)
