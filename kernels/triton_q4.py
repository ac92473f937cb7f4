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

NARROW_OUTPUTS = 4096  # a matrix with at most this many outputs loads more blocks at a time (linear_q)


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
def exact_float(i):
    """float(i) for int32 |i| < 2**22, exactly, without the int-to-float converter: i added to the bits
    of 1.5 * 2**23 lands in that float's mantissa (its exponent unchanged), and subtracting 1.5 * 2**23
    leaves i (exact: both are floats a whole number apart below 2**24).  A multiprocessor converts 16
    ints a clock against 64 integer and 128 float adds, and a tile converts one integer sum per output
    per block - the most frequent operation of the chain.  A block's sum of 32 products is at most
    32 * 128 * 128 = 2**19 in magnitude."""
    return (i + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _halves(x, A: tl.constexpr, B: tl.constexpr, K: tl.constexpr):
    """x [A, B, K] -> (x[:, :, :K/2], x[:, :, K/2:]): a register split, no arithmetic."""
    return tl.split(tl.permute(tl.reshape(x, (A, B, 2, K // 2)), (0, 1, 3, 2)))


@triton.jit
def _fold(acc, s, f, A: tl.constexpr, B: tl.constexpr, K: tl.constexpr):
    """acc = fma(s[:, :, k], f[:, :, k], acc) for k = 0, 1, ..., K - 1 in order (s, f [A, B, K]): the
    blocks' terms taken apart by splits, so a chunk of blocks loaded at once keeps the block order."""
    if K == 1:
        out = tl.fma(tl.reshape(s, (A, B)), tl.reshape(f, (A, B)), acc)
    else:
        s0, s1 = _halves(s, A, B, K)
        f0, f1 = _halves(f, A, B, K)
        out = _fold(_fold(acc, s0, f0, A, B, K // 2), s1, f1, A, B, K // 2)
    return out


@triton.jit
def chunk_products(acc, x_rows, xd_rows, w_rows, mm, mn, c, QTYPE: tl.constexpr, BSZ: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, CVT: tl.constexpr = False):
    """acc [BM, BN] carried over blocks c*KB ... c*KB + KB - 1 of a tile: x_rows [BM] point at each
    activation row's int8 quants, xd_rows [BM] at its block scales, w_rows [BN] at each weight row's
    first raw block (rows where mm / mn are False read as zeros).  The KB blocks are loaded at once
    (one round trip to memory, not one a block); their integer dots come from one batched int8
    ``tl.dot`` (exact) and the float chain takes them in block order (``_fold``):
    acc = fma(float(isum_b), d_x * d_w, acc), one rounding, as the CPU's.  float(isum_b) by
    ``exact_float``, or by the hardware's converter with CVT (the same value: speed only)."""
    kk = tl.arange(0, 32)
    b = c * KB + tl.arange(0, KB)  # [KB] the chunk's blocks
    x = tl.load(x_rows[:, None, None] + b[None, :, None] * 32 + kk[None, None, :], mask=mm[:, None, None],
                other=0)  # [BM, KB, 32] int8
    dx = tl.load(xd_rows[:, None] + b[None, :], mask=mm[:, None], other=0.0)  # [BM, KB]
    wb = w_rows[:, None] + b[None, :] * BSZ  # [BN, KB] block starts
    lo = tl.load(wb, mask=mn[:, None], other=0).to(tl.uint16)
    hi = tl.load(wb + 1, mask=mn[:, None], other=0).to(tl.uint16)
    dw = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)  # [BN, KB]
    if QTYPE == 2:  # Q4_0: element k in byte k % 16, low nibble for k < 16, high after
        byte = tl.load(wb[:, :, None] + 2 + (kk[None, None, :] % 16), mask=mn[:, None, None], other=0)
        w = (((byte.to(tl.int32) >> ((kk[None, None, :] // 16) * 4)) & 15) - 8).to(tl.int8)  # [BN, KB, 32]
    else:  # Q8_0: 32 int8
        w = tl.load(wb[:, :, None] + 2 + kk[None, None, :], mask=mn[:, None, None], other=0).to(tl.int8,
                                                                                                 bitcast=True)
    isum = tl.dot(tl.permute(x, (1, 0, 2)), tl.permute(w, (1, 2, 0)), out_dtype=tl.int32)  # [KB, BM, BN] exact
    if CVT:
        s = tl.permute(isum, (1, 2, 0)).to(tl.float32)  # [BM, BN, KB]
    else:
        s = exact_float(tl.permute(isum, (1, 2, 0)))  # [BM, BN, KB] float32
    f = dx[:, None, :] * dw[None, :, :]  # [BM, BN, KB]: d_x * d_w
    return _fold(acc, s, f, BLOCK_M, BLOCK_N, KB)


@triton.jit
def _q_matmul(x_ptr, xd_ptr, w_ptr, y_ptr, M, N, NB: tl.constexpr, QTYPE: tl.constexpr, BSZ: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, CVT: tl.constexpr):
    """y [M, N] float32 = x (int8 [M, NB*32], scales xd float32 [M, NB]) @ W.T, W raw blocks
    uint8 [N, NB, BSZ]; all contiguous; KB blocks at a time (``chunk_products``).  NB is a
    compile-time constant (a model has two or three values): the loop bound is then known, and Triton
    3.6's interpreter cannot loop over a runtime scalar under numpy 2.4 (it converts a 1-element array
    with int())."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] activation rows
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows
    mm = rm < M
    mn = rn < N
    x_rows = x_ptr + rm.to(tl.int64) * (NB * 32)
    xd_rows = xd_ptr + rm.to(tl.int64) * NB
    w_rows = w_ptr + rn.to(tl.int64) * (NB * BSZ)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in range(0, NB // KB):
        acc = chunk_products(acc, x_rows, xd_rows, w_rows, mm, mn, c, QTYPE, BSZ, BLOCK_M, BLOCK_N, KB, CVT)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=mm[:, None] & mn[None, :])


def chunk_blocks(nb: int, most: int = 8) -> int:
    """Blocks loaded at a time: the largest power of two up to ``most`` that divides nb."""
    kb = 1
    while kb < most and nb % (2 * kb) == 0:
        kb *= 2
    return kb


def linear_q(w: DeviceWeight, a: Q8Act, block_n: int | None = None, chunk: int | None = None,
             block_m: int | None = None, warps: int | None = None, stages: int | None = None,
             converter: bool = False) -> torch.Tensor:
    """a (Q8_0 rows [T, n_in]) @ W.T -> float32 [T, n_out] for Q4_0 / Q8_0 weights (Triton).
    ``block_n`` (outputs a program), ``chunk`` (blocks loaded at a time, at most), ``block_m`` (rows a
    program: 16, 32, 64 or 128), ``warps`` (a program's warps) and ``stages`` (the loads the compiler
    keeps in flight ahead of the chain) and ``converter`` (the integer sums made floats by the hardware's
    converter rather than ``exact_float``) change the speed, never a bit of the result."""
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
    # Tile sizes never change a result.  Measured on an H100 (1B-shaped matrices, docs/benchmarks.md):
    # 32 outputs a program spread a matrix over every multiprocessor; up to 16 rows, 16 blocks loaded at a
    # time hide the memory's latency best (1.2-1.3x faster than 8 on the 2,048- and 8,192-wide matrices);
    # with 64-row tiles (tl.dot needs >= 16) the int32 sums of a chunk cost registers, and 4 blocks at a
    # time were fastest (2.2-2.4x the 64 x 64 tile with 8 blocks).  On an H200 at 64 rows, a matrix of
    # at most 4,096 outputs (64-128 programs for 132 multiprocessors) took 8 blocks at a time: 15-17 %
    # less time on the 1B shape's qkv, out and down; the wide ones stayed fastest with 4.
    block_m = block_m or (16 if T <= 16 else 64)
    if block_m not in (16, 32, 64, 128):
        raise ValueError(f"block_m must be 16, 32, 64 or 128 (tl.dot takes at least 16 rows), got {block_m}")
    block_n = block_n or 32
    chunk = chunk or (16 if T <= 16 else 8 if T <= 64 and w.n_out <= NARROW_OUTPUTS else 4)
    grid = (triton.cdiv(T, block_m), triton.cdiv(w.n_out, block_n))
    _q_matmul[grid](a.q.contiguous(), a.d.contiguous(), w.data, y, T, w.n_out, nb,
                    QTYPE=w.qtype, BSZ=BLOCK_BYTES[w.qtype], BLOCK_M=block_m, BLOCK_N=block_n,
                    KB=chunk_blocks(nb, chunk), CVT=converter, num_warps=warps or 4, enable_fp_fusion=False,
                    **({"num_stages": stages} if stages else {}))
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
        acc = tl.fma(exact_float(isum), dx * dw, acc)
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
