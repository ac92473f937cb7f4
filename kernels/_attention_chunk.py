"""The arithmetic of attention over one chunk of keys, for one kv head and a tile of query rows (the
driver that cuts the work and merges the chunks is ``_attention_rows``).

One (row, query head) over a chunk: its keys j0..j1-1 are taken ``BLOCK`` at a time from j0, each
block scored, turned into probabilities by an online softmax (running max, rescaled sum and output)
and accumulated into the unnormalised output.  Nothing here depends on which other rows or heads
share the tile: every (head, key) score is the same chain of operations whatever the tile
(``scores8_heads``), every output value's chain over the keys too (``acc_v``), and the softmax is per
head.  A tile of rows only shares the loading and converting of each K/V block: consecutive query
rows of one sequence read the same keys, so a block read from memory once serves them all (prefill
over a long context was memory bound before: each row streamed all its keys alone).

Rows of a tile must address the same K/V rows (same sequence, same first key) with non-decreasing
key counts, so that at each block the rows still short of the block's end are a suffix.
"""

from __future__ import annotations

import numpy as np
from numba import njit
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

CHUNK = 512  # keys per work item: longer runs stream better from memory, shorter ones split finer
BLOCK = 64  # keys scored together inside a chunk (multiple of 16)
SCORE_HEADS = 2  # heads scored per pass over 8 keys: 16 accumulators + 8 keys stay in registers (4 spilled)
TILE_PAIRS = 16  # (row, head) pairs of a tile: a block's K/V (16 KiB each at head_dim 128) stays in L1

# error_model "numpy": x / 0 gives inf; the "python" model checks every division, which blocks vectorizing
_OPTS = dict(cache=True, nogil=True, error_model="numpy")
_NEG_INF = np.float32(-np.inf)


@njit(**_OPTS)
def tile_rows(G, D):
    """Query rows per tile for G query heads per kv head (1 where head_dim takes the plain path)."""
    if D % 16:
        return 1
    return max(1, TILE_PAIRS // G)


@njit(**_OPTS)
def scratch(G, D, R):
    """A thread's scratch for tiles of up to R rows: (qt, acc, ml, kf, s, lanes, j1s)."""
    # np.zeros here was a 16 KiB memset per call
    return (np.empty((R * G, D), np.float32), np.empty((R * G, D), np.float32), np.empty((R * G, 2), np.float32),
            np.empty((BLOCK, D), np.float32), np.empty((R * G, BLOCK), np.float32), np.empty(16, np.float32),
            np.empty(R, np.int64))


@njit(**_OPTS)
def init(acc, ml, n):
    for g in range(n):
        ml[g, 0] = _NEG_INF
        ml[g, 1] = 0.0
        for d in range(acc.shape[1]):
            acc[g, d] = 0.0


@njit(**_OPTS)
def chunk_tile(q, t0, R, h0, G, kaddr, vaddr, j0, j1s, scale, qt, acc, ml, kf, s, lanes):
    """Online-softmax attention of query heads h0..h0+G-1 of rows t0..t0+R-1 (q float32 [T, H, D])
    over keys j0..j1s[r]-1 of one kv head (float16 [positions, D] rows at kaddr, vaddr); j1s
    non-decreasing.  Out: acc[r*G + g] float32 [D] (unnormalised output), ml[r*G + g] (running max,
    sum of exp(score - max)).  Scratch: qt [>= R*G, D] (the tile's queries), kf [BLOCK, D], s
    [>= R*G, BLOCK], lanes [16].  head_dim a multiple of 16."""
    D = q.shape[2]
    for r in range(R):
        for g in range(G):
            for d in range(D):
                qt[r * G + g, d] = q[t0 + r, h0 + g, d]
    init(acc, ml, R * G)
    for b0 in range(j0, j1s[R - 1], BLOCK):
        # rows ending inside or past this block, as runs of equal block length (a suffix of the tile)
        rb = R
        while rb > 0 and j1s[rb - 1] > b0:
            nb = min(BLOCK, j1s[rb - 1] - b0)
            ra = rb - 1
            while ra > 0 and j1s[ra - 1] > b0 and min(BLOCK, j1s[ra - 1] - b0) == nb:
                ra -= 1
            _block(qt, ra * G, rb * G, kaddr, vaddr, b0, nb, scale, acc, ml, kf, s, lanes)
            rb = ra


@njit(**_OPTS)
def _block(qt, ga, gb, kaddr, vaddr, b0, nb, scale, acc, ml, kf, s, lanes):
    """One block of nb keys from b0 for the tile's (row, head) pairs ga..gb-1."""
    D = qt.shape[1]
    n8 = nb - nb % 8
    for r0 in range(0, n8, 8):  # scores of whole groups of 8 keys, read from the kv array
        for g0 in range(ga, gb, SCORE_HEADS):
            scores8_heads(qt, g0 * D, min(SCORE_HEADS, gb - g0), kaddr, (b0 + r0) * D, D, scale, s,
                          g0 * BLOCK + r0)
    if n8 < nb:  # the last keys, converted and padded with zero rows (their scores are unused)
        cvt_rows(kaddr, (b0 + n8) * D, (nb - n8) * D, kf)
        for r in range(nb - n8, 8):
            for d in range(D):
                kf[r, d] = 0.0
        for g in range(ga, gb):
            scores8(qt, g * D, kf, 0, D, scale, s, g * BLOCK + n8)
    for g in range(ga, gb):  # probabilities
        _softmax_block(s[g], nb, g, ml, acc, lanes)
    n_c = D // 16
    for g0 in range(ga, gb, MAX_TILE_HEADS):  # acc += p @ V, a register tile at a time
        for c0 in range(0, n_c, MAX_TILE_CHUNKS):
            hn, cn = min(MAX_TILE_HEADS, gb - g0), min(MAX_TILE_CHUNKS, n_c - c0)
            acc_v(s, g0, hn, nb, vaddr, b0, c0, cn, acc)


@njit(**_OPTS)
def chunk_plain(q, t, h0, kaddr, vaddr, j0, j1, scale, acc, ml, kf, s, lanes):
    """One row's chunk (``chunk_tile`` with R = 1) for a head_dim that is not a multiple of 16: plain
    loops, the same online softmax.  acc [G, D], ml [G, 2]."""
    G, D = acc.shape
    init(acc, ml, G)
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
