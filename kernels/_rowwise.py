"""Shared pieces of the row-wise kernels: numba options, argument checks, and ``exp_f32``.

``exp_f32`` is a float32 Cephes-style polynomial exponential: libm's expf does not vectorize, this
does, and it is pure IEEE arithmetic (no fast-math), so a vector lane and a scalar call give the
same bits.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# error_model "numpy": x / 0 gives inf; the "python" model checks every division, which blocks vectorizing
OPTS = dict(cache=True, nogil=True, error_model="numpy")
# Below these many elements a kernel's serial driver beats its parallel one (a launch costs ~1 us and
# the second thread's share must outweigh it).  Measured on 2 Zen 4 cores, SmolLM2 shapes: SwiGLU
# (an exp and a division per element) wins from ~24k elements (8 tokens), RMSNorm and RoPE from ~16k
# (RMSNorm at 16 tokens: 3.8 us serial, 5.1 us parallel; SwiGLU: 14.2 and 9.9 us).
PAR_MIN_NORM = 1 << 14
PAR_MIN_ROPE = 1 << 14
PAR_MIN_SWIGLU = 24576

_F0, F1, _F_HALF = np.float32(0.0), np.float32(1.0), np.float32(0.5)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # few mantissa bits: n * _LN2_HI is exact for |n| < 2^9
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LO, _EXP_HI = np.float32(-87.33654), np.float32(88.37626)  # expf underflows / overflows beyond
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
INF32 = np.float32(np.inf)
# exp_f32's constants by name, for the kernels that build it in LLVM IR (``_exp_ir``)
EXP_CONSTANTS = {"lo": _EXP_LO, "hi": _EXP_HI, "log2e": _LOG2E, "half": _F_HALF, "ln2_hi": _LN2_HI,
                 "ln2_lo": _LN2_LO, "p": (_P0, _P1, _P2, _P3, _P4, _P5), "zero": _F0, "one": F1, "inf": INF32}


@intrinsic
def _i32_bits_as_f32(typingctx, i):
    """The float32 whose bits are the low 32 bits of the integer ``i`` (a register move; vectorizes)."""
    if not isinstance(i, types.Integer) or i.bitwidth not in (32, 64):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)) if i.bitwidth > 32 else args[0],
                               ir.FloatType())

    return types.float32(i), codegen


@njit(**OPTS)
def exp_f32(x):
    """e**x for a float32 ``x``, in float32, within 1 ulp of the exact value (measured 0.97 ulp);
    0 below -87.34 (no subnormal results), inf above 88.38.  Branch-free IEEE arithmetic, so a loop
    of it vectorizes and a vector lane gives the same bits as a scalar call."""
    xc = min(max(x, _EXP_LO), _EXP_HI)
    n = np.floor(xc * _LOG2E + _F_HALF)  # e**x = 2**n * e**r, |r| <= ln2 / 2
    r = xc - n * _LN2_HI
    r = r - n * _LN2_LO
    p = _P0 * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * (r * r) + r + F1
    y = p * _i32_bits_as_f32((np.int64(n) + 127) << 23)  # * 2**n, n in [-126, 127]
    y = _F0 if x < _EXP_LO else y
    return INF32 if x > _EXP_HI else y


def check_f32(name: str, a: np.ndarray, ndim: int) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != ndim or not a.flags.c_contiguous:
        desc = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{name} must be a C-contiguous float32 array with {ndim} dims, got {desc}")


def gated_out(gate_up: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Check a gated FFN's input (float32 [T, 2F]: gate, then up) and return its output array
    (``out`` checked, or a new float32 [T, F])."""
    check_f32("gate_up", gate_up, 2)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up width must be even (gate and up halves), got {gate_up.shape[1]}")
    shape = (gate_up.shape[0], gate_up.shape[1] // 2)
    if out is None:
        return np.empty(shape, np.float32)
    check_f32("out", out, 2)
    if out.shape != shape:
        raise ValueError(f"out shape {out.shape} != {shape}")
    return out

