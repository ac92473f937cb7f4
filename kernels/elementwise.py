"""Row-wise kernels of a transformer layer: RMSNorm, RoPE, SwiGLU and GeGLU, softmax, residual add.

Every row is computed by the same code whatever else is in the batch: the serial and the parallel
drivers of a kernel call one per-row function, and nothing here carries fast-math flags, so IEEE
arithmetic makes the two bit-identical (batch invariance).  Large batches take the parallel driver,
small ones the serial one (a parallel launch costs microseconds, which decode cannot afford).

Precision follows llama.cpp's ggml CPU ops: RMSNorm sums float32 squares in float64; RoPE (in
``_rope``, re-exported here) builds its angles in float32 with ``theta *= theta_scale`` per pair.
The exponential is ``exp_f32`` (``_rowwise``): a float32 polynomial within 1 ulp, because libm's
expf does not vectorize.  ``*_ref`` functions are numpy references.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from weaved.kernels._geglu import geglu, geglu_ref, gelu_ref
from weaved.kernels._llvm import sumsq_f64
from weaved.kernels._rope import (
    plain_rope,
    rope,
    rope_angles64,
    rope_cos_sin,
    rope_params,
    rope_ref,
    rope_ref64,
    rotate64,
)
from weaved.kernels._rowwise import F1, INF32, OPTS, PAR_MIN_NORM, PAR_MIN_SWIGLU, check_f32, exp_f32, gated_out
from weaved.kernels.threads import on_kernel_thread

# ---------------------------------------------------------------- RMSNorm


@njit(**OPTS)
def _rmsnorm_row(x, w, eps, y):
    """y = x / sqrt(mean(x^2) + eps) * w, the way ggml computes it (x, w, y: float32 [D]): float32
    squares summed in float64 (here in 16 interleaved lanes, then the lanes in order), the mean
    rounded to float32, scale = 1 / sqrtf(mean + eps), y = (x * scale) * w."""
    n = x.shape[0]
    mean = np.float32(sumsq_f64(x) / n)
    scale = F1 / np.sqrt(mean + eps)
    for i in range(x.shape[0]):
        y[i] = (x[i] * scale) * w[i]  # ggml: rms_norm, then the mul by the weight


@njit(**OPTS)
def _rmsnorm_serial(x, w, eps, y):
    for t in range(x.shape[0]):
        _rmsnorm_row(x[t], w, eps, y[t])


@njit(parallel=True, **OPTS)
def _rmsnorm_parallel(x, w, eps, y):
    for t in prange(x.shape[0]):
        _rmsnorm_row(x[t], w, eps, y[t])


@njit(**OPTS)
def rmsnorm_drive(x, w, eps, y):
    """The serial or the parallel driver, by size (the same bits either way)."""
    if x.size >= PAR_MIN_NORM:
        _rmsnorm_parallel(x, w, eps, y)
    else:
        _rmsnorm_serial(x, w, eps, y)


@on_kernel_thread
def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm of every row: x float32 [T, D], w float32 [D] -> out float32 [T, D] (may be x)."""
    check_f32("x", x, 2)
    check_f32("w", w, 1)
    if w.shape[0] != x.shape[1]:
        raise ValueError(f"weight length {w.shape[0]} != row length {x.shape[1]}")
    if out is None:
        out = np.empty_like(x)
    else:
        check_f32("out", out, 2)
        if out.shape != x.shape:
            raise ValueError(f"out shape {out.shape} != x shape {x.shape}")
    rmsnorm_drive(x, w, np.float32(eps), out)
    return out


@on_kernel_thread
def rmsnorm_heads(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """In-place RMSNorm of every head vector: x float32 [T, H, Dh], w float32 [Dh] (qwen3's q/k norm)."""
    check_f32("x", x, 3)
    check_f32("w", w, 1)
    if w.shape[0] != x.shape[2]:
        raise ValueError(f"weight length {w.shape[0]} != head dim {x.shape[2]}")
    rows = x.reshape(-1, x.shape[2])  # a view: x is C-contiguous
    rmsnorm_drive(rows, w, np.float32(eps), rows)
    return x


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """float64 RMSNorm over the last axis."""
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


# ---------------------------------------------------------------- SwiGLU, softmax, add


@njit(**OPTS)
def _swiglu_row(gu, y):
    f = y.shape[0]
    for i in range(f):
        g = gu[i]
        y[i] = g / (F1 + exp_f32(-g)) * gu[f + i]  # silu(gate) * up


@njit(**OPTS)
def _swiglu_serial(gu, y):
    for t in range(gu.shape[0]):
        _swiglu_row(gu[t], y[t])


@njit(parallel=True, **OPTS)
def _swiglu_parallel(gu, y):
    for t in prange(gu.shape[0]):
        _swiglu_row(gu[t], y[t])


@njit(**OPTS)
def swiglu_drive(gu, y):
    """The serial or the parallel driver, by size (the same bits either way)."""
    if gu.size >= PAR_MIN_SWIGLU:
        _swiglu_parallel(gu, y)
    else:
        _swiglu_serial(gu, y)


@on_kernel_thread
def swiglu(gate_up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up: gate_up float32 [T, 2F] (gate = [:, :F], up = [:, F:]) -> float32 [T, F]."""
    out = gated_out(gate_up, out)
    swiglu_drive(gate_up, out)
    return out


def swiglu_ref(gate_up: np.ndarray) -> np.ndarray:
    """float64 silu(gate) * up."""
    g64 = gate_up.astype(np.float64)
    f = g64.shape[1] // 2
    g, u = g64[:, :f], g64[:, f:]
    return g / (1.0 + np.exp(-g)) * u


@njit(**OPTS)
def _softmax_row(x, y):
    # max and float64 sum in 16 interleaved lanes, then the lanes in a fixed order: vectorizes
    # without reassociation, so the bits depend on the row alone
    n = x.shape[0]
    n16 = n - n % 16
    top = np.full(16, -INF32, np.float32)
    for b in range(0, n16, 16):
        for k in range(16):
            top[k] = max(top[k], x[b + k])
    for k in range(n - n16):
        top[k] = max(top[k], x[n16 + k])
    m = top.max()
    for i in range(n):
        y[i] = exp_f32(x[i] - m)
    lanes = np.zeros(16, np.float64)
    for b in range(0, n16, 16):
        for k in range(16):
            lanes[k] += y[b + k]
    for k in range(n - n16):
        lanes[k] += y[n16 + k]
    s = 0.0
    for k in range(16):
        s += lanes[k]
    inv = np.float32(1.0 / s)
    for i in range(x.shape[0]):
        y[i] = y[i] * inv


@njit(**OPTS)
def _softmax_rows(x, y):
    for t in range(x.shape[0]):
        _softmax_row(x[t], y[t])


@njit(**OPTS)
def softmax_drive(x, y):
    """y = the softmax of each row of x (float32 [T, N], compiled callers)."""
    _softmax_rows(x, y)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax of each row (max-subtracted, float32): x float32 [N] or [T, N] -> a new array."""
    if not isinstance(x, np.ndarray) or x.ndim not in (1, 2):
        raise ValueError(f"softmax takes a float32 [N] or [T, N] array, got {getattr(x, 'shape', type(x))}")
    check_f32("x", x, x.ndim)
    if x.shape[-1] == 0:
        raise ValueError("softmax of an empty row")
    rows = x.reshape(-1, x.shape[-1])
    y = np.empty_like(rows)
    _softmax_rows(rows, y)
    return y.reshape(x.shape)


def softmax_ref(x: np.ndarray) -> np.ndarray:
    """float64 softmax of the last axis."""
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def add_(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x += y in place (the residual add): float32 arrays of one shape."""
    arrays = isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
    if not arrays or x.dtype != np.float32 or y.dtype != np.float32:
        raise ValueError("add_ takes two float32 arrays")
    if x.shape != y.shape:
        raise ValueError(f"add_ shapes differ: {x.shape} vs {y.shape}")
    np.add(x, y, out=x)
    return x


__all__ = [
    "exp_f32", "rmsnorm", "rmsnorm_heads", "rmsnorm_ref", "plain_rope", "rope", "rope_cos_sin", "rope_params",
    "rope_ref", "rope_ref64", "rope_angles64", "rotate64", "swiglu", "swiglu_ref", "geglu", "geglu_ref", "gelu_ref",
    "softmax", "softmax_drive", "softmax_ref", "add_",
]
