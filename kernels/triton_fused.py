"""Row-wise operations that follow one another in every layer, fused into one Triton launch each (the
torch backend's path on CUDA), with the bits of the unfused ones.

A decode step of a 1B model made ~390 launches, and on a GPU the host's ~20 µs a launch, not the
device, set the step's time.  These kernels cut a layer's launches without changing an operation:

* ``add_norm_quant``: the residual add, the next RMSNorm and the Q8_0 quantization of its output
  (what every projection after a norm reads) - ``x + y``, ``triton_rowwise.rmsnorm``,
  ``triton_rowwise.quantize_act``;
* ``glu_quant``: SwiGLU / GeGLU and the quantization of its output for the down projection;
* ``rope_qkv``: from the fused q|k|v projection to what attention reads - q and k normed (Qwen 3,
  Gemma 3) and rotated, k and v rounded to float16 into the step's new rows and into their slots in
  the paged pool (``_rmsnorm``, ``_rope``, two float16 copies and an indexed store).

Each calls the same ``@triton.jit`` helpers as the kernels it replaces (``rms_scale``, ``q8_blocks``,
``glu_cols``), and an intermediate kept in registers is the float32 value the unfused kernel would
have stored and loaded back: the results are those of the unfused kernels, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from weaved.kernels.torch_q4 import QK, Q8Act
from weaved.kernels.torch_rowwise import check_tensor
from weaved.kernels.triton_rowwise import FLAGS, f32, glu_cols, q8_blocks, rms_scale


@triton.jit
def _add_norm_quant(x_ptr, y_ptr, xo_ptr, w_ptr, h_ptr, q_ptr, d_ptr, D, eps, P: tl.constexpr, ADD: tl.constexpr):
    """Row r: x' = x + y (ADD), h = rmsnorm(x') * w, and h's Q8_0 blocks -> x' [R, D], h [R, D],
    quants int8 [R, D], scales [R, D/32]."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, P)
    m = i < D
    x = tl.load(x_ptr + r * D + i, mask=m, other=0.0)  # [P]
    if ADD:
        x = x + tl.load(y_ptr + r * D + i, mask=m, other=0.0)
        tl.store(xo_ptr + r * D + i, x, mask=m)
    h = (x * rms_scale(x, D, eps, P)) * tl.load(w_ptr + i, mask=m, other=0.0)  # 0 past D
    tl.store(h_ptr + r * D + i, h, mask=m)
    q, d = q8_blocks(tl.reshape(h, (P // 32, 32)))
    tl.store(q_ptr + r * D + i, tl.reshape(q, (P,)).to(tl.int8), mask=m)
    b = tl.arange(0, P // 32)
    tl.store(d_ptr + r * (D // 32) + b, d, mask=b < D // 32)


def add_norm_quant(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, Q8Act]:
    """x float32 [T, D] (+ y, when given), then RMSNorm by w float32 [D] and the Q8_0 quantization of
    the result, in one launch -> (x + y, h, h's Q8Act).  D must be a multiple of 32."""
    check_tensor("x", x, torch.float32, 2)
    check_tensor("w", w, torch.float32, 1)
    T, D = x.shape
    if D != w.shape[0] or D % QK:
        raise ValueError(f"rows of {D} with a weight of {w.shape[0]}: both must match, a multiple of {QK}")
    if y is not None and y.shape != x.shape:
        raise ValueError(f"the addend {tuple(y.shape)} does not match x {tuple(x.shape)}")
    xc = x.contiguous()
    xo = torch.empty_like(xc) if y is not None else xc
    h = torch.empty_like(xc)
    q = torch.empty((T, D // QK, QK), dtype=torch.int8, device=x.device)
    d = torch.empty((T, D // QK), dtype=torch.float32, device=x.device)
    if T:
        yc = y.contiguous() if y is not None else xc
        _add_norm_quant[(T,)](xc, yc, xo, w.contiguous(), h, q, d, D, f32(eps), P=triton.next_power_of_2(D),
                              ADD=y is not None, **FLAGS)
    return xo, h, Q8Act(q, d)


@triton.jit
def _glu_quant(gu_ptr, table_ptr, y_ptr, q_ptr, d_ptr, F, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """Row t of gate|up float32 [T, 2F], columns [b*BLOCK, (b+1)*BLOCK) of y = act(gate) * up [T, F],
    and y's Q8_0 blocks there (``triton_rowwise._glu`` then ``_quantize``)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < F
    y = glu_cols(gu_ptr, table_ptr, t, j, m, F, GELU)  # 0 past F
    tl.store(y_ptr + t * F + j, y, mask=m)
    q, d = q8_blocks(tl.reshape(y, (BLOCK // 32, 32)))
    tl.store(q_ptr + t * F + j, tl.reshape(q, (BLOCK,)).to(tl.int8), mask=m)
    b = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    tl.store(d_ptr + t * (F // 32) + b, d, mask=b < F // 32)


def glu_quant(gate_up: torch.Tensor, table: torch.Tensor | None) -> tuple[torch.Tensor, Q8Act]:
    """SwiGLU (``table`` None) or GeGLU by the CPU's float16 table, and the Q8_0 quantization of the
    result, in one launch: float32 [T, 2F] (gate | up) -> (y [T, F], y's Q8Act).  F must be a multiple
    of 32."""
    check_tensor("gate_up", gate_up, torch.float32, 2)
    T, F = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.shape[1] != 2 * F or F % QK:
        raise ValueError(f"gate_up must be [T, 2F] with F a multiple of {QK}, got {tuple(gate_up.shape)}")
    if table is not None:
        check_tensor("table", table, torch.float32, 1)
    y = torch.empty((T, F), dtype=torch.float32, device=gate_up.device)
    q = torch.empty((T, F // QK, QK), dtype=torch.int8, device=gate_up.device)
    d = torch.empty((T, F // QK), dtype=torch.float32, device=gate_up.device)
    if T and F:
        block = min(1024, triton.next_power_of_2(F))  # a multiple of 32: blocks never straddle programs
        _glu_quant[(T, triton.cdiv(F, block))](gate_up.contiguous(), table if table is not None else y, y, q, d,
                                               F, GELU=table is not None, BLOCK=block, **FLAGS)
    return y, Q8Act(q, d)


@triton.jit
def _rope_qkv(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_ptr, kv_ptr, pool_ptr, blk_ptr, off_ptr,
              T, H, HKV, D, HALF, PB, eps, NEOX: tl.constexpr, NORM: tl.constexpr, POOL: tl.constexpr,
              P: tl.constexpr, PD: tl.constexpr):
    """Token t, head h of qkv float32 [T, (H + 2 HKV) D] (q heads, k heads, v heads): a q head normed
    (NORM, by qn) and rotated -> q float32 [T, H, D]; a k head normed (by kn) and rotated, and a v
    head as it is -> float16 rows of kv [2, HKV, T, D] and (POOL) of the pool [n_blocks, 2, HKV, PB, D]
    at block blk[t], offset off[t].  ``triton_rowwise._rmsnorm``, ``_rope`` and the float16 copies."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    src = qkv_ptr + (t * (H + 2 * HKV) + h) * D
    i = tl.arange(0, P)
    m = i < HALF
    dd = tl.arange(0, PD)
    md = dd < D
    if h >= H + HKV:  # a v head: stored as it is
        hv = h - H - HKV
        v = tl.load(src + dd, mask=md, other=0.0).to(tl.float16)
        tl.store(kv_ptr + ((HKV + hv) * T + t) * D + dd, v, mask=md)
        if POOL:
            row = (tl.load(blk_ptr + t) * 2 + 1) * HKV * PB + hv * PB + tl.load(off_ptr + t)
            tl.store(pool_ptr + row * D + dd, v, mask=md)
    else:
        is_q = h < H
        scale = 1.0
        if NORM:
            scale = rms_scale(tl.load(src + dd, mask=md, other=0.0), D, eps, PD)
        c = tl.load(cos_ptr + t * HALF + i, mask=m, other=0.0)
        s = tl.load(sin_ptr + t * HALF + i, mask=m, other=0.0)
        if NEOX:
            i0, i1 = i, i + HALF
        else:
            i0, i1 = 2 * i, 2 * i + 1
        x0 = tl.load(src + i0, mask=m, other=0.0)
        x1 = tl.load(src + i1, mask=m, other=0.0)
        xr = tl.load(src + dd, mask=md & (dd >= 2 * HALF), other=0.0)  # dims past the rotated ones
        if NORM:  # rmsnorm's (x * scale) * w at each index
            if is_q:
                wn = qn_ptr
            else:
                wn = kn_ptr
            x0 = (x0 * scale) * tl.load(wn + i0, mask=m, other=0.0)
            x1 = (x1 * scale) * tl.load(wn + i1, mask=m, other=0.0)
            xr = (xr * scale) * tl.load(wn + dd, mask=md, other=0.0)
        y0 = x0 * c - x1 * s
        y1 = x0 * s + x1 * c
        if is_q:
            qrow = q_ptr + (t * H + h) * D
            tl.store(qrow + i0, y0, mask=m)
            tl.store(qrow + i1, y1, mask=m)
            tl.store(qrow + dd, xr, mask=md & (dd >= 2 * HALF))
        else:
            hk = h - H
            krow = kv_ptr + (hk * T + t) * D
            tl.store(krow + i0, y0.to(tl.float16), mask=m)
            tl.store(krow + i1, y1.to(tl.float16), mask=m)
            tl.store(krow + dd, xr.to(tl.float16), mask=md & (dd >= 2 * HALF))
            if POOL:
                row = tl.load(blk_ptr + t) * 2 * HKV * PB + hk * PB + tl.load(off_ptr + t)
                tl.store(pool_ptr + row * D + i0, y0.to(tl.float16), mask=m)
                tl.store(pool_ptr + row * D + i1, y1.to(tl.float16), mask=m)
                tl.store(pool_ptr + row * D + dd, xr.to(tl.float16), mask=md & (dd >= 2 * HALF))


def rope_qkv(qkv: torch.Tensor, heads: tuple[int, int, int], cos: torch.Tensor, sin: torch.Tensor, neox: bool,
             norms: tuple[torch.Tensor, torch.Tensor] | None, eps: float, kv_out: torch.Tensor,
             pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A layer's projections qkv float32 [T, (H + 2 Hkv) D] (``heads`` = (H, Hkv, D)) into what attention
    reads, in one launch: q and k normed by ``norms`` (q_norm, k_norm; or None) and rotated by cos/sin
    [T, n_rot/2]; k and v rounded to float16 into kv_out [2, Hkv, T, D] and, with ``pool`` = (the
    layer's pool [n_blocks, 2, Hkv, block, D], block int64 [T], offset int64 [T]), into the rows' slots.
    -> q float32 [T, H, D]."""
    H, Hkv, D = heads
    check_tensor("qkv", qkv, torch.float32, 2)
    T = qkv.shape[0]
    half = cos.shape[1]
    if qkv.shape[1] != (H + 2 * Hkv) * D or cos.shape != (T, half) or sin.shape != (T, half) or 2 * half > D:
        raise ValueError(f"qkv [{T}, {(H + 2 * Hkv) * D}] with cos/sin [{T}, <= {D // 2}] expected, got "
                         f"{tuple(qkv.shape)} and {tuple(cos.shape)}")
    check_tensor("kv_out", kv_out, torch.float16, 4)
    if kv_out.shape != (2, Hkv, T, D) or not kv_out.is_contiguous():
        raise ValueError(f"kv_out must be contiguous float16 [2, {Hkv}, {T}, {D}], got {tuple(kv_out.shape)}")
    q = torch.empty((T, H, D), dtype=torch.float32, device=qkv.device)
    if pool is not None:
        blocks, blk, off = pool
        check_tensor("pool", blocks, torch.float16, 5)
        if blocks.shape[1:] != (2, Hkv, blocks.shape[3], D) or blk.shape != (T,) or off.shape != (T,):
            raise ValueError(f"pool must be [n_blocks, 2, {Hkv}, block, {D}] with {T} slots")
    else:
        blocks, blk, off = kv_out, q, q  # not read
    qn, kn = norms if norms is not None else (q, q)
    if T and half:
        _rope_qkv[(T, H + 2 * Hkv)](qkv.contiguous(), cos.contiguous(), sin.contiguous(), qn, kn, q, kv_out, blocks,
                                    blk, off, T, H, Hkv, D, half, blocks.shape[3] if pool is not None else 1,
                                    f32(eps), NEOX=neox, NORM=norms is not None, POOL=pool is not None,
                                    P=triton.next_power_of_2(half), PD=triton.next_power_of_2(D), **FLAGS)
    elif T:
        raise ValueError("rope_qkv needs rotated dims (n_rot > 0)")
    return q
