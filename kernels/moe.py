"""A mixture-of-experts FFN on the CPU: the router, then each expert's products over the tokens routed
to it, weighted and summed in a fixed order.

The router is llama.cpp's (``build_moe_ffn`` with softmax gating and normalized weights, as qwen3moe
and Mixtral-style llama files ask): logits ``h @ W_inp.T``; a softmax over every expert; the
``k`` most probable, most probable first; their probabilities divided by their sum (clamped below at
6.103515625e-5 as ggml does).  Here a logit is a float32 dot product in 16 interleaved lanes added
by a fixed tree (``_logit``; llama.cpp's sgemm sums in float32 too, in its own order), and the softmax
is ``elementwise``'s (exp_f32, float64 sum in 16 lanes) - plain float32 and float64 adds and
multiplies that torch reproduces op for op (``torch_moe``), and the bits depend on the token's row
alone.  Equal probabilities go to the lower expert index (llama.cpp's ``std::sort`` leaves their
order unspecified; only exact ties can differ).

The experts: the step's (token, slot) pairs are grouped by expert, and each expert's fused gate|up
product, SwiGLU and down product run once over all the tokens routed to it (its weights read once
per step), through the dense kernels' gemm - each output element is computed by the same per-column
recipe whatever else is in the product, so a token's result does not depend on the batch.  Each
token's k outputs are scaled by their weights and added in selection order, ``((y0 + y1) + y2) ...``,
as llama.cpp's chain of ``ggml_add``s does.  Experts run in parallel, each on one thread, shared out
largest first to the least loaded thread (a decode step's 8 experts: 4 a thread on 2); a thread done
with its share takes experts from the back of the others' (``_steal``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.typed import List as TypedList

from . import _gemm_driver, _steal
from ._router_ir import GROUP, logits4
from ._rowwise import OPTS
from .elementwise import softmax_drive, swiglu_drive
from .matmul import PackedWeight, gemm_marker
from .threads import get_threads, on_kernel_thread

WEIGHT_SUM_MIN = np.float32(6.103515625e-5)  # ggml_clamp of the selected weights' sum (llama.cpp)
LANES = 16  # the router's dot products: float32 lanes, as a 512-bit vector holds them
PAR_MIN_ROUTE_TOKENS = 4  # a token's routing takes tens of us: fewer split the experts over the threads
PAR_MIN_ROUTER_WEIGHTS = 1 << 16  # smaller routers (8 experts of 4,096: 128 KB) stay on the calling thread
TOKEN_SHARE = 0.25  # an expert's cost per token routed to it, against reading its weights (1.0)
_F64 = np.float64


@njit(**OPTS)
def _logit(h, w, lanes):
    """h . w (float32 [d]; d a multiple of 32, as Q4_0 rows are) in 16 interleaved float32 lanes -
    each lane[l] = lane[l] + h[16 b + l] * w[16 b + l], block after block (two roundings: no fma,
    which torch's CPU ops lack) - then the lanes by the fixed tree l + l+8, +4, +2, +1."""
    for i in range(LANES):
        lanes[i] = 0.0
    for b in range(0, h.shape[0], LANES):
        for i in range(LANES):
            lanes[i] = lanes[i] + h[b + i] * w[b + i]
    n = LANES
    while n > 1:
        n //= 2
        for i in range(n):
            lanes[i] = lanes[i] + lanes[n + i]
    return lanes[0]


@njit(**OPTS)
def _logits(h, w, e_lo, e_hi, z, lanes):
    """z[e] = _logit(h, w[e]) for e in [e_lo, e_hi): four experts at a time (``_router_ir``, the same
    bits), the rest one by one."""
    e = e_lo
    while e + GROUP <= e_hi:
        logits4(h, w, e, z)
        e += GROUP
    for r in range(e, e_hi):
        z[r] = _logit(h, w[r], lanes)


@njit(**OPTS)
def _route_row(h, w, k, z, p, lanes, ids, wts):
    """One token: h float32 [d], w float32 [E, d] -> ids int32 [k] (most probable first), wts float32 [k]."""
    _logits(h, w, 0, w.shape[0], z, lanes)
    _select(z, k, p, ids, wts)


@njit(**OPTS)
def _select(z, k, p, ids, wts):
    """One token's router logits z float32 [E] -> its k experts (most probable first) and weights."""
    E = z.shape[0]
    softmax_drive(z.reshape(1, E), p.reshape(1, E))
    for i in range(k):  # the i-th largest; ties to the lower index
        best = -1
        for e in range(E):
            taken = False
            for j in range(i):
                if ids[j] == e:
                    taken = True
            if not taken and (best < 0 or p[e] > p[best]):
                best = e
        ids[i] = best
    s = 0.0
    for i in range(k):
        s += _F64(p[ids[i]])
    total = max(np.float32(s), WEIGHT_SUM_MIN)
    for i in range(k):
        wts[i] = p[ids[i]] / total


@njit(**OPTS)
def _route_serial(h, w, k, ids, wts):
    E = w.shape[0]
    z, p, lanes = np.empty(E, np.float32), np.empty(E, np.float32), np.empty(LANES, np.float32)
    for t in range(h.shape[0]):
        _route_row(h[t], w, k, z, p, lanes, ids[t], wts[t])


@njit(parallel=True, **OPTS)
def _route_parallel(h, w, k, ids, wts):
    E = w.shape[0]
    for t in prange(h.shape[0]):
        z, p, lanes = np.empty(E, np.float32), np.empty(E, np.float32), np.empty(LANES, np.float32)
        _route_row(h[t], w, k, z, p, lanes, ids[t], wts[t])


@njit(parallel=True, **OPTS)
def _route_few(h, w, k, ids, wts, nthreads):
    """A few tokens: the router's rows (1 MB of float32 for 128 experts of 2,048) read by every thread,
    each its share of the experts, then each token's selection on the calling thread."""
    T, E = h.shape[0], w.shape[0]
    z = np.empty((T, E), np.float32)
    for c in prange(nthreads):
        lanes = np.empty(LANES, np.float32)
        hi = E * (c + 1) // nthreads
        for e in range(E * c // nthreads, hi, GROUP):  # a group's rows read once, then used for every token
            for t in range(T):
                _logits(h[t], w, e, min(e + GROUP, hi), z[t], lanes)
    p = np.empty(E, np.float32)
    for t in range(T):
        _select(z[t], k, p, ids[t], wts[t])


@njit(**OPTS)
def route_drive(h, w, k, ids, wts, nthreads):
    """Every token's experts and weights: h float32 [T, d], w float32 [E, d] -> ids int32 [T, k],
    wts float32 [T, k].  Few tokens split the experts over the threads (a decode step's one token
    reads the whole router: ~25 us on one thread, ~15 on two), more split the tokens: each logit's
    bits are its own either way."""
    if h.shape[0] >= PAR_MIN_ROUTE_TOKENS:
        _route_parallel(h, w, k, ids, wts)
    elif nthreads > 1 and w.shape[0] * w.shape[1] >= PAR_MIN_ROUTER_WEIGHTS:
        _route_few(h, w, k, ids, wts, nthreads)
    else:
        _route_serial(h, w, k, ids, wts)


@njit(**OPTS)
def _expert(mk, gu, down, qk_gu, qk_down, ff, rows, h, wts_flat, out_flat):
    """One expert over its (token, slot) rows: gate|up, SwiGLU, down, each row scaled by its weight into
    out_flat [T * k, d] (row = token * k + slot)."""
    n = rows.shape[0]
    d = h.shape[1]
    k = wts_flat.shape[0] // h.shape[0]
    x = np.empty((n, d), np.float32)
    for r in range(n):
        x[r] = h[rows[r] // k]
    noq, nod, nos = np.empty((0, 0, 32), np.int8), np.empty((0, 0), np.float32), np.empty((0, 0), np.int32)
    g = np.empty((n, 2 * ff), np.float32)
    _gemm_driver.run_serial(mk, gu, qk_gu, 2 * ff, x, noq, nod, nos, g)
    a = np.empty((n, ff), np.float32)
    swiglu_drive(g, a)
    y = np.empty((n, d), np.float32)
    _gemm_driver.run_serial(mk, down, qk_down, d, a, noq, nod, nos, y)
    for r in range(n):
        c = wts_flat[rows[r]]
        dst = out_flat[rows[r]]
        for j in range(d):
            dst[j] = y[r, j] * c


@njit(**OPTS)
def _share(counts, nthreads):
    """The used experts split over ``nthreads`` threads, largest first to the least loaded (an expert
    costs its weights' read, the same for all, plus a little per token): (experts int64 [used], ends
    int64 [threads + 1]), thread c's experts being experts[ends[c]:ends[c + 1]] in the order given."""
    E = counts.shape[0]
    by_size = np.argsort(-counts, kind="mergesort")
    lanes = np.empty((nthreads, E), np.int64)
    fill = np.zeros(nthreads, np.int64)
    load = np.zeros(nthreads, np.float64)
    for e in by_size:
        if counts[e] == 0:
            break
        c = np.argmin(load)
        lanes[c, fill[c]] = e
        fill[c] += 1
        load[c] += TOKEN_SHARE * counts[e] + 1.0
    ends = np.zeros(nthreads + 1, np.int64)
    for c in range(nthreads):
        ends[c + 1] = ends[c] + fill[c]
    experts = np.empty(ends[nthreads], np.int64)
    for c in range(nthreads):
        experts[ends[c]:ends[c + 1]] = lanes[c, :fill[c]]
    return experts, ends


@njit(parallel=True, **OPTS)
def experts_drive(mk, h, ids, wts, gu_mats, down_mats, base, E, qk_gu, qk_down, ff, nthreads, out):
    """out float32 [T, d] = each token's k experts (packed gate|up and down matrices ``gu_mats[base + e]``,
    ``down_mats[base + e]``, e < E) on h float32 [T, d], weighted by wts [T, k] and added in slot order."""
    T, k = ids.shape
    d = h.shape[1]
    flat = ids.reshape(T * k)
    counts = np.zeros(E, np.int64)
    for r in range(T * k):
        counts[flat[r]] += 1
    starts = np.zeros(E + 1, np.int64)
    for e in range(E):
        starts[e + 1] = starts[e] + counts[e]
    order = np.empty(T * k, np.int64)  # (token, slot) rows grouped by expert, in row order
    fill = starts[:-1].copy()
    for r in range(T * k):
        e = flat[r]
        order[fill[e]] = r
        fill[e] += 1
    used, ends = _share(counts, nthreads)
    ys = np.empty((T * k, d), np.float32)
    wflat = wts.reshape(T * k)
    # each thread runs its share, then takes experts from the back of the others' (``_steal``)
    st = _steal.ranges_at(ends)
    for c in prange(nthreads):
        j = 0
        while True:
            i0, i1, j = _steal.take(st, c, 1, j)
            if i1 == 0:
                break
            e = used[i0]
            _expert(mk, gu_mats[base + e], down_mats[base + e], qk_gu, qk_down, ff, order[starts[e]:starts[e + 1]],
                    h, wflat, ys)
    for t in range(T):
        out[t] = ys[t * k]
        for i in range(1, k):
            out[t] += ys[t * k + i]


class ExpertWeights:
    """One layer's experts in the kernels' layout: the router (float32 [E, d]), each expert's fused
    gate|up and down matrices (``PackedWeight``s, one type per kind)."""

    def __init__(self, router: np.ndarray, gate_up: list[PackedWeight], down: list[PackedWeight]):
        E = router.shape[0]
        if router.dtype != np.float32 or router.ndim != 2 or len(gate_up) != E or len(down) != E:
            raise ValueError(f"ExpertWeights: a float32 [E, d] router and E gate|up and down matrices, got "
                             f"{router.dtype} {router.shape}, {len(gate_up)} and {len(down)}")
        kinds = {(w.qk, w.n_out, w.n_in) for w in gate_up}, {(w.qk, w.n_out, w.n_in) for w in down}
        if len(kinds[0]) != 1 or len(kinds[1]) != 1 or not all(kind[0] for s in kinds for kind in s):
            raise ValueError("ExpertWeights: every expert's matrices must be Q4_0/Q8_0 of one shape per kind")
        (qk_gu, n_gu, d_in), (qk_down, d_out, ff) = next(iter(kinds[0])), next(iter(kinds[1]))
        if n_gu != 2 * ff or d_in != d_out or d_in != router.shape[1]:
            raise ValueError(f"ExpertWeights: gate|up [{n_gu}, {d_in}] and down [{d_out}, {ff}] do not fit a "
                             f"router over {router.shape[1]}")
        self.router = np.ascontiguousarray(router)
        self.gate_up, self.down = gate_up, down
        self.gu_data, self.down_data = TypedList([w.data for w in gate_up]), TypedList([w.data for w in down])
        self.qk_gu, self.qk_down, self.ff, self.d = qk_gu, qk_down, ff, d_in

    @property
    def n_experts(self) -> int:
        return self.router.shape[0]

    @property
    def nbytes_per_expert(self) -> int:
        return self.gate_up[0].nbytes + self.down[0].nbytes


@on_kernel_thread
def route(h: np.ndarray, w: ExpertWeights, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(experts int32 [T, k], weights float32 [T, k]) of h float32 [T, d] (C-contiguous)."""
    _check_h(h, w)
    if not 1 <= k <= w.n_experts:
        raise ValueError(f"route: k must be in [1, {w.n_experts}], got {k}")
    T = h.shape[0]
    ids, wts = np.empty((T, k), np.int32), np.empty((T, k), np.float32)
    if T:
        route_drive(h, w.router, k, ids, wts, get_threads())
    return ids, wts


@on_kernel_thread
def moe_ffn(h: np.ndarray, w: ExpertWeights, k: int) -> np.ndarray:
    """The FFN of a mixture of experts on h float32 [T, d] (the FFN norm's output) -> float32 [T, d]."""
    ids, wts = route(h, w, k)
    out = np.empty_like(h)
    if h.shape[0]:
        experts_drive(gemm_marker(), h, ids, wts, w.gu_data, w.down_data, 0, w.n_experts, w.qk_gu, w.qk_down, w.ff,
                      get_threads(), out)
    return out


def _check_h(h: np.ndarray, w: ExpertWeights) -> None:
    if not (isinstance(h, np.ndarray) and h.dtype == np.float32 and h.ndim == 2 and h.shape[1] == w.d
            and h.flags.c_contiguous):
        raise ValueError(f"moe: h must be a C-contiguous float32 [T, {w.d}] array, got "
                         f"{getattr(h, 'dtype', type(h))} {getattr(h, 'shape', '')}")
