"""GeGLU, ggml's CPU way: gelu(gate) * up with GELU read from a float16 table.

ggml's CPU GELU (``ggml_vec_geglu_f32``) is 0 for x <= -10 and x for x >= 10; in between it rounds x
to float16, looks up the float16 value of the tanh approximation
``0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))`` computed in float32 for that float16 input,
and multiplies it (as float32) by ``up``.  The table here is built the same way, so a gate value
maps to the bits llama.cpp uses; ``geglu_ref`` is the exact float64 function.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from weaved.kernels._attention_ir import f2h
from weaved.kernels._rowwise import OPTS, PAR_MIN_SWIGLU, gated_out
from weaved.kernels.threads import on_kernel_thread

GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)


def _gelu_table() -> np.ndarray:
    """float32 [65536]: entry h is the float16-rounded GELU of the float16 with bit pattern h."""
    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        inner = (SQRT_2_OVER_PI * x) * (np.float32(1.0) + (GELU_COEF_A * x) * x)
        g = (np.float32(0.5) * x) * (np.float32(1.0) + np.tanh(inner))
    return g.astype(np.float16).astype(np.float32)


GELU_TABLE = _gelu_table()
_LO, _HI = np.float32(-10.0), np.float32(10.0)


@njit(**OPTS)
def _geglu_row(gu, y, table):
    f = y.shape[0]
    for i in range(f):
        g = gu[i]
        if g <= _LO:
            a = np.float32(0.0)
        elif g >= _HI:
            a = g
        else:
            a = table[np.int64(f2h(g))]
        y[i] = a * gu[f + i]  # gelu(gate) * up


@njit(**OPTS)
def _geglu_serial(gu, y, table):
    for t in range(gu.shape[0]):
        _geglu_row(gu[t], y[t], table)


@njit(parallel=True, **OPTS)
def _geglu_parallel(gu, y, table):
    for t in prange(gu.shape[0]):
        _geglu_row(gu[t], y[t], table)


@njit(**OPTS)
def geglu_drive(gu, y, table):
    """The serial or the parallel driver, by size (the same bits either way); table: GELU_TABLE."""
    if gu.size >= PAR_MIN_SWIGLU:
        _geglu_parallel(gu, y, table)
    else:
        _geglu_serial(gu, y, table)


@on_kernel_thread
def geglu(gate_up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """gelu(gate) * up: gate_up float32 [T, 2F] (gate = [:, :F], up = [:, F:]) -> float32 [T, F]."""
    out = gated_out(gate_up, out)
    geglu_drive(gate_up, out, GELU_TABLE)
    return out


def gelu_ref(x: np.ndarray) -> np.ndarray:
    """float64 GELU, tanh approximation (the function the table rounds)."""
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * x * (1.0 + 0.044715 * x * x)))


def geglu_ref(gate_up: np.ndarray) -> np.ndarray:
    """float64 gelu(gate) * up."""
    g64 = gate_up.astype(np.float64)
    f = g64.shape[1] // 2
    return gelu_ref(g64[:, :f]) * g64[:, f:]
