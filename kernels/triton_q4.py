"""The Q4_0 / Q8_0 x Q8_0 product as a Triton kernel (the torch backend's on CUDA), and ``pair_dots``:
chosen elements of it (the logits' candidates, every row's in one launch).

The arithmetic of the CPU kernels and of ``torch_q4.linear_q``: one program computes a
[BLOCK_M, BLOCK_N] tile of y = x @ W.T by walking the K blocks in order b = 0, 1, ...; block b's
integer dot products come from one int8 ``tl.dot`` with an int32 result (exact), and the tile
accumulates ``acc = fma(float(isum), d_x * d_w, acc)`` in float32.  No split-K, and no other
contraction (``enable_fp_fusion=False``), so every output element sees the same sequence of IEEE
operations whatever the tile sizes, the grid or the other rows: batch invariant, and on a GPU the
CPU backend's bits.  (Triton's interpreter computes ``tl.fma`` as a multiply and an add: there the
results are ``torch_q4.linear_q(..., fused=False)``'s, within a few ulps of the fused ones.)

Weights are read straight from the GGUF blocks (uint8 [N, nb, 18 | 34]): the fp16 scale from the
first two bytes, element k of a Q4_0 block from byte k % 16 (low nibble for k < 16, high nibble
after), minus 8.  ``TRITON_INTERPRET=1`` (set before this module is imported) runs the kernel on
CPU tensors through Triton's interpreter, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from weaved.kernels.torch_q4 import BLOCK_BYTES, Q4_0, QK, DeviceWeight, Q8Act
from weaved.kernels.torch_rowwise import check_tensor


@triton.jit
def weight_blocks(wb, m, kk, QTYPE: tl.constexpr):
    """Block b of some weight rows, from the raw bytes at ``wb`` [n] (each row's block start; rows where
    ``m`` is False read as zeros): (the 32 quants int32 [n, 32], the fp16 scale as float32 [n])."""
    lo = tl.load(wb, mask=m, other=0).to(tl.uint16)
    hi = tl.load(wb + 1, mask=m, other=0).to(tl.uint16)
    dw = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    if QTYPE == 2:  # Q4_0: element k in byte k % 16, low nibble for k < 16, high after
        byte = tl.load(wb[:, None] + 2 + (kk[None, :] % 16), mask=m[:, None], other=0).to(tl.int32)
        w = ((byte >> ((kk[None, :] // 16) * 4)) & 15) - 8  # in -8..7
    else:  # Q8_0: 32 int8
        w = tl.load(wb[:, None] + 2 + kk[None, :], mask=m[:, None], other=0).to(tl.int8, bitcast=True).to(tl.int32)
    return w, dw


@triton.jit
def _q_matmul(x_ptr, xd_ptr, w_ptr, y_ptr, M, N, NB: tl.constexpr,
              QTYPE: tl.constexpr, BSZ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y [M, N] float32 = x (int8 [M, NB*32], scales xd float32 [M, NB]) @ W.T, W raw blocks
    uint8 [N, NB, BSZ]; all contiguous.  NB is a compile-time constant (a model has two or three
    values): the loop bound is then known, and Triton 3.6's interpreter cannot loop over a runtime
    scalar under numpy 2.4 (it converts a 1-element array with int())."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] activation rows
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows
    mm = rm < M
    mn = rn < N
    kk = tl.arange(0, 32)
    row_bytes = NB * BSZ
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, NB):
        x = tl.load(x_ptr + rm[:, None] * (NB * 32) + b * 32 + kk[None, :], mask=mm[:, None], other=0)  # [BM, 32]
        dx = tl.load(xd_ptr + rm * NB + b, mask=mm, other=0.0)  # [BM]
        w, dw = weight_blocks(w_ptr + rn.to(tl.int64) * row_bytes + b * BSZ, mn, kk, QTYPE)  # [BN, 32], [BN]
        isum = tl.dot(x, tl.trans(w.to(tl.int8)), out_dtype=tl.int32)  # [BM, BN] exact
        acc = tl.fma(isum.to(tl.float32), dx[:, None] * dw[None, :], acc)  # one rounding, as the CPU's
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=mm[:, None] & mn[None, :])


def linear_q(w: DeviceWeight, a: Q8Act) -> torch.Tensor:
    """a (Q8_0 rows [T, n_in]) @ W.T -> float32 [T, n_out] for Q4_0 / Q8_0 weights (Triton)."""
    if w.qtype not in BLOCK_BYTES:
        raise ValueError(f"triton linear_q needs Q4_0 or Q8_0 weights, got type {w.qtype}")
    check_tensor("a.q", a.q, torch.int8, 3)
    check_tensor("a.d", a.d, torch.float32, 2)
    T, nb = a.q.shape[0], a.q.shape[1]
    if nb * QK != w.n_in or a.d.shape != (T, nb):
        raise ValueError(f"activations [{T}, {nb * QK}] do not match weight [{w.n_out}, {w.n_in}]")
    if w.data.shape != (w.n_out, nb, BLOCK_BYTES[w.qtype]) or not w.data.is_contiguous():
        raise ValueError(f"weight data must be contiguous uint8 [{w.n_out}, {nb}, {BLOCK_BYTES[w.qtype]}]")
    y = torch.empty((T, w.n_out), dtype=torch.float32, device=w.data.device)
    if T == 0:
        return y
    block_m = 16 if T <= 16 else 64  # tl.dot needs >= 16; tile sizes never change a result
    block_n = 64
    grid = (triton.cdiv(T, block_m), triton.cdiv(w.n_out, block_n))
    _q_matmul[grid](a.q.contiguous(), a.d.contiguous(), w.data, y, T, w.n_out, nb,
                    QTYPE=w.qtype, BSZ=BLOCK_BYTES[w.qtype], BLOCK_M=block_m, BLOCK_N=block_n,
                    enable_fp_fusion=False)
    return y





@triton.jit
def _pair_dots(x_ptr, xd_ptr, w_ptr, t_ptr, n_ptr, y_ptr, P, NB: tl.constexpr, QTYPE: tl.constexpr,
               BSZ: tl.constexpr, BLOCK_P: tl.constexpr):
    """y[p] = row t[p] of x (int8 [T, NB*32], scales [T, NB]) . row n[p] of W (raw blocks [N, NB, BSZ]),
    for pairs p of a block of BLOCK_P: every element of ``_q_matmul``'s, by its arithmetic."""
    pp = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mp = pp < P
    t = tl.load(t_ptr + pp, mask=mp, other=0).to(tl.int64)
    n = tl.load(n_ptr + pp, mask=mp, other=0).to(tl.int64)
    kk = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for b in range(0, NB):
        x = tl.load(x_ptr + t[:, None] * (NB * 32) + b * 32 + kk[None, :], mask=mp[:, None], other=0).to(tl.int32)
        dx = tl.load(xd_ptr + t * NB + b, mask=mp, other=0.0)
        w, dw = weight_blocks(w_ptr + n * (NB * BSZ) + b * BSZ, mp, kk, QTYPE)
        isum = tl.sum(x * w, axis=1)  # exact: integers
        acc = tl.fma(isum.to(tl.float32), dx * dw, acc)
    tl.store(y_ptr + pp, acc, mask=mp)


def pair_dots(w: DeviceWeight, a: Q8Act, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float32 [P]: element (rows[p], cols[p]) of ``linear_q(w, a)``, the same bits, for P pairs in one
    launch (the logits' refinement: a row's candidates only).  rows, cols int64 [P]."""
    if w.qtype not in BLOCK_BYTES:
        raise ValueError(f"triton pair_dots needs Q4_0 or Q8_0 weights, got type {w.qtype}")
    check_tensor("a.q", a.q, torch.int8, 3)
    check_tensor("rows", rows, torch.int64, 1)
    check_tensor("cols", cols, torch.int64, 1)
    T, nb = a.q.shape[0], a.q.shape[1]
    if nb * QK != w.n_in or rows.shape != cols.shape:
        raise ValueError(f"activations [{T}, {nb * QK}] and weight [{w.n_out}, {w.n_in}], or pairs, do not match")
    P = rows.shape[0]
    y = torch.empty((P,), dtype=torch.float32, device=w.data.device)
    if P:
        block = 32
        _pair_dots[(triton.cdiv(P, block),)](a.q.contiguous(), a.d.contiguous(), w.data, rows.contiguous(),
                                             cols.contiguous(), y, P, nb, QTYPE=w.qtype, BSZ=BLOCK_BYTES[w.qtype],
                                             BLOCK_P=block, enable_fp_fusion=False)
    return y


__all__ = ["linear_q", "pair_dots", "Q4_0"]
