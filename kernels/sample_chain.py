"""The sampler's chain with top-k, compiled: one row, or every row of a step on all threads.

What a request without penalties, bias, masks or a grammar asks - top-k, then top-p, min-p,
temperature and the inverse-CDF draw, in llama.cpp's order (``weaved.engine.sampling`` says what each
means) - depends only on its row of logits, the sampling fields and one uniform number from the
sequence's own generator.  So a step's rows can be sampled together, in parallel, and each row's token
is the one this same code gives it alone: the sampler's single-row path calls ``chain_row`` too.

A step of 64 rows over a 49k vocabulary spent ~2.5 ms in the per-row Python chain, 8 % of the
step; here it is one parallel region.

Numbers: top-k by ``topk.top_k_row`` (exact: descending, ties to the lower position); weights
``exp((v - max) * inv_t)`` in float32 (``expf``); running sums in float64, added in candidate order.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .topk import top_k_row

_OPTS = dict(cache=True, nogil=True, error_model="numpy")
GREEDY = 0  # k of a row sampled greedily: the first maximum
ALL_NEG_INF = -1  # every logit is -inf: nothing can be sampled
NOT_FINITE = -2  # the row holds NaN or +inf: the caller's own checks say what is wrong


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def _zero_sum(x):
    """The sum of 0 * v over x: 0 when every value is finite, NaN when one is NaN or infinite.  Only
    reassociation is allowed (so it vectorizes): NaN still propagates and 0 * v is not folded."""
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += x[i] * np.float32(0.0)
    return s


@njit(**_OPTS)
def _finite_or_neg_inf(x):
    """False when ``x`` holds NaN or +inf (a row with -inf, which only masks write, takes a second,
    slower look)."""
    s = _zero_sum(x)
    if s == s:
        return True
    for i in range(x.shape[0]):
        v = x[i]
        if v != v or v == np.inf:
            return False
    return True


@njit(**_OPTS)
def chain_row(x, k, top_p, min_p, inv_t, u):
    """The position drawn from x float32 [V] (finite or -inf; the caller has ruled out NaN):
    ``k`` = ``GREEDY`` takes the first maximum; else the ``k`` largest, then the nucleus ``top_p``
    (on the probabilities at temperature 1), then ``min_p`` (logit >= max + log(min_p)), then weights
    at ``inv_t`` = 1 / temperature and the first candidate whose running weight passes ``u`` (in
    [0, 1)) times the total.  ``ALL_NEG_INF`` when every logit is -inf."""
    if k == GREEDY:
        best = np.argmax(x)  # the first maximum
        return best if x[best] != -np.inf else ALL_NEG_INF
    ids = top_k_row(x, k)  # [n] descending, ties to the lower position
    n = ids.shape[0]
    vals = np.empty(n, np.float32)
    for j in range(n):
        vals[j] = x[ids[j]]
    mx = vals[0]
    if mx == -np.inf:
        return ALL_NEG_INF
    w = np.empty(n, np.float32)
    if top_p < 1.0:  # the shortest prefix whose probability reaches top_p (that token included)
        total = 0.0
        for j in range(n):
            w[j] = np.exp((vals[j] - mx) * np.float32(1.0))
            total += np.float64(w[j])
        target = top_p * total
        cum = 0.0
        keep = n
        for j in range(n):
            cum += np.float64(w[j])
            if cum >= target:
                keep = j + 1
                break
        n = keep
    if min_p > 0.0:  # the candidates are sorted: the survivors are a prefix
        thr = mx + np.float32(np.log(min_p))
        m = 0
        while m < n and vals[m] >= thr:
            m += 1
        n = m
    c = np.empty(n, np.float64)
    run = 0.0
    for j in range(n):
        w[j] = np.exp((vals[j] - mx) * inv_t)
        run += np.float64(w[j])
        c[j] = run
    t = u * c[n - 1]
    i = 0
    while i < n and c[i] <= t:
        i += 1
    if i >= n or w[i] == 0:  # rounding put the target at the end: the last candidate with weight
        i = min(i, n - 1)
        while i > 0 and w[i] == 0:
            i -= 1
    return ids[i]


@njit(**_OPTS)
def _one(rows, which, ks, top_ps, min_ps, inv_ts, us, out, r):
    x = rows[which[r]]
    if not _finite_or_neg_inf(x):
        out[r] = NOT_FINITE
    else:
        out[r] = chain_row(x, ks[r], top_ps[r], min_ps[r], inv_ts[r], us[r])


@njit(parallel=True, **_OPTS)
def chain_rows(rows, which, ks, top_ps, min_ps, inv_ts, us, out):
    """out[r] = chain_row(rows[which[r]], ks[r], ...) for every r, rows in parallel; ``NOT_FINITE``
    for a row holding NaN or +inf."""
    for r in prange(which.shape[0]):
        _one(rows, which, ks, top_ps, min_ps, inv_ts, us, out, r)


@njit(**_OPTS)
def chain_rows_serial(rows, which, ks, top_ps, min_ps, inv_ts, us, out):
    """chain_rows on the calling thread alone (a thread that runs no parallel kernels of its own)."""
    for r in range(which.shape[0]):
        _one(rows, which, ks, top_ps, min_ps, inv_ts, us, out, r)
