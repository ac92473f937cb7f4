"""Causal attention over the paged device KV as Triton kernels: every row of a step in one launch.

The arithmetic is ``torch_attention``'s - the CPU kernel's (``_attention_rows``) - for head sizes that
are multiples of 16 (every model served: 64, 128, 256):

* a row at position p reads keys lo..p (lo = 0, or p + 1 - window on a sliding-window layer) in
  chunks of ``CHUNK`` keys starting at lo, each chunk in blocks of ``BLOCK`` keys with an online
  softmax; a key past p has score -inf (p = 0: it changes no sum, max or fma);
* a score is ``scale * q.k``: lane l the fma chain over dims l, l + 16, ..., the 16 lanes added by the
  halving tree (lane i + lane i + 8, then + 4, + 2, + 1);
* per block: m_new = max(m, scores), alpha = exp(m - m_new), p = exp(s - m_new) (the CPU's ``exp``
  polynomial, ``triton_rowwise.exp_f32``), the block's sum of p in 16 lanes (lane i over keys i,
  i + 16, ... in order) then lane 0 + lane 1 + ... + lane 15, l = l * alpha + sum, acc = acc * alpha,
  then acc = fma(p_j, v_j, acc) over the block's keys in order;
* chunks are merged in order (``_merge``): m = the chunks' max, w = exp(m_c - m), total += l_c * w,
  out += w * acc_c, out / total.

One program is one (row, query head, chunk): its keys are walked in order - the fma chains and the
running sums are sequential by definition - with the head's D dims (or a block's keys) as the vector;
a block's K and V rows are loaded at once, and its p.V chain takes the V rows apart in key order.  A key's
K and V rows are found through the row's sequence's block table in the pool.  The chunks' partial
results go to a scratch buffer, merged by a second launch once every chunk's maximum is known.  Runs
with ``enable_fp_fusion=False`` and ``div_rn``: no operation is contracted or approximated, so on a GPU
the rows are the CPU backend's.  (Triton's interpreter computes ``tl.fma`` as a multiply and an add:
there the results are within a few ulps of the fused ones.)
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from weaved.kernels.torch_attention import BLOCK, CHUNK, LANES
from weaved.kernels.torch_q4 import QK, Q8Act
from weaved.kernels.torch_rowwise import check_tensor
from weaved.kernels.triton_rowwise import FLAGS, exp_f32, q8_blocks


@triton.jit
def _seq4(g):
    """The rows of g [16, 4] (lane, key group) added in order, ((g0 + 0.0) + g1) + g2) + g3 -> [16]:
    the groups taken apart by splits, not by sums."""
    x0, x1 = tl.split(tl.reshape(g, (16, 2, 2)))  # group 2a + b: b = 0 -> groups 0, 2; b = 1 -> 1, 3
    g0, g2 = tl.split(x0)
    g1, g3 = tl.split(x1)
    return (((g0 + 0.0) + g1) + g2) + g3


@triton.jit
def _seq16(v):
    """((v[0] + 0.0) + v[1]) + ... + v[15] for v [16]: the elements taken apart by splits."""
    e, o = tl.split(tl.reshape(v, (8, 2)))  # e[i] = v[2i], o[i] = v[2i + 1]
    ee, eo = tl.split(tl.reshape(e, (4, 2)))  # v[4i], v[4i + 2]
    oe, oo = tl.split(tl.reshape(o, (4, 2)))  # v[4i + 1], v[4i + 3]
    a0, a1 = tl.split(tl.reshape(ee, (2, 2)))  # v[8i], v[8i + 4]
    b0, b1 = tl.split(tl.reshape(oe, (2, 2)))  # v[8i + 1], v[8i + 5]
    c0, c1 = tl.split(tl.reshape(eo, (2, 2)))  # v[8i + 2], v[8i + 6]
    d0, d1 = tl.split(tl.reshape(oo, (2, 2)))  # v[8i + 3], v[8i + 7]
    v0, v8 = tl.split(a0)
    v4, v12 = tl.split(a1)
    v1, v9 = tl.split(b0)
    v5, v13 = tl.split(b1)
    v2, v10 = tl.split(c0)
    v6, v14 = tl.split(c1)
    v3, v11 = tl.split(d0)
    v7, v15 = tl.split(d1)
    t = ((((v0 + 0.0) + v1) + v2) + v3) + v4
    t = ((((t + v5) + v6) + v7) + v8) + v9
    return ((((((t + v10) + v11) + v12) + v13) + v14) + v15)


@triton.jit
def _key_halves(x, K: tl.constexpr, C: tl.constexpr):
    """x [K, C] -> (x[:K/2], x[K/2:]): a register split, no arithmetic."""
    return tl.split(tl.permute(tl.reshape(x, (2, K // 2, C)), (1, 2, 0)))


@triton.jit
def _fold_v(acc, p, v, K: tl.constexpr, D: tl.constexpr):
    """acc = fma(p[j], v[j], acc) for keys j = 0, 1, ..., K - 1 in order (acc [1, D], p [K, 1], v [K, D]):
    a block's V rows loaded at once, taken apart by splits, so the chain keeps the key order."""
    if K == 1:
        out = tl.fma(p, v, acc)
    else:
        p0, p1 = _key_halves(p, K, 1)
        v0, v1 = _key_halves(v, K, D)
        out = _fold_v(_fold_v(acc, p0, v0, K // 2, D), p1, v1, K // 2, D)
    return out


@triton.jit
def _chunks(q_ptr, pool_ptr, tab_ptr, seq_ptr, pos_ptr, lo_ptr, acc_ptr, ml_ptr, out_ptr, oq_ptr, od_ptr,
            H, G, HKV, PB, MAXB, NC, scale, D: tl.constexpr, CHUNK_: tl.constexpr, BLOCK_: tl.constexpr,
            LANES_: tl.constexpr, ONE: tl.constexpr, QUANT: tl.constexpr):
    """Program (t, h, c): chunk c of row t for query head h -> acc [T, H, NC, D], (m, l) [T, H, NC, 2].
    The chunks of a row are independent until ``_merge``: one program each, so a long row's chunks
    run side by side.  ONE (every row has one chunk): out [T, H, D] = acc / l at once - ``_merge``'s
    bits for one chunk, whose weight exp(m - m) is exactly 1 - and (QUANT) its Q8_0 (``_store_out``)."""
    tl.static_assert(BLOCK_ == 64 and LANES_ == 16, "_seq4 and _seq16 take a block of 4 x 16 keys apart")
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.program_id(2)
    hk = h // G
    p = tl.load(pos_ptr + t)  # the row's position: its last key
    lo = tl.load(lo_ptr + t)  # its first key
    if c > (p - lo) // CHUNK_:  # past this row's chunks (the grid is the longest row's)
        return
    seq = tl.load(seq_ptr + t).to(tl.int64)
    d = tl.arange(0, D)
    kk = tl.arange(0, BLOCK_)  # a block's keys
    ll = tl.arange(0, LANES_)
    q_row = q_ptr + (t * H + h) * D
    kv_stride = HKV * PB * D  # elements from a block's K to its V
    head_off = hk.to(tl.int64) * PB * D
    c0 = lo + c * CHUNK_
    c1 = tl.minimum(c0 + CHUNK_, p + 1)
    m = tl.full((), float("-inf"), tl.float32)
    l_ = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((1, D), dtype=tl.float32)
    for b0 in range(c0, c1, BLOCK_):
        key = b0 + kk  # [BLOCK]
        live = key <= p
        key_c = tl.where(live, key, b0)  # dead keys read a live one's rows (score -inf, weight 0)
        blk = tl.load(tab_ptr + seq * MAXB + key_c // PB).to(tl.int64)  # [BLOCK]
        row = blk * 2 * kv_stride + head_off + (key_c % PB).to(tl.int64) * D  # [BLOCK] K row starts
        v = tl.load(pool_ptr + row[:, None] + kv_stride + d[None, :]).to(tl.float32)  # [BLOCK, D] V rows
        # lanes [BLOCK, 16]: fma chains over dims l, l + 16, ...
        lanes = tl.load(q_row + ll)[None, :] * tl.load(pool_ptr + row[:, None] + ll[None, :]).to(tl.float32)
        for ci in tl.static_range(1, D // LANES_):
            kc = tl.load(pool_ptr + row[:, None] + ci * LANES_ + ll[None, :]).to(tl.float32)
            lanes = tl.fma(tl.load(q_row + ci * LANES_ + ll)[None, :], kc, lanes)
        for lvl in tl.static_range(4):  # the halving tree: lane i + lane i + half
            lanes = tl.sum(tl.reshape(lanes, (BLOCK_, 2, LANES_ >> (lvl + 1))), axis=1)
        s = tl.reshape(lanes, (BLOCK_,)) * scale
        s = tl.where(live, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = exp_f32(m - m_new)  # m_new is finite: the block's first key is live
        pr = exp_f32(s - m_new)  # [BLOCK], 0 where dead
        # lane l sums keys l, l + 16, ... in order, then lane 0 + lane 1 + ... + lane 15
        total = _seq16(_seq4(tl.trans(tl.reshape(pr, (BLOCK_ // LANES_, LANES_)))))
        l_ = l_ * alpha + total
        m = m_new
        # a dead key adds fma(0, v, acc) = acc: acc is never -0 (it starts at +0, and x + y = 0 rounds to +0)
        acc = _fold_v(acc * alpha, pr[:, None], v, BLOCK_, D)
    if ONE:
        _store_out(tl.reshape(tl.math.div_rn(acc, l_), (D,)), out_ptr, oq_ptr, od_ptr, t, h, H, D, QUANT)
    else:
        slot = (t * H + h) * NC + c
        tl.store(acc_ptr + slot * D + d[None, :], acc)
        tl.store(ml_ptr + slot * 2, m)
        tl.store(ml_ptr + slot * 2 + 1, l_)


@triton.jit
def _store_out(o, out_ptr, oq_ptr, od_ptr, t, h, H, D: tl.constexpr, QUANT: tl.constexpr):
    """Head h of row t's result o [D] into out [T, H, D], and with QUANT its Q8_0 blocks into the row's
    quants int8 [T, H * D] and scales [T, H * D / 32] - what the output projection reads (head h's D
    values are whole 32-blocks of the row: ``triton_rowwise.quantize_act``'s blocks)."""
    d = tl.arange(0, D)
    tl.store(out_ptr + (t * H + h) * D + d, o)
    if QUANT:
        q, sc = q8_blocks(tl.reshape(o, (D // 32, 32)))
        tl.store(oq_ptr + (t * H + h) * D + d, tl.reshape(q, (D,)).to(tl.int8))
        tl.store(od_ptr + (t * H + h) * (D // 32) + tl.arange(0, D // 32), sc)


@triton.jit
def _merge(acc_ptr, ml_ptr, pos_ptr, lo_ptr, out_ptr, oq_ptr, od_ptr, H, NC, D: tl.constexpr, CHUNK_: tl.constexpr,
           QUANT: tl.constexpr):
    """Program (t, h): row t's chunks merged in order -> out [T, H, D] (and its Q8_0: ``_store_out``)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    n_chunks = (tl.load(pos_ptr + t) - tl.load(lo_ptr + t)) // CHUNK_ + 1
    base = (t * H + h) * NC
    m = tl.load(ml_ptr + base * 2)
    for c in range(1, n_chunks):
        m = tl.maximum(m, tl.load(ml_ptr + (base + c) * 2))
    total = tl.full((), 0.0, tl.float32)
    out = tl.zeros((D,), dtype=tl.float32)
    for c in range(0, n_chunks):
        w = exp_f32(tl.load(ml_ptr + (base + c) * 2) - m)
        total = total + tl.load(ml_ptr + (base + c) * 2 + 1) * w
        out = out + w * tl.load(acc_ptr + (base + c) * D + d)
    _store_out(tl.math.div_rn(out, total), out_ptr, oq_ptr, od_ptr, t, h, H, D, QUANT)


def head_dim_supported(D: int) -> bool:
    """Head sizes the kernel takes: powers of two, multiples of the 16 lanes (every model served)."""
    return D >= LANES and D & (D - 1) == 0


def paged_attention(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, row_seq: torch.Tensor,
                    row_pos: torch.Tensor, row_lo: torch.Tensor, scale: float, n_chunks: int | None = None
                    ) -> torch.Tensor:
    """See ``_attend``: -> float32 [T, H, D]."""
    return _attend(q, pool, tables, row_seq, row_pos, row_lo, scale, n_chunks, False)[0]


def paged_attention_q8(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, row_seq: torch.Tensor,
                       row_pos: torch.Tensor, row_lo: torch.Tensor, scale: float, n_chunks: int | None = None
                       ) -> tuple[torch.Tensor, Q8Act]:
    """``paged_attention`` and the Q8_0 of its rows [T, H * D] (what the output projection reads, in
    ``quantize_act``'s bits), written by the same launches.  D must be a multiple of 32."""
    if q.shape[-1] % QK:
        raise ValueError(f"quantized attention output needs head_dim a multiple of {QK}, got {q.shape[-1]}")
    out, a = _attend(q, pool, tables, row_seq, row_pos, row_lo, scale, n_chunks, True)
    return out, a


def _attend(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor,
            row_lo: torch.Tensor, scale: float, n_chunks: int | None, quantize: bool
            ) -> tuple[torch.Tensor, Q8Act | None]:
    """Attention of every row of a step over its sequence's keys in the paged pool.

    q float32 [T, H, D]; pool float16 [n_blocks, 2, Hkv, PB, D] (one layer's; the rows' own keys
    already stored); tables int32 [S, max_blocks] (sequence s's block of positions [i*PB, (i+1)*PB));
    row_seq, row_pos, row_lo int32 [T]: each row's sequence, position and first key (0, or its window's
    first).  Head h reads kv head h // (H // Hkv).  -> float32 [T, H, D].

    ``n_chunks``: the most chunks of keys a row has, when the caller knows it (``torch_step`` does, from
    its own lists): the rows are then taken as valid, and nothing waits for the device.  Without it the
    rows are checked and the count found on the device - waits a step should not make per layer."""
    check_tensor("q", q, torch.float32, 3)
    check_tensor("pool", pool, torch.float16, 5)
    for name, x in (("tables", tables), ("row_seq", row_seq), ("row_pos", row_pos), ("row_lo", row_lo)):
        check_tensor(name, x, torch.int32)
    T, H, D = q.shape
    _, two, Hkv, PB, Dp = pool.shape
    if two != 2 or Dp != D or Hkv == 0 or H % Hkv:
        raise ValueError(f"pool must be [n_blocks, 2, n_kv_heads, block, {D}] with {H} heads a multiple of "
                         f"n_kv_heads, got {tuple(pool.shape)}")
    if not head_dim_supported(D):
        raise ValueError(f"head_dim must be a power of two and a multiple of {LANES}, got {D}")
    if tables.ndim != 2 or any(x.shape != (T,) for x in (row_seq, row_pos, row_lo)):
        raise ValueError("tables must be [sequences, max_blocks] and row_seq/row_pos/row_lo [T]")
    out = torch.empty((T, H, D), dtype=torch.float32, device=q.device)
    a = Q8Act(torch.empty((T, H * D // QK, QK), dtype=torch.int8, device=q.device),
              torch.empty((T, H * D // QK), dtype=torch.float32, device=q.device)) if quantize else None
    if T == 0:
        return out, a
    if n_chunks is None:
        pos, lo = row_pos.to(torch.int64), row_lo.to(torch.int64)
        if bool((lo < 0).any()) or bool((lo > pos).any()):
            raise ValueError("every row needs 0 <= first key <= its position")
        if int(pos.max()) // PB >= tables.shape[1]:
            raise ValueError(f"a row at position {int(pos.max())} is past its block table ({tables.shape[1]} blocks)")
        n_chunks = int(((pos - lo) // CHUNK).max()) + 1
    NC = n_chunks  # chunks of the longest row
    one = NC == 1  # then no scratch and no merge: each program writes its row's result
    acc = out if one else torch.empty((T, H, NC, D), dtype=torch.float32, device=q.device)
    ml = out if one else torch.empty((T, H, NC, 2), dtype=torch.float32, device=q.device)
    qc = q.contiguous()
    oq, od = (a.q, a.d) if a is not None else (out, out)  # not written without quantize
    _chunks[(T, H, NC)](qc, pool, tables.contiguous(), row_seq, row_pos, row_lo, acc, ml, out, oq, od,
                        H, H // Hkv, Hkv, PB, tables.shape[1], NC, float(np.float32(scale)), D=D, CHUNK_=CHUNK,
                        BLOCK_=BLOCK, LANES_=LANES, ONE=one, QUANT=quantize, num_warps=4 if D <= 64 else 8,
                        **FLAGS)
    if not one:
        _merge[(T, H)](acc, ml, row_pos, row_lo, out, oq, od, H, NC, D=D, CHUNK_=CHUNK, QUANT=quantize, **FLAGS)
    return out, a
