"""The Q4_0 / Q8_0 x Q8_0 gemm's driver, one for both tile kernels.

A product walks the packed matrix tile by tile (32 rows), ``CB`` activation columns per pass, and
calls a tile kernel for each (tile, pass): ``_gemm_vnni``'s AVX-512 VNNI intrinsics where the CPU has
them, ``_gemm_portable``'s target-independent ones elsewhere - the same bits either way.  The tile
kernel is chosen by the dtype of a zero-size marker array (``VNNI_MARKER``, ``PORTABLE_MARKER``)
through an ``@overload``, so each path compiles, and is cached, as its own specialization of the one
driver (numba does not cache closures), and the VNNI one is typed - and its module imported - only
when a caller passes the VNNI marker.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from . import _gemm_portable, _steal
from ._llvm import store_tile_cols
from ._pack import RT, TB_Q4, TB_Q8
from .quants import PAR_QUANT_MIN_ROWS, quantize_act_cols

_OPTS = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False)
CB = 64  # columns per pass over a tile: accumulators CB * RT * 4 = 8 KiB stay in L1
VNNI_MARKER = np.empty(0, np.int8)  # selects _gemm_vnni's tile kernel
PORTABLE_MARKER = np.empty(0, np.uint8)  # selects _gemm_portable's
FEW_COLS = 4  # run_par: at up to this many columns an owner takes OWN_TILES_FEW_COLS tiles at a time
OWN_TILES_FEW_COLS = 4


def tile(marker, qk, P, off0, nb, xq, xd, xs, A, c0, c1):
    """One (tile, pass): A (float32, >= (c1-c0)*RT + 16, aligned to 64 inside) receives rows
    0..RT-1 of the packed tile at byte offset off0 for columns c0..c1 of the activations xq int8
    [nb, T, 32], xd float32 [nb, T], xs int32 [nb, T]; qk 4: Q4_0, 8: Q8_0."""
    raise NotImplementedError  # compiled code only (the overload below)


# inlined at numba IR level: as a separate function the tile call made a 16/64-column product 2-3 %
# slower (measured A/B in one process against the tile called directly)
@overload(tile, inline="always")
def _tile_impl(marker, qk, P, off0, nb, xq, xd, xs, A, c0, c1):
    if marker.dtype == types.int8:
        from . import _gemm_vnni as mod  # typed only when a caller passes the VNNI marker
    else:
        mod = _gemm_portable
    tile_q4, tile_q8 = mod.tile_q4, mod.tile_q8

    def impl(marker, qk, P, off0, nb, xq, xd, xs, A, c0, c1):
        if qk == 4:
            tile_q4(P, off0, nb, xq, xd, xs, A, c0, c1)
        else:
            tile_q8(P, off0, nb, xq, xd, xs, A, c0, c1)

    return impl


@njit(**_OPTS)
def _chunk(n, nch, k):
    return n * k // nch, n * (k + 1) // nch


@njit(**_OPTS)
def _acc(T):
    """A tile kernel's accumulators for up to CB of T columns."""
    return np.empty(min(T, CB) * RT + 16, np.float32)


@njit(**_OPTS)
def _rows(marker, P, qk, t0, t1, nb, n_out, xq, xd, xs, Y):
    """Row tiles t0..t1 of the packed matrix, every column of Y (float32 [T, n_out])."""
    _rows_in(marker, P, qk, t0, t1, nb, n_out, xq, xd, xs, Y, _acc(Y.shape[0]))


@njit(**_OPTS)
def _rows_in(marker, P, qk, t0, t1, nb, n_out, xq, xd, xs, Y, A):
    """``_rows`` with the accumulators A (``_acc``) given."""
    T = Y.shape[0]
    tb = TB_Q4 if qk == 4 else TB_Q8
    for t in range(t0, t1):
        nr = min(RT, n_out - t * RT)
        for c0 in range(0, T, CB):
            c1 = min(T, c0 + CB)
            tile(marker, qk, P, t * nb * tb, nb, xq, xd, xs, A, c0, c1)
            store_tile_cols(A, Y, c0, c1, t * RT, nr)


@njit(**_OPTS)
def _quantized(X, xq, xd, xs):
    """(xq, xd, xs) as given when X has no rows, else fresh arrays holding X quantized (serially)."""
    T = X.shape[0]
    if T == 0:
        return xq, xd, xs
    nb = X.shape[1] // 32
    return np.empty((nb, T, 32), np.int8), np.empty((nb, T), np.float32), np.empty((nb, T), np.int32)


@njit(**_OPTS)
def run_serial(marker, P, qk, n_out, X, xq, xd, xs, Y):
    """Y [T, n_out] = X @ W.T on one thread, W packed in P.  X float32 [T, n_in] is quantized to Q8_0
    first; with no rows in X, xq [nb, T, 32], xd [nb, T], xs [nb, T] hold the activations."""
    nt = (n_out + RT - 1) // RT
    nb = X.shape[1] // 32
    xq, xd, xs = _quantized(X, xq, xd, xs)
    if X.shape[0] > 0:
        quantize_act_cols(X, xq, xd, xs, 0, X.shape[0])
    _rows(marker, P, qk, 0, nt, nb, n_out, xq, xd, xs, Y)


@njit(parallel=True, **_OPTS)
def run_par(marker, P, qk, n_out, X, xq, xd, xs, Y, nch):
    """run_serial on nch threads: each owns a contiguous range of the row tiles and takes the tiles
    left in the others' from the back once done with its own (``_steal``); the quantization is split
    into nch row chunks when X has enough rows."""
    nt = (n_out + RT - 1) // RT
    nb = X.shape[1] // 32
    T = X.shape[0]
    xq, xd, xs = _quantized(X, xq, xd, xs)
    if T >= PAR_QUANT_MIN_ROWS:
        for k in prange(nch):
            c0, c1 = _chunk(T, nch, k)
            quantize_act_cols(X, xq, xd, xs, c0, c1)
    elif T > 0:
        quantize_act_cols(X, xq, xd, xs, 0, T)
    # an owner takes a few tiles at a time at few columns (a tile is then ~1 us of streaming), one at many
    own = OWN_TILES_FEW_COLS if Y.shape[0] <= FEW_COLS else 1
    st = _steal.ranges(nt, nch)
    for k in prange(nch):
        A = _acc(Y.shape[0])
        j = 0
        while True:
            t0, t1, j = _steal.take(st, k, own, j)
            if t1 == 0:
                break
            _rows_in(marker, P, qk, t0, t1, nb, n_out, xq, xd, xs, Y, A)
