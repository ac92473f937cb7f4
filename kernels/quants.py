"""Q4_0 / Q8_0 quantization of weights (bit-exact with gguf.quants) and of activations.

Weights (GGUF blocks of 32): Q4_0 = fp16 scale d + 16 bytes, low nibbles = elements 0..15, high
nibbles = 16..31, value (q - 8) * d; Q8_0 = fp16 d + 32 int8, value q * d.

Activations are quantized per row to Q8_0 like llama.cpp's ``quantize_row_q8_0`` (its SIMD
versions): per block ``q = rint(x * (127 / amax))`` (round half to even; q = 0 where amax == 0) and
the scale ``d = amax / 127`` rounded to fp16, as a Q8_0 block stores it - so that our products
track llama.cpp's to the last bit of the activation scale.
Q8_0 *weights* follow gguf instead: halves round away from zero and d is stored as fp16.
Inputs must be finite.

Each numba kernel has a numpy reference (``*_ref``) the tests hold it to.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ._f16 import f16_to_f32, f32_to_f16_array
from ._llvm import quant_block_q8
from .threads import get_threads, on_kernel_thread

_OPTS = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False)
QK = 32


# ---------------------------------------------------------------------------------------------
# numba kernels (rows r0..r1 of a [N, K] matrix; the public wrappers split rows between threads)
# ---------------------------------------------------------------------------------------------
@njit(**_OPTS)
def _quantize_q4_0_rows(x, out, d32, r0, r1):
    """x float32 [N, K] -> out uint8 [N, K//32*18] (rows r0..r1); d32 float32 [K//32] scratch."""
    nb = x.shape[1] // QK
    d16 = np.empty(nb, np.uint16)
    for r in range(r0, r1):
        for b in range(nb):
            xb = x[r, b * QK:(b + 1) * QK]
            # signed value of largest magnitude; the first one on ties (numpy's argmax)
            mx = xb[0]
            amax = abs(mx)
            for j in range(1, QK):
                if abs(xb[j]) > amax:
                    amax = abs(xb[j])
                    mx = xb[j]
            d = mx / np.float32(-8.0)
            idd = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            d32[b] = d
            o = b * 18 + 2
            for j in range(16):
                lo = min(np.int32(xb[j] * idd + np.float32(8.5)), 15)
                hi = min(np.int32(xb[j + 16] * idd + np.float32(8.5)), 15)
                out[r, o + j] = np.uint8(lo | (hi << 4))
        f32_to_f16_array(d32, d16)
        for b in range(nb):
            out[r, b * 18] = np.uint8(d16[b] & 0xFF)
            out[r, b * 18 + 1] = np.uint8(d16[b] >> 8)


@njit(**_OPTS)
def _quantize_q8_0_rows(x, out, d32, r0, r1):
    """x float32 [N, K] -> out uint8 [N, K//32*34] (rows r0..r1).  Like gguf (and ggml's reference
    quantize_row_q8_0_ref): q = roundf(x * (1 / d)), halves rounded away from zero."""
    nb = x.shape[1] // QK
    d16 = np.empty(nb, np.uint16)
    for r in range(r0, r1):
        for b in range(nb):
            xb = x[r, b * QK:(b + 1) * QK]
            amax = np.float32(0.0)
            for j in range(QK):
                amax = max(amax, abs(xb[j]))
            d = amax / np.float32(127.0)
            idd = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            d32[b] = d
            for j in range(QK):
                v = xb[j] * idd
                a = abs(v)
                q = np.floor(a)
                if a - q >= np.float32(0.5):
                    q += np.float32(1.0)
                qi = np.int32(q)
                out[r, b * 34 + 2 + j] = np.uint8((-qi if v < 0 else qi) & 0xFF)
        f32_to_f16_array(d32, d16)
        for b in range(nb):
            out[r, b * 34] = np.uint8(d16[b] & 0xFF)
            out[r, b * 34 + 1] = np.uint8(d16[b] >> 8)


@njit(**_OPTS)
def dequantize_rows(raw, qk, out, r0, r1):
    """raw uint8 [N, nb*(2+QK*qk/8)] (qk = 4: Q4_0, 8: Q8_0) -> out float32 [N, nb*32], rows r0..r1."""
    bsz = 18 if qk == 4 else 34
    nb = raw.shape[1] // bsz
    for r in range(r0, r1):
        for b in range(nb):
            o = b * bsz
            d = f16_to_f32(np.int64(raw[r, o]) | (np.int64(raw[r, o + 1]) << 8))
            if qk == 4:
                for j in range(16):
                    v = np.int32(raw[r, o + 2 + j])
                    out[r, b * QK + j] = d * np.float32((v & 15) - 8)
                    out[r, b * QK + 16 + j] = d * np.float32((v >> 4) - 8)
            else:
                for j in range(QK):
                    out[r, b * QK + j] = d * np.float32(np.int8(raw[r, o + 2 + j]))


@njit(**_OPTS)
def _chunk(n, nch, k):
    return n * k // nch, n * (k + 1) // nch


@njit(parallel=True, **_OPTS)
def _quantize_par(x, out, qk, nch):
    for k in prange(nch):
        r0, r1 = _chunk(x.shape[0], nch, k)
        d32 = np.empty(x.shape[1] // QK, np.float32)
        if qk == 4:
            _quantize_q4_0_rows(x, out, d32, r0, r1)
        else:
            _quantize_q8_0_rows(x, out, d32, r0, r1)


@njit(parallel=True, **_OPTS)
def _dequantize_par(raw, qk, out, nch):
    for k in prange(nch):
        r0, r1 = _chunk(raw.shape[0], nch, k)
        dequantize_rows(raw, qk, out, r0, r1)


@njit(**_OPTS)
def quantize_act_cols(x, xq, xd, xs, c0, c1):
    """Rows c0..c1 of x (float32 [T, K]) to Q8_0: xq int8 [nb, T, 32], xd float32 [nb, T],
    xs int32 [nb, T] (sum of the block's q: the gemm folds weight offsets in with it)."""
    nb = x.shape[1] // QK
    xf = x.reshape(x.shape[0] * x.shape[1])
    xqf = xq.reshape(xq.size)
    T = x.shape[0]
    for c in range(c0, c1):
        for b in range(nb):
            d, s = quant_block_q8(xf, c * x.shape[1] + b * QK, xqf, (b * T + c) * QK)
            xd[b, c] = d
            xs[b, c] = s


@njit(parallel=True, **_OPTS)
def _quantize_act_par(x, xq, xd, xs, nch):
    for k in prange(nch):
        c0, c1 = _chunk(x.shape[0], nch, k)
        quantize_act_cols(x, xq, xd, xs, c0, c1)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------
def _as_rows(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"{name}: expected a 2-D float array [N, K], got {x.dtype} {x.shape}")
    if x.shape[1] % QK:
        raise ValueError(f"{name}: row length must be a multiple of {QK}, got {x.shape[1]}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _nch(n_rows: int) -> int:
    return max(1, min(get_threads(), n_rows))


@on_kernel_thread
def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """float [N, K] (K % 32 == 0; converted to float32) -> uint8 [N, K//32*18] GGUF Q4_0 rows,
    bit-exact with ``gguf.quants.quantize(x, Q4_0)``."""
    x = _as_rows(x, "quantize_q4_0")
    out = np.empty((x.shape[0], x.shape[1] // QK * 18), np.uint8)
    if x.size:
        _quantize_par(x, out, 4, _nch(x.shape[0]))
    return out


@on_kernel_thread
def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float [N, K] (K % 32 == 0) -> uint8 [N, K//32*34] GGUF Q8_0 rows, bit-exact with gguf.quants."""
    x = _as_rows(x, "quantize_q8_0")
    out = np.empty((x.shape[0], x.shape[1] // QK * 34), np.uint8)
    if x.size:
        _quantize_par(x, out, 8, _nch(x.shape[0]))
    return out


def _dequantize(raw: np.ndarray, bsz: int, qk: int, name: str) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] % bsz:
        raise ValueError(f"{name}: expected uint8 [N, nb*{bsz}], got {raw.dtype} {raw.shape}")
    raw = np.ascontiguousarray(raw)
    out = np.empty((raw.shape[0], raw.shape[1] // bsz * QK), np.float32)
    if raw.size:
        _dequantize_par(raw, qk, out, _nch(raw.shape[0]))
    return out


@on_kernel_thread
def dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    """uint8 [N, nb*18] Q4_0 rows -> float32 [N, nb*32], bit-exact with gguf.quants.dequantize."""
    return _dequantize(raw, 18, 4, "dequantize_q4_0")


@on_kernel_thread
def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """uint8 [N, nb*34] Q8_0 rows -> float32 [N, nb*32], bit-exact with gguf.quants.dequantize."""
    return _dequantize(raw, 34, 8, "dequantize_q8_0")


@dataclass(frozen=True, eq=False)
class Q8Activations:
    """T activation rows of length n_in quantized to Q8_0, laid out for the gemm kernels: block-major
    so that one weight block meets every row's matching block in consecutive memory."""

    q: np.ndarray  # int8 [nb, T, 32]
    d: np.ndarray  # float32 [nb, T]   block scales
    s: np.ndarray  # int32 [nb, T]     sum of the block's q

    @property
    def n_tokens(self) -> int:
        return self.d.shape[1]

    @property
    def n_in(self) -> int:
        return self.d.shape[0] * QK


def empty_activations(n_tokens: int, n_in: int) -> Q8Activations:
    nb = n_in // QK
    return Q8Activations(np.empty((nb, n_tokens, QK), np.int8), np.empty((nb, n_tokens), np.float32),
                         np.empty((nb, n_tokens), np.int32))


# below this many rows a second parallel region costs more than quantizing serially
PAR_QUANT_MIN_ROWS = 32


@on_kernel_thread
def quantize_activations(x: np.ndarray) -> Q8Activations:
    """float32 [T, K] (C-contiguous, K % 32 == 0) -> Q8Activations (llama.cpp's quantize_row_q8_0
    per row, float32 scales)."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"quantize_activations: expected float32 [T, K], got "
                         f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}")
    if x.shape[1] % QK:
        raise ValueError(f"quantize_activations: K must be a multiple of {QK}, got {x.shape[1]}")
    if not x.flags.c_contiguous:
        raise ValueError("quantize_activations: x must be C-contiguous")
    qa = empty_activations(x.shape[0], x.shape[1])
    if x.size:
        nch = _nch(x.shape[0])
        if nch > 1 and x.shape[0] >= PAR_QUANT_MIN_ROWS:
            _quantize_act_par(x, qa.q, qa.d, qa.s, nch)
        else:
            quantize_act_cols(x, qa.q, qa.d, qa.s, 0, x.shape[0])
    return qa


# ---------------------------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------------------------
def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x.reshape(-1, QK)


def quantize_q4_0_ref(x: np.ndarray) -> np.ndarray:
    n = np.asarray(x).shape[0]
    blk = _blocks(x)
    mx = np.take_along_axis(blk, np.abs(blk).argmax(axis=1)[:, None], axis=1)
    d = mx / np.float32(-8)
    with np.errstate(divide="ignore"):
        idd = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.minimum(np.trunc(blk * idd + np.float32(8.5)), 15).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << np.uint8(4))
    return np.concatenate([d.astype(np.float16).view(np.uint8), qs], axis=1).reshape(n, -1)


def quantize_q8_0_ref(x: np.ndarray) -> np.ndarray:
    n = np.asarray(x).shape[0]
    blk = _blocks(x)
    d = np.abs(blk).max(axis=1) / np.float32(127)
    with np.errstate(divide="ignore"):
        idd = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = blk * idd[:, None]
    a = np.abs(v)
    fl = np.floor(a)
    q = (np.sign(v) * (fl + np.floor(2 * (a - fl)))).astype(np.int8)  # roundf: halves away from zero
    d16 = d[:, None].astype(np.float16).view(np.uint8)
    return np.concatenate([d16, q.view(np.uint8)], axis=1).reshape(n, -1)


def _q8_blocks_ref(blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """blocks float32 [n, 32] -> (d float32 [n], q int8 [n, 32]): d = fp16(amax/127),
    q = rint(x * (127/amax))."""
    amax = np.abs(blk).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        idd = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    return d, np.rint(blk * idd[:, None]).astype(np.int8)


def dequantize_q4_0_ref(raw: np.ndarray) -> np.ndarray:
    n = raw.shape[0]
    blk = np.asarray(raw, dtype=np.uint8).reshape(-1, 18)
    d = blk[:, :2].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([blk[:, 2:] & 15, blk[:, 2:] >> 4], axis=1).astype(np.int8) - np.int8(8)
    return (d * q.astype(np.float32)).reshape(n, -1)


def dequantize_q8_0_ref(raw: np.ndarray) -> np.ndarray:
    n = raw.shape[0]
    blk = np.asarray(raw, dtype=np.uint8).reshape(-1, 34)
    d = blk[:, :2].copy().view(np.float16).astype(np.float32)
    return (d * blk[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(n, -1)


def quantize_activations_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [T, K] -> (q int8 [T, K], d float32 [T, K//32]) row-major (not the kernels' layout)."""
    T, K = x.shape
    d, q = _q8_blocks_ref(_blocks(x))
    return q.reshape(T, K), d.reshape(T, K // QK)
