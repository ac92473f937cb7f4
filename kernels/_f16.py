"""IEEE half <-> single conversions in plain numba (no F16C needed), bit-exact with numpy's casts."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

_OPTS = dict(cache=True, nogil=True, error_model="numpy")


@njit(**_OPTS)
def f16_to_f32(h: int) -> np.float32:
    """The float32 value of the fp16 bit pattern ``h`` (0..65535); exact."""
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = math.ldexp(float(m), -24)  # subnormal (or zero): m * 2^-24, exact
    elif e == 31:
        v = math.inf if m == 0 else math.nan
    else:
        v = math.ldexp(float(m + 1024), e - 25)
    if h & 0x8000:
        v = -v
    return np.float32(v)


@njit(**_OPTS)
def f32_bits_to_f16(f: int) -> int:
    """fp16 bit pattern nearest (ties to even) to the float32 with bit pattern ``f`` (uint32 value);
    the algorithm of numpy's npy_floatbits_to_halfbits (overflow to inf, subnormals, NaN kept NaN)."""
    h_sgn = (f & 0x80000000) >> 16
    f_exp = f & 0x7F800000
    if f_exp >= 0x47800000:  # overflow, inf or NaN
        if f_exp == 0x7F800000:
            f_sig = f & 0x007FFFFF
            if f_sig != 0:
                ret = 0x7C00 + (f_sig >> 13)
                if ret == 0x7C00:
                    ret += 1
                return h_sgn + ret
        return h_sgn + 0x7C00
    if f_exp <= 0x38000000:  # result is a subnormal half or zero
        if f_exp < 0x33000000:
            return h_sgn
        e = f_exp >> 23
        f_sig = 0x00800000 + (f & 0x007FFFFF)
        f_sig >>= 113 - e
        # round half to even: the shift above may have dropped up to 11 low bits of f
        if (f_sig & 0x3FFF) != 0x1000 or (f & 0x7FF) != 0:
            f_sig += 0x1000
        return h_sgn + (f_sig >> 13)
    h_exp = (f_exp - 0x38000000) >> 13
    f_sig = f & 0x007FFFFF
    if (f_sig & 0x3FFF) != 0x1000:
        f_sig += 0x1000
    # a carry out of the significand bumps the exponent (and 65520.. rounds up to inf): both correct
    return h_sgn + h_exp + (f_sig >> 13)


@njit(**_OPTS)
def f32_to_f16_array(src, dst):
    """dst (uint16 [n]) = fp16 bit patterns of src (float32 [n], contiguous)."""
    bits = src.view(np.uint32)
    for i in range(src.shape[0]):
        dst[i] = f32_bits_to_f16(np.int64(bits[i]))
