"""Products of GGUF-quantized weights with Q8_0 activations in plain torch ops (any device).

Weights live on the device as the file stores them (``DeviceWeight``): Q4_0 / Q8_0 as raw blocks,
uint8 [n_out, nb, 18 | 34] (an fp16 scale, then 16 bytes of nibbles or 32 int8), F16 / F32 as is.
They are unpacked inside a product, a slab of rows at a time; no unpacked copy outlives the call.

The recipe is the CPU kernels' (``matmul``, ``quants``), i.e. llama.cpp's, and so are the bits:
each activation row is quantized to Q8_0 (``quantize_act``: bit-identical to
``quants.quantize_activations``), every 32-block's dot product isum_b is an exact integer, and
y[t, n] accumulates acc = fma(isum_b, d_x[t, b] * d_w[n, b], acc) in block order b = 0, 1, ...
(``scale_and_sum``).  The integer block sums come from float32 ``bmm`` over integer-valued
operands, exact in any summation order since every partial sum stays below 2**24
(|q4 * q8| * 32 <= 32512, |q8 * q8| * 32 <= 516128), or from ``torch._int_mm`` for a few rows -
the same integers either way.  So row t of a product depends only on row t of x, whatever the
batch (batch invariance), on every path.

On CUDA the Q4_0 / Q8_0 product is ``triton_q4.linear_q`` (the same arithmetic);
``torch_products.kernel_path`` says which one a device gets.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from weaved.kernels.torch_rowwise import check_tensor, div_scalar

QK = 32
Q4_0, Q8_0, F32, F16 = 2, 8, 0, 1  # ggml type ids
BLOCK_BYTES = {Q4_0: 18, Q8_0: 34}
SLAB_ELEMS = 1 << 22  # elements of a product's per-slab temporaries (weights unpacked, block sums)
BULK_ELEMS = 1 << 18  # block partials up to which scale_and_sum scales all blocks at once
INT_MM_MAX_ROWS = 4  # up to this many activation rows, block sums come from torch._int_mm


# ---------------------------------------------------------------------------------------------
# weights and activations
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DeviceWeight:
    """A [n_out, n_in] GGUF weight matrix on a device, in its file encoding."""

    qtype: int  # Q4_0, Q8_0 (data uint8 [n_out, nb, 18 | 34]), F16 or F32 (data [n_out, n_in])
    n_out: int
    n_in: int
    data: torch.Tensor

    @property
    def quantized(self) -> bool:
        return self.qtype in BLOCK_BYTES

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @classmethod
    def upload(cls, raw: np.ndarray, qtype: int, n_out: int, n_in: int, device: torch.device | str
               ) -> DeviceWeight:
        """Copy a GGUF tensor (uint8 [n_out, row_bytes] for Q4_0/Q8_0, float16/float32 [n_out, n_in])
        to ``device`` as is."""
        raw = np.asarray(raw)
        if qtype in BLOCK_BYTES:
            if n_in % QK or raw.dtype != np.uint8 or raw.shape != (n_out, n_in // QK * BLOCK_BYTES[qtype]):
                raise ValueError(f"type {qtype} [{n_out}, {n_in}] needs uint8 [{n_out}, "
                                 f"{n_in // QK * BLOCK_BYTES[qtype]}], got {raw.dtype} {raw.shape}")
            shape = (n_out, n_in // QK, BLOCK_BYTES[qtype])
        elif qtype in (F16, F32):
            want = np.float16 if qtype == F16 else np.float32
            if raw.dtype != want or raw.shape != (n_out, n_in):
                raise ValueError(f"type {qtype} needs {np.dtype(want).name} [{n_out}, {n_in}], got "
                                 f"{raw.dtype} {raw.shape}")
            shape = (n_out, n_in)
        else:
            raise ValueError(f"unsupported GGML type {qtype} (supported: F32, F16, Q4_0, Q8_0)")
        t = torch.from_numpy(np.array(raw, copy=True).reshape(shape))  # owned, writeable, contiguous
        return cls(int(qtype), int(n_out), int(n_in), t.to(device))


@dataclass(frozen=True, eq=False)
class Q8Act:
    """T activation rows quantized to Q8_0: q int8 [T, nb, 32], d float32 [T, nb] (fp16 values)."""

    q: torch.Tensor
    d: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return self.q.shape[0]


def quantize_act(x: torch.Tensor) -> Q8Act:
    """float32 [T, K] (K % 32 == 0) -> Q8_0 per 32-block, llama.cpp's quantize_row_q8_0 (x86):
    d = fp16(amax / 127), q = rint(x * (127 / amax)) (half to even; 0 where amax == 0)."""
    check_tensor("x", x, torch.float32, 2)
    T, K = x.shape
    if K % QK:
        raise ValueError(f"quantize_act: K must be a multiple of {QK}, got {K}")
    xb = x.reshape(T, K // QK, QK)  # [T, nb, 32]
    amax = xb.abs().amax(dim=-1)  # [T, nb]: max is exact in any order
    d = div_scalar(amax, 127.0).to(torch.float16).to(torch.float32)
    nz = amax != 0
    idd = torch.where(nz, torch.full_like(amax, 127.0) / torch.where(nz, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    q = torch.round(xb * idd.unsqueeze(-1)).to(torch.int8)  # round: half to even, like rint
    return Q8Act(q, d)


def quantize_two_level(x: torch.Tensor) -> tuple[Q8Act, Q8Act]:
    """x float32 [T, K] -> (first, second): the Q8_0 quantization of x, then that of its rounding
    error x - d1*q1 (``residual.quantize_two_level``)."""
    a = quantize_act(x)
    x1 = (a.q.to(torch.float32) * a.d.unsqueeze(-1)).reshape(x.shape)  # exact: 8 x 11 bits
    return a, quantize_act(x - x1)


def weight_scales(raw: torch.Tensor) -> torch.Tensor:
    """The fp16 block scales of raw Q4_0/Q8_0 blocks uint8 [N, nb, bsz] as float32 [N, nb]."""
    # a block (18 or 34 bytes) is a whole number of int16: its first one is the scale's bits
    return raw.view(torch.int16)[..., 0].view(torch.float16).to(torch.float32)


def _unpack(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """Block quants of raw uint8 [N, nb, bsz] as float32 [N, nb, 32]: Q8_0 the int8 values, Q4_0
    the nibbles minus 8 (the low nibbles of the 16 bytes are elements 0..15, the high ones 16..31)."""
    if qtype == Q8_0:
        return raw[..., 2:].view(torch.int8).to(torch.float32)
    b = raw[..., 2:].to(torch.int16)  # int16 ops: torch's uint8 ops are slow on strided input
    return (torch.cat([b & 15, b >> 4], dim=-1) - 8).to(torch.float32)


def _xsum(xq: torch.Tensor) -> torch.Tensor:
    """Sum of each activation block's quants: xq int8 [T, nb, 32] -> float32 [nb, T] (exact)."""
    return xq.to(torch.int32).sum(dim=-1).t().to(torch.float32)


@functools.cache
def _cpu_int_mm() -> bool:
    """Whether this torch has ``torch._int_mm`` on the CPU (a private op; CPU support is recent)."""
    try:
        a = torch.ones((17, 32), dtype=torch.int8)
        return bool(torch._int_mm(a, a.t().contiguous()).eq(32).all())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _block_sums_int_mm(raw: torch.Tensor, qtype: int, xq: torch.Tensor) -> torch.Tensor:
    """``block_sums`` for a few rows on the CPU: int8 products of the raw blocks, as they are, with
    block-diagonal activations - row (t, b) holds block b of x_t at the byte offsets of block b's
    quants and zeros elsewhere (the scale bytes meet zeros).  No unpacking: Q8_0 bytes are the
    int8 quants; Q4_0 low and high nibbles are two whole-matrix byte ops and two products."""
    n, nb, bsz = raw.shape
    T = xq.shape[0]
    idx = torch.arange(nb, device=xq.device)
    flat = raw.reshape(n, nb * bsz)
    if qtype == Q8_0:
        xbd = xq.new_zeros((T, nb, nb, bsz))
        xbd[:, idx, idx, 2:] = xq
        s = torch._int_mm(xbd.reshape(T * nb, nb * bsz), flat.view(torch.int8).t())
    else:
        xbd = xq.new_zeros((2, T, nb, nb, bsz))
        xbd[0, :, idx, idx, 2:] = xq[:, :, :16]
        xbd[1, :, idx, idx, 2:] = xq[:, :, 16:]
        lo, hi = (flat & 15).view(torch.int8), (flat >> 4).view(torch.int8)  # nibbles 0..15 fit int8
        s = torch._int_mm(xbd[0].reshape(T * nb, nb * bsz), lo.t())
        s += torch._int_mm(xbd[1].reshape(T * nb, nb * bsz), hi.t())
    return s.reshape(T, nb, n).transpose(0, 1).to(torch.float32)  # [nb, T, n]


# ---------------------------------------------------------------------------------------------
# products
# ---------------------------------------------------------------------------------------------
def block_sums(w: DeviceWeight, xq: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
    """Exact integer block dot products of weight rows ``rows`` with xq int8 [T, nb, 32]:
    float32 [nb, T, n] with [b, t, n] = sum_j wq[n, b, j] * xq[t, b, j] (Q4_0: wq = nibble - 8)."""
    raw = w.data[rows]  # [n, nb, bsz]
    if xq.shape[0] <= INT_MM_MAX_ROWS and raw.device.type == "cpu" and _cpu_int_mm():
        s = _block_sums_int_mm(raw, w.qtype, xq)
        if w.qtype == Q4_0:  # the products took the nibbles without their -8
            s = s - _xsum(xq).unsqueeze(-1) * 8.0  # exact: integers below 2**24
        return s
    wf = _unpack(raw, w.qtype)  # [n, nb, 32]
    return torch.bmm(xq.transpose(0, 1).to(torch.float32), wf.permute(1, 2, 0))  # [nb, T, n]: integers, exact


def scale_and_sum(isum: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """y[t, n] = sum_b isum[b, t, n] * (dx[t, b] * dw[n, b]) in block order b = 0, 1, ...:
    isum float32 [nb, T, N] (integers), dx float32 [T, nb], dw float32 [N, nb] (fp16 values)
    -> float32 [T, N].

    fused (the recipe): acc = fma(isum_b, s_b, acc) with s_b = dw_b * dx_b in float32, as the CPU
    kernels compute it.  s_b is exact (two 11-bit significands), and so is isum_b * s_b in float64
    (20 + 22 bits); torch has no elementwise fma, so acc + isum_b * s_b is added in float64 and
    rounded to float32 (``addcmul_`` of a float32 tensor with float64 operands does exactly that) -
    the fma's bits except when the float64 sum lands exactly on a float32 rounding midpoint (about
    2**-29 of the time).  Not fused: one float32 rounding per multiply and per add (what Triton's
    interpreter computes for ``tl.fma``)."""
    nb, T, N = isum.shape
    if not fused:
        p = isum * (dx.t().unsqueeze(-1) * dw.t().unsqueeze(1))
        acc = p[0] + 0.0  # 0 + p_0, as an accumulator starting at zero has it
        for b in range(1, nb):
            acc = acc + p[b]
        return acc
    dx64, dw64 = dx.to(torch.float64), dw.to(torch.float64)
    acc = torch.zeros((T, N), dtype=torch.float32, device=isum.device)
    if nb * T * N <= BULK_ELEMS:  # small (decode): fewest ops, one float64 temporary for all blocks
        s = dx64.t().unsqueeze(-1) * dw64.t().unsqueeze(1)  # [nb, T, N]
        for b in range(nb):
            acc.addcmul_(isum[b], s[b])
        return acc
    s = torch.empty((T, N), dtype=torch.float64, device=isum.device)  # large: a block at a time
    for b in range(nb):
        torch.mul(dx64[:, b:b + 1], dw64[:, b], out=s)
        acc.addcmul_(isum[b], s)
    return acc


def _check_exact_float32_matmul(device: torch.device) -> None:
    # the float32 bmm is exact only at full float32 precision (no TF32 / bf16 internal passes)
    if torch.get_float32_matmul_precision() != "highest" or (
            device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32):
        raise RuntimeError("torch_q4 needs float32 matmul precision 'highest' (TF32 off): its integer "
                           "block sums rely on exact float32 products")


def linear_q(w: DeviceWeight, a: Q8Act, fused: bool = True) -> torch.Tensor:
    """a (Q8_0 rows [T, n_in]) @ W.T -> float32 [T, n_out] for Q4_0 / Q8_0 weights, in torch ops
    (``fused``: see ``scale_and_sum``)."""
    if not w.quantized:
        raise ValueError(f"linear_q needs Q4_0 or Q8_0 weights, got type {w.qtype}")
    check_tensor("a.q", a.q, torch.int8, 3)
    T, nb = a.q.shape[0], a.q.shape[1]
    if nb * QK != w.n_in or a.d.shape != (T, nb):
        raise ValueError(f"activations [{T}, {nb * QK}] do not match weight [{w.n_out}, {w.n_in}]")
    out = torch.empty((T, w.n_out), dtype=torch.float32, device=w.data.device)
    if T == 0:
        return out
    _check_exact_float32_matmul(w.data.device)
    step = max(1, SLAB_ELEMS // (max(T, QK) * nb))  # rows of W per slab: bounds the [nb, T, rows] temporaries
    for n0 in range(0, w.n_out, step):
        rows = slice(n0, min(w.n_out, n0 + step))
        y = scale_and_sum(block_sums(w, a.q, rows), a.d, weight_scales(w.data[rows]), fused)
        if step >= w.n_out:
            return y
        out[:, rows] = y
    return out


def linear_float(w: DeviceWeight, x: torch.Tensor) -> torch.Tensor:
    """x float32 [T, n_in] @ W.T for F16 / F32 weights, as the CPU kernels compute it: each output
    one fma chain over k = 0, 1, ... in order (float64 products are exact, 24 x 24 bits; see
    ``scale_and_sum``).  n_in sequential ops: meant for the small models of tests, not for speed."""
    check_tensor("x", x, torch.float32, 2)
    if w.quantized or x.shape[1] != w.n_in:
        raise ValueError(f"linear_float needs F16/F32 weights [{w.n_out}, {x.shape[1]}], got type "
                         f"{w.qtype} [{w.n_out}, {w.n_in}]")
    x64, w64 = x.to(torch.float64), w.data.to(torch.float64)  # [T, n_in], [n_out, n_in]
    acc = torch.zeros((x.shape[0], w.n_out), dtype=torch.float32, device=x.device)
    for k in range(w.n_in):
        acc.addcmul_(x64[:, k:k + 1], w64[:, k])  # fma(x_k, w_k, acc)
    return acc


def embed_rows(w: DeviceWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 [T], on the device) of a weight matrix, dequantized exactly as
    gguf.quants.dequantize (value = d * q, exact in float32): float32 [T, n_in]."""
    check_tensor("ids", ids, torch.int64, 1)
    rows = w.data[ids]
    if not w.quantized:
        return rows.to(torch.float32)
    q = _unpack(rows, w.qtype)  # [T, nb, 32]
    return (q * weight_scales(rows).unsqueeze(-1)).reshape(ids.shape[0], w.n_in)
