"""The numba driver of attention: a batch's rows cut into work items, spread over the threads, and the
merge of their chunks (the batch entry points are ``_attention_batch``, the arithmetic of an item
``_attention_chunk``).

Arithmetic of one query row (what makes it batch invariant): its keys 0..n-1 are cut into chunks of
``CHUNK`` keys at fixed offsets 0, CHUNK, 2*CHUNK, ...  A chunk is processed ``BLOCK`` keys at a
time with an online softmax (running max, rescaled sum and output) and yields (max, sum,
unnormalised output); the chunks are then merged in chunk order.  The batch and the thread count
only decide which thread computes which item and which rows share a tile, never how a row's chunk
is computed.  Nothing carries fast-math flags; sums vectorize through fixed lanes or register tiles
(``_attention_ir``), not by reassociation.

A work item is one chunk of one kv head for a tile of query rows: the GQA query heads sharing the
kv head, of up to ``tile_rows`` consecutive rows that read the same keys (a prompt's rows; a decode
row is a tile of one).  K/V are addressed by the address of a kv head's position 0 (rows of head_dim
float16); head_dim % 16 == 0 takes the register-tiled path, other sizes a plain-loop path, one row
at a time.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from weaved.kernels._attention_chunk import BLOCK, CHUNK, chunk_plain, chunk_tile, scratch, tile_rows
from weaved.kernels._rowwise import exp_f32

from . import _steal

__all__ = ["BLOCK", "CHUNK", "attend_rows"]

ITEM_OVERHEAD = 32  # fixed cost of a row's chunk, in keys, when balancing threads
SERIAL_COST = 1024  # groups cheaper than this (in keys) run on one thread
OWN_ITEMS = 4  # work items a thread takes at a time from its own range (one at a time from the others')

# error_model "numpy": x / 0 gives inf; the "python" model checks every division, which blocks vectorizing
_OPTS = dict(cache=True, nogil=True, error_model="numpy")
_NEG_INF = np.float32(-np.inf)


@njit(**_OPTS)
def _merge_chunks(part_acc, part_ml, it0, n, g, out, lse, t, h0):
    """Merge the n chunk partials part_*[it0:it0+n, g] of row t into out[t, h0:h0+G], lse[t, h0:h0+G]."""
    G, D = part_acc.shape[2], part_acc.shape[3]
    for gg in range(G):
        h = h0 + gg
        m = _NEG_INF
        for c in range(n):
            m = max(m, part_ml[it0 + c, g, gg, 0])
        for d in range(D):
            out[t, h, d] = 0.0
        if m == _NEG_INF:  # no keys: an empty shard
            lse[t, h] = _NEG_INF
            continue
        total = np.float32(0.0)
        for c in range(n):
            w = exp_f32(part_ml[it0 + c, g, gg, 0] - m)
            total += part_ml[it0 + c, g, gg, 1] * w
            for d in range(D):
                out[t, h, d] += w * part_acc[it0 + c, g, gg, d]
        for d in range(D):
            out[t, h, d] = out[t, h, d] / total
        lse[t, h] = m + np.log(total)


@njit(**_OPTS)
def _works(q, kaddr, vaddr, row_nkeys, scale, units, first, r0, part_acc, part_ml, w0, w1):
    """Chunk partials of works w0 .. w1-1 on one thread (see ``_works_in``)."""
    G, D = part_acc.shape[2], part_acc.shape[3]
    sc = scratch(G, D, tile_rows(G, D))
    _works_in(q, kaddr, vaddr, row_nkeys, scale, units, first, r0, part_acc, part_ml, w0, w1, sc)


@njit(**_OPTS)
def _works_in(q, kaddr, vaddr, row_nkeys, scale, units, first, r0, part_acc, part_ml, w0, w1, sc):
    """Work w is unit w // n_kv (rows t0..t0+R-1, chunk c: ``units[u]``), kv head w % n_kv; row r's
    partial for chunk c goes to item first[r - r0] + c of part_*.  sc: ``scratch``."""
    qt, acc, ml, kf, s, lanes, j1s = sc
    n_kv, G, D = part_acc.shape[1], part_acc.shape[2], part_acc.shape[3]
    for w in range(w0, w1):
        u = w // n_kv
        g = w % n_kv
        t0, R, c = units[u, 0], units[u, 1], units[u, 2]
        j0 = c * CHUNK
        it = first[t0 - r0] + c
        if D % 16:
            chunk_plain(q, t0, g * G, kaddr[t0, g], vaddr[t0, g], j0, min(j0 + CHUNK, row_nkeys[t0]), scale,
                        part_acc[it, g], part_ml[it, g], kf, s, lanes)
            continue
        for r in range(R):
            j1s[r] = min(j0 + CHUNK, row_nkeys[t0 + r])
        if R == 1:  # a decode row: straight into its partial
            chunk_tile(q, t0, 1, g * G, G, kaddr[t0, g], vaddr[t0, g], j0, j1s, scale, qt, part_acc[it, g],
                       part_ml[it, g], kf, s, lanes)
            continue
        chunk_tile(q, t0, R, g * G, G, kaddr[t0, g], vaddr[t0, g], j0, j1s, scale, qt, acc, ml, kf, s, lanes)
        for r in range(R):
            it = first[t0 + r - r0] + c
            for gg in range(G):
                part_ml[it, g, gg, 0] = ml[r * G + gg, 0]
                part_ml[it, g, gg, 1] = ml[r * G + gg, 1]
                for d in range(D):
                    part_acc[it, g, gg, d] = acc[r * G + gg, d]


@njit(**_OPTS)
def _same_keys(kaddr, vaddr, a, b):
    for g in range(kaddr.shape[1]):
        if kaddr[a, g] != kaddr[b, g] or vaddr[a, g] != vaddr[b, g]:
            return False
    return True


@njit(**_OPTS)
def _group(row_nkeys, n_ch, r0, max_items, n_kv, n_slices, kaddr, vaddr, rt):
    """The group of rows from r0 on whose chunks fit max_items (at least one row): (r1, first item of
    each row, units, n_work, cost, thread cuts).  Rows are tiled: up to rt consecutive rows reading the
    same keys with non-decreasing key counts; a unit is (first row, row count, chunk) of the tile's
    rows that have that chunk (a suffix of the tile).  Work w is unit w // n_kv, kv head w % n_kv;
    cost: cumulative key counts (+ overhead per row); thread i takes work cuts[i] .. cuts[i + 1] - 1."""
    T = row_nkeys.shape[0]
    r1 = r0 + 1
    tot = n_ch[r0]
    while r1 < T and tot + n_ch[r1] <= max_items:
        tot += n_ch[r1]
        r1 += 1
    first = np.empty(r1 - r0 + 1, np.int64)
    k = 0
    for r in range(r0, r1):
        first[r - r0] = k
        k += n_ch[r]
    first[r1 - r0] = k
    units = np.empty((max(tot, 1), 3), np.int64)
    ucost = np.empty(max(tot, 1), np.int64)
    n_u = 0
    a = r0
    while a < r1:
        b = a + 1
        while b < r1 and b - a < rt and row_nkeys[b] >= row_nkeys[b - 1] and _same_keys(kaddr, vaddr, a, b):
            b += 1
        for c in range(n_ch[b - 1]):
            ra = a
            while n_ch[ra] <= c:
                ra += 1
            units[n_u, 0], units[n_u, 1], units[n_u, 2] = ra, b - ra, c
            cst = 0
            for r in range(ra, b):
                cst += min(CHUNK, row_nkeys[r] - c * CHUNK) + ITEM_OVERHEAD
            ucost[n_u] = cst
            n_u += 1
        a = b
    n_work = n_u * n_kv
    cost = np.empty(n_work + 1, np.int64)
    cost[0] = 0
    for w in range(n_work):
        cost[w + 1] = cost[w] + ucost[w // n_kv]
    n_thr = max(1, min(n_slices, n_work))
    cuts = np.empty(n_thr + 1, np.int64)
    w = 0
    for i in range(n_thr):
        while w < n_work and cost[w] * n_thr < cost[n_work] * i:
            w += 1
        cuts[i] = w
    cuts[n_thr] = n_work
    return r1, first, units[:n_u], n_work, cost, cuts


@njit(**_OPTS)
def _merge_rows(part_acc, part_ml, first, n_ch, r0, r1, out, lse):
    for r in range(r0, r1):
        for g in range(part_acc.shape[1]):
            _merge_chunks(part_acc, part_ml, first[r - r0], n_ch[r], g, out, lse, r, g * part_acc.shape[2])


@njit(**_OPTS)
def attend_rows(q, kaddr, vaddr, row_nkeys, scale, out, lse, n_slices, max_items):
    """out/lse of every row t of q over its keys 0..row_nkeys[t]-1; the K/V rows of kv head g for row
    t start at kaddr[t, g], vaddr[t, g].  Rows are taken in groups of at most max_items chunks
    (bounded scratch; one row may exceed it); a group's work is split into at most n_slices runs
    of about equal key counts, run in parallel.  Work too small to be worth a parallel launch runs
    here, on the calling thread: merely entering the parallel driver cost ~1 us, a third of a
    decode row's attention over a short context."""
    n_kv = kaddr.shape[1]
    n_ch = (row_nkeys + (CHUNK - 1)) // CHUNK  # [T] chunks per row
    total = 0
    for t in range(row_nkeys.shape[0]):
        total += (row_nkeys[t] + ITEM_OVERHEAD * n_ch[t]) * n_kv
    if n_slices > 1 and total >= SERIAL_COST:
        _attend_rows_par(q, kaddr, vaddr, row_nkeys, scale, out, lse, n_slices, max_items, n_ch)
        return
    G, D = q.shape[1] // n_kv, q.shape[2]
    rt = tile_rows(G, D)
    r0 = 0
    while r0 < row_nkeys.shape[0]:
        r1, first, units, n_work, _cost, _cuts = _group(row_nkeys, n_ch, r0, max_items, n_kv, 1, kaddr, vaddr, rt)
        part_acc = np.empty((first[r1 - r0], n_kv, G, D), np.float32)
        part_ml = np.empty((first[r1 - r0], n_kv, G, 2), np.float32)
        _works(q, kaddr, vaddr, row_nkeys, scale, units, first, r0, part_acc, part_ml, 0, n_work)
        _merge_rows(part_acc, part_ml, first, n_ch, r0, r1, out, lse)
        r0 = r1


@njit(parallel=True, **_OPTS)
def _attend_rows_par(q, kaddr, vaddr, row_nkeys, scale, out, lse, n_slices, max_items, n_ch):
    """``attend_rows`` with its groups' work split over the threads (a group too small for that runs
    serially, with the same arithmetic)."""
    T, H, D = q.shape
    n_kv = kaddr.shape[1]
    G = H // n_kv
    rt = tile_rows(G, D)
    r0 = 0
    while r0 < T:
        r1, first, units, n_work, cost, cuts = _group(row_nkeys, n_ch, r0, max_items, n_kv, n_slices, kaddr,
                                                      vaddr, rt)
        tot = first[r1 - r0]
        part_acc = np.empty((tot, n_kv, G, D), np.float32)
        part_ml = np.empty((tot, n_kv, G, 2), np.float32)
        n_thr = cuts.shape[0] - 1
        # a parallel launch costs microseconds: small groups run on the calling thread (same arithmetic)
        if n_thr == 1 or cost[n_work] < SERIAL_COST:
            _works(q, kaddr, vaddr, row_nkeys, scale, units, first, r0, part_acc, part_ml, 0, n_work)
        else:
            # each thread owns its cut and takes what is left of the others' once done (``_steal``)
            st = _steal.ranges_at(cuts)
            for i in prange(n_thr):
                sc = scratch(G, D, rt)
                j = 0
                while True:
                    w0, w1, j = _steal.take(st, i, OWN_ITEMS, j)
                    if w1 == 0:
                        break
                    _works_in(q, kaddr, vaddr, row_nkeys, scale, units, first, r0, part_acc, part_ml, w0, w1, sc)
        if r1 - r0 < 16:
            _merge_rows(part_acc, part_ml, first, n_ch, r0, r1, out, lse)
        else:
            for w in prange((r1 - r0) * n_kv):
                r = r0 + w // n_kv
                g = w % n_kv
                _merge_chunks(part_acc, part_ml, first[r - r0], n_ch[r], g, out, lse, r, g * G)
        r0 = r1
