"""The torch backend's row-wise operations as Triton kernels (its path on CUDA): RMSNorm, RoPE, SwiGLU,
GeGLU and the Q8_0 quantization of activations.

Each is ``torch_rowwise`` / ``torch_q4``'s recipe - itself the CPU kernels' - operation for operation,
so a row's bits are the CPU backend's:

* every kernel runs with ``enable_fp_fusion=False`` (no multiply-add is contracted into an fma the CPU
  does not do), divisions are ``div_rn`` and square roots ``sqrt_rn`` (CUDA's default ``/`` and ``sqrt``
  on float32 are approximations);
* ``exp`` is the CPU kernels' polynomial (``torch_rowwise.exp_f32``: a clamp, a range reduction by
  ln 2 in two parts, a degree-6 polynomial, 2**n built from its bits);
* RMSNorm sums a row's float32 squares in float64 by the same halving tree as ``tree_sum`` (ggml's
  CPU sums in float64; D adds a row, nothing beside the products - the one float64 op on the device);
* rounding to an integer is ``(v + 1.5 * 2**23) - 1.5 * 2**23``: round half to even, exact for |v| <
  2**22 with IEEE adds, as ``rint`` does.

One program handles one row (a token's vector, or one head of it); the row's length is padded to a
power of two inside the program, padding that adds nothing (+0.0 to sums of squares, masked loads and
stores).  ``TRITON_INTERPRET=1`` runs them on CPU tensors for the tests; the interpreter has no fma to
avoid, so there the results are the torch path's bit for bit too.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from weaved.kernels.torch_q4 import QK, Q8Act
from weaved.kernels.torch_rowwise import check_tensor


def f32(v: float) -> float:
    """``v`` rounded to float32: a kernel's float argument as the CPU kernels' float32 constant."""
    return float(np.float32(v))


# exp_f32's constants (torch_rowwise, kernels/_rowwise.py), float32 values
_LOG2E = tl.constexpr(f32(1.44269504088896341))
_LN2_HI = tl.constexpr(f32(0.693359375))
_LN2_LO = tl.constexpr(f32(-2.12194440e-4))
_EXP_LO = tl.constexpr(f32(-87.33654))
_EXP_HI = tl.constexpr(f32(88.37626))
_P0 = tl.constexpr(f32(1.9875691500e-4))
_P1 = tl.constexpr(f32(1.3981999507e-3))
_P2 = tl.constexpr(f32(8.3334519073e-3))
_P3 = tl.constexpr(f32(4.1665795894e-2))
_P4 = tl.constexpr(f32(1.6666665459e-1))
_P5 = tl.constexpr(f32(5.0000001201e-1))
_RINT = tl.constexpr(12582912.0)  # 1.5 * 2**23
# every Triton kernel of the CPU's arithmetic launches with these: no multiply-add contracted into an fma
# the CPU kernel does not make
FLAGS = {"enable_fp_fusion": False}


@triton.jit
def exp_f32(x):
    """e**x of float32 x, ``torch_rowwise.exp_f32`` op for op (0 below -87.34, inf above 88.38)."""
    xc = tl.minimum(tl.maximum(x, _EXP_LO), _EXP_HI)
    n = tl.floor(xc * _LOG2E + 0.5)
    r = xc - n * _LN2_HI
    r = r - n * _LN2_LO
    p = r * _P0 + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * (r * r) + r + 1.0
    two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    y = p * two_n
    y = tl.where(x < _EXP_LO, 0.0, y)
    return tl.where(x > _EXP_HI, float("inf"), y)


@triton.jit
def rms_scale(x, D, eps, P: tl.constexpr):
    """1 / sqrt(mean(x*x) + eps) of a row x float32 [P] (D values, the rest +0.0), as
    ``torch_rowwise.rmsnorm`` computes it: the squares summed in float64 by tree_sum's halving tree."""
    s = (x * x).to(tl.float64)  # the float32 squares, exact in float64; padding adds +0.0
    for lvl in tl.static_range(P.bit_length() - 1):  # i + (i + half): the halving tree of tree_sum
        s = tl.sum(tl.reshape(s, (2, P >> (lvl + 1))), axis=0)
    mean = (s / D.to(tl.float64)).to(tl.float32)  # float64 division is IEEE on CUDA (div.rn.f64)
    return tl.math.div_rn(1.0, tl.sqrt_rn(mean + eps))


@triton.jit
def q8_blocks(x):
    """Q8_0 of 32-value blocks x float32 [R, 32] -> (quants [R, 32] float32 in -127..127, scales [R]):
    d = fp16(amax / 127), q = rint(x * (127 / amax)), 0 where amax is 0."""
    amax = tl.max(tl.abs(x), axis=1)  # exact in any order
    d = tl.math.div_rn(amax, 127.0).to(tl.float16).to(tl.float32)
    nz = amax != 0.0
    idd = tl.where(nz, tl.math.div_rn(127.0, tl.where(nz, amax, 1.0)), 0.0)
    v = x * idd[:, None]
    return (v + _RINT) - _RINT, d  # round half to even


@triton.jit
def _rmsnorm(x_ptr, w_ptr, y_ptr, D, eps, P: tl.constexpr):
    """Row r of x float32 [R, D] -> y: (x * 1 / sqrt(mean(x*x) + eps)) * w (``torch_rowwise.rmsnorm``)."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, P)
    m = i < D
    x = tl.load(x_ptr + r * D + i, mask=m, other=0.0)  # [P]
    scale = rms_scale(x, D, eps, P)
    w = tl.load(w_ptr + i, mask=m, other=0.0)
    tl.store(y_ptr + r * D + i, (x * scale) * w, mask=m)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x float32 [..., D], w float32 [D] -> float32 [..., D]."""
    check_tensor("x", x, torch.float32)
    check_tensor("w", w, torch.float32, 1)
    D = x.shape[-1]
    if D != w.shape[0]:
        raise ValueError(f"weight length {w.shape[0]} != row length {D}")
    xc = x.contiguous()
    y = torch.empty_like(xc)
    R = xc.numel() // D if D else 0
    if R:
        _rmsnorm[(R,)](xc, w.contiguous(), y, D, f32(eps), P=triton.next_power_of_2(D), **FLAGS)
    return y


@triton.jit
def glu_cols(gu_ptr, table_ptr, t, j, m, F, GELU: tl.constexpr):
    """act(gate) * up at columns j (m: j < F) of row t of gate|up float32 [T, 2F]: silu, or GELU by the
    CPU kernel's float16 table; 0 past F."""
    g = tl.load(gu_ptr + t * 2 * F + j, mask=m, other=0.0)
    u = tl.load(gu_ptr + t * 2 * F + F + j, mask=m, other=0.0)
    if GELU:  # the CPU kernel's table at the gate rounded to float16; 0 below -10, the gate above 10
        idx = g.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        a = tl.load(table_ptr + idx, mask=m, other=0.0)
        a = tl.where(g <= -10.0, 0.0, tl.where(g >= 10.0, g, a))
    else:  # silu: g / (1 + exp(-g))
        a = tl.math.div_rn(g, exp_f32(-g) + 1.0)
    return a * u


@triton.jit
def _glu(gu_ptr, table_ptr, y_ptr, F, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """Row t of gate|up float32 [T, 2F], columns [b*BLOCK, (b+1)*BLOCK) of the result [T, F]."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < F
    tl.store(y_ptr + t * F + j, glu_cols(gu_ptr, table_ptr, t, j, m, F, GELU), mask=m)


def _glu_call(gate_up: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    check_tensor("gate_up", gate_up, torch.float32, 2)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up width must be even (gate and up halves), got {gate_up.shape[1]}")
    T, F = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty((T, F), dtype=torch.float32, device=gate_up.device)
    if T and F:
        block = min(1024, triton.next_power_of_2(F))
        tab = table if table is not None else y  # not read without GELU
        _glu[(T, triton.cdiv(F, block))](gate_up.contiguous(), tab, y, F, GELU=table is not None, BLOCK=block,
                                         **FLAGS)
    return y


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: float32 [T, 2F] (gate | up) -> [T, F]."""
    return _glu_call(gate_up, None)


def geglu(gate_up: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up by the CPU kernel's float16 table (``torch_rowwise.gelu_table``)."""
    check_tensor("table", table, torch.float32, 1)
    if table.shape[0] != 65536:
        raise ValueError(f"the GELU table has 65536 entries, got {table.shape[0]}")
    return _glu_call(gate_up, table)


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, y_ptr, H, DH, HALF, NEOX: tl.constexpr, P: tl.constexpr):
    """Token t, head h of x float32 [T, H, DH]: the first 2*HALF dims rotated by the token's cos/sin
    [HALF]; x0' = x0 c - x1 s, x1' = x0 s + x1 c (neox pairs i, i + HALF; else 2i, 2i + 1)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = x_ptr + (t * H + h) * DH
    out = y_ptr + (t * H + h) * DH
    i = tl.arange(0, P)
    m = i < HALF
    c = tl.load(cos_ptr + t * HALF + i, mask=m, other=0.0)
    s = tl.load(sin_ptr + t * HALF + i, mask=m, other=0.0)
    if NEOX:
        i0, i1 = i, i + HALF
    else:
        i0, i1 = 2 * i, 2 * i + 1
    x0 = tl.load(base + i0, mask=m, other=0.0)
    x1 = tl.load(base + i1, mask=m, other=0.0)
    tl.store(out + i0, x0 * c - x1 * s, mask=m)
    tl.store(out + i1, x0 * s + x1 * c, mask=m)
    for k0 in range(2 * HALF, DH, P):  # dims past the rotated ones are copied
        k = k0 + i
        km = k < DH
        tl.store(out + k, tl.load(base + k, mask=km, other=0.0), mask=km)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotary embedding of every head (``torch_rowwise.rope``): x float32 [T, H, Dh], cos/sin float32
    [T, n_rot/2] -> a new tensor."""
    check_tensor("x", x, torch.float32, 3)
    T, H, Dh = x.shape
    half = cos.shape[1]
    if cos.shape != (T, half) or sin.shape != (T, half) or 2 * half > Dh:
        raise ValueError(f"cos/sin must be [{T}, n_rot/2] with n_rot <= {Dh}, got {tuple(cos.shape)}")
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if T and H and half:
        _rope[(T, H)](xc, cos.contiguous(), sin.contiguous(), y, H, Dh, half, NEOX=neox,
                      P=triton.next_power_of_2(half), **FLAGS)
    elif T and H:
        y.copy_(xc)
    return y


@triton.jit
def _quantize(x_ptr, q_ptr, d_ptr, NB, ROWS: tl.constexpr):
    """Blocks [b*ROWS, (b+1)*ROWS) of the 32-value blocks of x float32 [T*NB, 32] -> int8 quants and
    float32 scales: d = fp16(amax / 127), q = rint(x * (127 / amax)), 0 where amax is 0."""
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] block indices
    bm = b < NB
    k = tl.arange(0, 32)
    x = tl.load(x_ptr + b[:, None] * 32 + k[None, :], mask=bm[:, None], other=0.0)  # [ROWS, 32]
    q, d = q8_blocks(x)
    tl.store(q_ptr + b[:, None] * 32 + k[None, :], q.to(tl.int8), mask=bm[:, None])
    tl.store(d_ptr + b, d, mask=bm)


def quantize_act(x: torch.Tensor) -> Q8Act:
    """float32 [T, K] (K % 32 == 0) -> Q8_0 per 32-block (``torch_q4.quantize_act``'s bits)."""
    check_tensor("x", x, torch.float32, 2)
    T, K = x.shape
    if K % QK:
        raise ValueError(f"quantize_act: K must be a multiple of {QK}, got {K}")
    nb = T * (K // QK)
    q = torch.empty((T, K // QK, QK), dtype=torch.int8, device=x.device)
    d = torch.empty((T, K // QK), dtype=torch.float32, device=x.device)
    if nb:
        rows = 64
        _quantize[(triton.cdiv(nb, rows),)](x.contiguous(), q, d, nb, ROWS=rows, **FLAGS)
    return Q8Act(q, d)


def quantize_two_level(x: torch.Tensor) -> tuple[Q8Act, Q8Act]:
    """x float32 [T, K] -> the Q8_0 quantization of x, then that of its rounding error x - d1*q1."""
    a = quantize_act(x)
    x1 = (a.q.to(torch.float32) * a.d.unsqueeze(-1)).reshape(x.shape)  # exact: 8 x 11 bits
    return a, quantize_act(x - x1)
