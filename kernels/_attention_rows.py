"""The numba side of attention: the chunk kernel of one (row, kv head), the merge of chunks and the
parallel driver over rows (the batch entry points are ``_attention_batch``).

Arithmetic of one query row (what makes it batch invariant): its keys 0..n-1 are cut into chunks of
``CHUNK`` keys at fixed offsets 0, CHUNK, 2*CHUNK, ...  A chunk is processed ``BLOCK`` keys at a
time with an online softmax (running max, rescaled sum and output) and yields (max, sum,
unnormalised output); the chunks are then merged in chunk order.  The batch and the thread count
only decide which thread computes which (row, kv head, chunk) item, never how an item is computed.
Nothing carries fast-math flags; sums vectorize through fixed lanes or register tiles
(``_attention_ir``), not by reassociation.

The GQA query heads sharing a kv head are processed together, so each K/V row is read once per kv
head.  K/V are addressed by the address of a kv head's position 0 (rows of head_dim float16);
head_dim % 16 == 0 takes the register-tiled path, other sizes a plain-loop path.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from weaved.kernels._attention_ir import (
    MAX_TILE_CHUNKS,
    MAX_TILE_HEADS,
    acc_v,
    cvt_rows,
    h2f_at,
    scores8,
    scores8_heads,
)
from weaved.kernels._exp_ir import exp_shift16
from weaved.kernels._rowwise import exp_f32

from . import _steal

CHUNK = 512  # keys per work item: longer runs stream better from memory, shorter ones split finer
BLOCK = 64  # keys scored together inside a chunk (multiple of 16)
ITEM_OVERHEAD = 32  # fixed cost of a work item, in keys, when balancing threads
SERIAL_COST = 1024  # groups cheaper than this (in keys) run on one thread
OWN_ITEMS = 4  # work items a thread takes at a time from its own range (one at a time from the others')

# error_model "numpy": x / 0 gives inf; the "python" model checks every division, which blocks vectorizing
_OPTS = dict(cache=True, nogil=True, error_model="numpy")
_NEG_INF = np.float32(-np.inf)


@njit(**_OPTS)
def _init(acc, ml):
    for g in range(acc.shape[0]):
        ml[g, 0] = _NEG_INF
        ml[g, 1] = 0.0
        for d in range(acc.shape[1]):
            acc[g, d] = 0.0


@njit(**_OPTS)
def _chunk(q, t, h0, kaddr, vaddr, j0, j1, scale, acc, ml, kf, s, lanes):
    """Online-softmax attention of query heads h0..h0+G-1 of row t over keys j0..j1-1 of one kv head
    (float16 [positions, D] rows at kaddr, vaddr).  q float32 [T, H, D].  Out: acc float32 [G, D]
    (unnormalised output), ml float32 [G, 2] (running max, sum of exp(score - max)).  Scratch: kf
    float32 [BLOCK, D] (the block's keys), s float32 [G, BLOCK] (scores, then probabilities),
    lanes float32 [16]."""
    G, D = acc.shape
    H = q.shape[1]
    _init(acc, ml)
    for b0 in range(j0, j1, BLOCK):
        nb = min(BLOCK, j1 - b0)
        n8 = nb - nb % 8
        for r0 in range(0, n8, 8):  # scores of whole groups of 8 keys, read from the kv array
            for g0 in range(0, G, MAX_TILE_HEADS):
                scores8_heads(q, (t * H + h0 + g0) * D, min(MAX_TILE_HEADS, G - g0), kaddr, (b0 + r0) * D, D,
                              scale, s, g0 * BLOCK + r0)
        if n8 < nb:  # the last keys, converted and padded with zero rows (their scores are unused)
            cvt_rows(kaddr, (b0 + n8) * D, (nb - n8) * D, kf)
            for r in range(nb - n8, 8):
                for d in range(D):
                    kf[r, d] = 0.0
            for g in range(G):
                scores8(q, (t * H + h0 + g) * D, kf, 0, D, scale, s, g * BLOCK + n8)
        for g in range(G):  # probabilities
            _softmax_block(s[g], nb, g, ml, acc, lanes)
        n_c = D // 16
        for g0 in range(0, G, MAX_TILE_HEADS):  # acc += p @ V, a register tile at a time
            for c0 in range(0, n_c, MAX_TILE_CHUNKS):
                hn, cn = min(MAX_TILE_HEADS, G - g0), min(MAX_TILE_CHUNKS, n_c - c0)
                acc_v(s, g0, hn, nb, vaddr, b0, c0, cn, acc)


@njit(**_OPTS)
def _chunk_plain(q, t, h0, kaddr, vaddr, j0, j1, scale, acc, ml, kf, s, lanes):
    """``_chunk`` for a head_dim that is not a multiple of 16 (plain loops, same online softmax)."""
    G, D = acc.shape
    _init(acc, ml)
    for b0 in range(j0, j1, BLOCK):
        nb = min(BLOCK, j1 - b0)
        for r in range(nb):
            for d in range(D):
                kf[r, d] = h2f_at(kaddr, (b0 + r) * D + d)
        for g in range(G):
            for r in range(nb):
                dot = np.float32(0.0)
                for d in range(D):
                    dot += q[t, h0 + g, d] * kf[r, d]
                s[g, r] = dot * scale
            _softmax_block(s[g], nb, g, ml, acc, lanes)
        for r in range(nb):
            for d in range(D):
                kf[r, d] = h2f_at(vaddr, (b0 + r) * D + d)
            for g in range(G):
                p = s[g, r]
                for d in range(D):
                    acc[g, d] += p * kf[r, d]


@njit(**_OPTS)
def _softmax_block(x, nb, g, ml, acc, lanes):
    """Online-softmax step of head g over one block: x[:nb] scores -> probabilities exp(x - m) with
    the new running max m; the running sum ml[g, 1] and output acc[g] are rescaled to m.  Max and
    sum go through 16 interleaved lanes, then the lanes in order: this vectorizes without
    reassociation, so the bits depend on the row alone.  (x is a 1-D view: LLVM vectorizes it.)"""
    n16 = nb - nb % 16
    m_old = ml[g, 0]
    for i in range(16):
        lanes[i] = m_old
    for b in range(0, n16, 16):
        for i in range(16):
            lanes[i] = max(lanes[i], x[b + i])
    for i in range(nb - n16):
        lanes[i] = max(lanes[i], x[n16 + i])
    m_new = lanes[0]
    for i in range(1, 16):
        m_new = max(m_new, lanes[i])
    alpha = exp_f32(m_old - m_new)  # 0 on the first block (m_old = -inf)
    exp_shift16(x, n16, m_new)  # x[r] = exp_f32(x[r] - m_new), 16 lanes at a time
    for r in range(n16, nb):
        x[r] = exp_f32(x[r] - m_new)
    for i in range(16):
        lanes[i] = 0.0
    for b in range(0, n16, 16):
        for i in range(16):
            lanes[i] += x[b + i]
    for i in range(nb - n16):
        lanes[i] += x[n16 + i]
    total = lanes[0]
    for i in range(1, 16):
        total += lanes[i]
    ml[g, 0] = m_new
    ml[g, 1] = ml[g, 1] * alpha + total
    if alpha != 1.0:
        for d in range(acc.shape[1]):
            acc[g, d] *= alpha


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
def _works(q, kaddr, vaddr, row_nkeys, scale, item_row, item_c, part_acc, part_ml, w0, w1):
    """Chunk partials of works w0 .. w1-1 (work w: item w // n_kv, kv head w % n_kv) on one thread."""
    kf, s, lanes = _scratch(part_acc)
    _works_in(q, kaddr, vaddr, row_nkeys, scale, item_row, item_c, part_acc, part_ml, w0, w1, kf, s, lanes)


@njit(**_OPTS)
def _scratch(part_acc):
    """A thread's scratch for ``_works_in``."""
    n_items, n_kv, G, D = part_acc.shape
    # np.zeros here was a 16 KiB memset per call
    return np.empty((BLOCK, D), np.float32), np.empty((G, BLOCK), np.float32), np.empty(16, np.float32)


@njit(**_OPTS)
def _works_in(q, kaddr, vaddr, row_nkeys, scale, item_row, item_c, part_acc, part_ml, w0, w1, kf, s, lanes):
    """``_works`` with the scratch (``_scratch``) given."""
    n_items, n_kv, G, D = part_acc.shape
    for w in range(w0, w1):
        it = w // n_kv
        g = w % n_kv
        r = item_row[it]
        j0 = item_c[it] * CHUNK
        j1 = min(j0 + CHUNK, row_nkeys[r])
        acc, ml = part_acc[it, g], part_ml[it, g]
        if D % 16 == 0:
            _chunk(q, r, g * G, kaddr[r, g], vaddr[r, g], j0, j1, scale, acc, ml, kf, s, lanes)
        else:
            _chunk_plain(q, r, g * G, kaddr[r, g], vaddr[r, g], j0, j1, scale, acc, ml, kf, s, lanes)


@njit(**_OPTS)
def _group(row_nkeys, n_ch, r0, max_items, n_kv, n_slices):
    """The group of rows from r0 on whose chunks fit max_items (at least one row): (r1, first item of
    each row, each item's row and chunk, n_work, cost, thread cuts).  Work w is item w // n_kv (a
    chunk of a row), kv head w % n_kv; cost: cumulative key counts (+ overhead); thread i takes work
    cuts[i] .. cuts[i + 1] - 1."""
    T = row_nkeys.shape[0]
    r1 = r0 + 1
    tot = n_ch[r0]
    while r1 < T and tot + n_ch[r1] <= max_items:
        tot += n_ch[r1]
        r1 += 1
    n_work = tot * n_kv
    first = np.empty(r1 - r0 + 1, np.int64)
    item_row = np.empty(tot, np.int64)
    item_c = np.empty(tot, np.int64)
    cost = np.empty(n_work + 1, np.int64)
    cost[0] = 0
    k = 0
    for r in range(r0, r1):
        first[r - r0] = k
        for c in range(n_ch[r]):
            item_row[k] = r
            item_c[k] = c
            for g in range(n_kv):
                w = k * n_kv + g
                cost[w + 1] = cost[w] + min(CHUNK, row_nkeys[r] - c * CHUNK) + ITEM_OVERHEAD
            k += 1
    first[r1 - r0] = k
    n_thr = max(1, min(n_slices, n_work))
    cuts = np.empty(n_thr + 1, np.int64)
    w = 0
    for i in range(n_thr):
        while w < n_work and cost[w] * n_thr < cost[n_work] * i:
            w += 1
        cuts[i] = w
    cuts[n_thr] = n_work
    return r1, first, item_row, item_c, n_work, cost, cuts


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
    r0 = 0
    while r0 < row_nkeys.shape[0]:
        r1, first, item_row, item_c, n_work, _cost, _cuts = _group(row_nkeys, n_ch, r0, max_items, n_kv, 1)
        part_acc = np.empty((item_row.shape[0], n_kv, G, D), np.float32)
        part_ml = np.empty((item_row.shape[0], n_kv, G, 2), np.float32)
        _works(q, kaddr, vaddr, row_nkeys, scale, item_row, item_c, part_acc, part_ml, 0, n_work)
        _merge_rows(part_acc, part_ml, first, n_ch, r0, r1, out, lse)
        r0 = r1


@njit(parallel=True, **_OPTS)
def _attend_rows_par(q, kaddr, vaddr, row_nkeys, scale, out, lse, n_slices, max_items, n_ch):
    """``attend_rows`` with its groups' work split over the threads (a group too small for that runs
    serially, with the same arithmetic)."""
    T, H, D = q.shape
    n_kv = kaddr.shape[1]
    G = H // n_kv
    r0 = 0
    while r0 < T:
        r1, first, item_row, item_c, n_work, cost, cuts = _group(row_nkeys, n_ch, r0, max_items, n_kv, n_slices)
        tot = item_row.shape[0]
        part_acc = np.empty((tot, n_kv, G, D), np.float32)
        part_ml = np.empty((tot, n_kv, G, 2), np.float32)
        n_thr = cuts.shape[0] - 1
        # a parallel launch costs microseconds: small groups run on the calling thread (same arithmetic)
        if n_thr == 1 or cost[n_work] < SERIAL_COST:
            _works(q, kaddr, vaddr, row_nkeys, scale, item_row, item_c, part_acc, part_ml, 0, n_work)
        else:
            # each thread owns its cut and takes what is left of the others' once done (``_steal``)
            st = _steal.ranges_at(cuts)
            for i in prange(n_thr):
                kf, s, lanes = _scratch(part_acc)
                j = 0
                while True:
                    w0, w1, j = _steal.take(st, i, OWN_ITEMS, j)
                    if w1 == 0:
                        break
                    _works_in(q, kaddr, vaddr, row_nkeys, scale, item_row, item_c, part_acc, part_ml, w0, w1,
                              kf, s, lanes)
        if r1 - r0 < 16:
            _merge_rows(part_acc, part_ml, first, n_ch, r0, r1, out, lse)
        else:
            for w in prange((r1 - r0) * n_kv):
                r = r0 + w // n_kv
                g = w % n_kv
                _merge_chunks(part_acc, part_ml, first[r - r0], n_ch[r], g, out, lse, r, g * G)
        r0 = r1
