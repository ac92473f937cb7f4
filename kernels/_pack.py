"""The packed weight layout the gemm kernels read, and the numba code that builds it.

Rows are grouped in tiles of RT = 32 (two groups of 16, one row per int32 lane of a 512-bit
register).  For each tile t and block b (32 weights) the bytes at ``(t * nb + b) * TB`` are:

  [0, 64)                 32 fp16 scales, rows 0..31 of the tile
  Q4_0: [64 + 256 g + 64 d + 4 i + k]  byte 4 d + k (d < 4, k < 4) of the block's 16 nibble bytes
                                       of row 16 g + i   (TB = 576)
  Q8_0: [64 + 512 g + 64 d + 4 i + k]  int8 weight 4 d + k (d < 8) of row 16 g + i, XOR 0x80, i.e.
                                       stored as unsigned w + 128            (TB = 1088)

so the 16 lanes of one 64-byte load hold 4 consecutive weights (Q4_0: nibble pairs) of 16 rows:
the operand layout of vpdpbusd, with no transposition at run time.  A tile's blocks are
contiguous, so a tile streams sequentially from memory.  Rows past n_out (the last tile's padding)
have scale 0 and zero bytes.

F16 / F32 weights become float32 [nt, n_in, RT] (row r of tile t in lane r), zero-padded.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np
from numba import njit, prange

RT = 32  # rows per tile
TB_Q4 = 64 + 2 * 256
TB_Q8 = 64 + 2 * 512
ALIGN = 64

_OPTS = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False)


class _Arena:
    """Bump allocator over large anonymous mappings advised for transparent huge pages.

    A decode step streams every weight once; with 4 KiB pages that is a TLB miss every 7 blocks
    of a tile, and backing the packed weights by 2 MiB pages made the matrix products of a whole
    SmolLM2-135M decode step 15-20 % faster (measured, 1 and 2 threads).  Small matrices share
    chunks, so they get huge pages too.  A chunk is unmapped when no array from it is alive any
    more (each array keeps its mmap alive)."""

    CHUNK = 64 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf: np.ndarray | None = None
        self._off = 0

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            if self._buf is None or self._off + nbytes > self._buf.size:
                size = max(self.CHUNK, -(-nbytes // HUGE) * HUGE)
                m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                m.madvise(mmap.MADV_HUGEPAGE)
                self._buf, self._off = np.frombuffer(m, dtype=np.uint8), 0
            out = self._buf[self._off:self._off + nbytes]
            self._off += -(-nbytes // ALIGN) * ALIGN
            return out


HUGE = 2 << 20
_HAVE_THP = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")
_arena = _Arena()


def aligned_empty(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] whose first byte is 64-byte aligned (one cache line, one zmm load), from the
    huge-page arena where the OS offers one."""
    if _HAVE_THP and nbytes > 0:
        try:
            return _arena.take(nbytes)
        except (OSError, ValueError):
            pass
    buf = np.empty(nbytes + ALIGN, np.uint8)
    off = (-buf.ctypes.data) % ALIGN
    return buf[off:off + nbytes]


@njit(**_OPTS)
def _chunk(n, nch, k):
    return n * k // nch, n * (k + 1) // nch


@njit(**_OPTS)
def _pack_tiles(raw, qk, n_out, P, t0, t1):
    bsz = 18 if qk == 4 else 34
    tb = TB_Q4 if qk == 4 else TB_Q8
    ndw = 4 if qk == 4 else 8
    gstride = 64 * ndw
    flip = 0 if qk == 4 else 0x80
    nb = raw.shape[1] // bsz
    for t in range(t0, t1):
        for b in range(nb):
            off = (t * nb + b) * tb
            for r in range(RT):
                row = t * RT + r
                g, i = r // 16, r % 16
                if row < n_out:
                    src = b * bsz
                    P[off + 2 * r] = raw[row, src]
                    P[off + 2 * r + 1] = raw[row, src + 1]
                    for d in range(ndw):
                        for k in range(4):
                            v = raw[row, src + 2 + 4 * d + k]
                            P[off + 64 + gstride * g + 64 * d + 4 * i + k] = v ^ flip
                else:
                    P[off + 2 * r] = 0
                    P[off + 2 * r + 1] = 0
                    for d in range(ndw):
                        for k in range(4):
                            P[off + 64 + gstride * g + 64 * d + 4 * i + k] = 0


@njit(parallel=True, **_OPTS)
def pack_quant(raw, qk, n_out, P, nch):
    """raw uint8 [n_out, nb*bsz] GGUF rows (qk = 4: Q4_0, 8: Q8_0) -> P (module docstring layout)."""
    nt = (n_out + RT - 1) // RT
    for k in prange(nch):
        t0, t1 = _chunk(nt, nch, k)
        _pack_tiles(raw, qk, n_out, P, t0, t1)


@njit(**_OPTS)
def unpack_row(P, qk, nb, row, out):
    """out uint8 [nb * block bytes] <- the GGUF bytes of weight row ``row`` of packed Q4_0 / Q8_0
    data P (``_pack_tiles`` undone for one row: its fp16 scales and quants, read from the tiles)."""
    bsz = 18 if qk == 4 else 34
    tb = TB_Q4 if qk == 4 else TB_Q8
    ndw = 4 if qk == 4 else 8
    gstride = 64 * ndw
    flip = 0 if qk == 4 else 0x80
    t, r = row // RT, row % RT
    g, i = r // 16, r % 16
    for b in range(nb):
        off = (t * nb + b) * tb
        dst = b * bsz
        out[dst] = P[off + 2 * r]
        out[dst + 1] = P[off + 2 * r + 1]
        for d in range(ndw):
            for k in range(4):
                out[dst + 2 + 4 * d + k] = P[off + 64 + gstride * g + 64 * d + 4 * i + k] ^ flip


@njit(**_OPTS)
def unpack_rows(P, qk, nb, rows, out):
    """out uint8 [len(rows), nb * block bytes] <- the GGUF bytes of those rows of packed data P."""
    for j in range(rows.shape[0]):
        unpack_row(P, qk, nb, rows[j], out[j])


@njit(parallel=True, **_OPTS)
def pack_float(w, out, nch):
    """w float32 [n_out, n_in] -> out float32 [nt, n_in, RT] (rows in lanes; out pre-zeroed)."""
    n_out, n_in = w.shape
    nt = out.shape[0]
    for k in prange(nch):
        t0, t1 = _chunk(nt, nch, k)
        for t in range(t0, t1):
            for r in range(min(RT, n_out - t * RT)):
                for j in range(n_in):
                    out[t, j, r] = w[t * RT + r, j]
