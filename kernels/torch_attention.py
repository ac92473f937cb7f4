"""Causal attention of one sequence over its float16 KV in torch ops: the CPU kernel's arithmetic.

The torch backend must give the CPU backend's numbers, not just close ones: two implementations
that differ by an ulp here and there drift apart through the Q8_0 quantizations of later layers
(an ulp moves a value across a rounding boundary now and then, and every such flip perturbs all
that follows) until their distributions are as far apart as either is from the float64 truth.  So
this is ``_attention_rows`` re-expressed in tensor ops, operation for operation:

* a query row at position p reads keys 0..p in chunks of ``CHUNK`` keys at fixed offsets, each
  chunk in blocks of ``BLOCK`` keys with an online softmax;
* a score is ``scale * q.k``: 16 lanes, lane l the fma chain over dims l, l + 16, ..., then the 16
  lanes added by a halving tree (``tree_sum``);
* per block: the running max, alpha = exp(m_old - m_new), p = exp(s - m_new) (``exp_f32``), the
  block's sum of p in 16 lanes (lane i over keys i, i + 16, ...) then lane 0 + lane 1 + ..., the
  running sum l * alpha + sum, the output rescaled by alpha and then acc = fma(p_r, v_r, acc) over
  the block's keys in order;
* chunks are merged in order: w = exp(m_c - m), total += l_c * w, out += w * acc_c, out / total.

torch has no elementwise fma; fma(a, b, c) is computed as float64 a * b (exact: 24 x 11 bits)
added to c in float64 and rounded once to float32 (``acc.add_(float64)``) - the fma's bits except
when the float64 sum falls exactly on a float32 rounding midpoint (about 2**-29 of the time).
head_dim not a multiple of 16 takes the CPU kernel's plain path: separate multiplies and adds.

Rows are processed together, each over the same chunks and blocks: a key past a row's position
gets score -inf, so p = 0 and every sum, max and fma it enters is unchanged - the row's result is
the one it gets alone (batch invariance, and n tokens in one chunk = n single steps).  The
log-sum-exp (for Q-Ring merges) takes its log in float64.
"""

from __future__ import annotations

import math

import torch
from weaved.kernels.torch_rowwise import check_tensor, exp_f32, tree_sum

CHUNK = 512  # keys per chunk: the CPU kernel's _attention_chunk.CHUNK
BLOCK = 64  # keys per online-softmax block: _attention_chunk.BLOCK
LANES = 16
GROUP_ELEMS = 1 << 21  # bound on a row group's [heads, rows, BLOCK, head_dim] temporaries
PRODUCTS_ELEMS = 1 << 16  # up to this many, a block's p * v products are formed at once


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q float32 [n, H, D], row i at position pos0 + i; k, v float16 [Hkv, L, D] with L >= pos0 + n
    (keys 0..L-1 of the sequence, the rows' own already stored).  Head h reads kv head
    h // (H // Hkv).  Returns out float32 [n, H, D] and lse float32 [n, H] (log of the sum of
    exp(score), score = scale * q.k)."""
    check_tensor("q", q, torch.float32, 3)
    check_tensor("k", k, torch.float16, 3)
    check_tensor("v", v, torch.float16, 3)
    n, H, D = q.shape
    Hkv = k.shape[0]
    if k.shape != v.shape or k.shape[2] != D or Hkv == 0 or H % Hkv:
        raise ValueError(f"k, v must be float16 [n_kv_heads, L, {D}] with n_heads {H} a multiple of "
                         f"n_kv_heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    if pos0 < 0 or pos0 + n > k.shape[1]:
        raise ValueError(f"rows at positions {pos0}..{pos0 + n - 1} need keys up to {pos0 + n}, have {k.shape[1]}")
    G = H // Hkv
    qg = q.reshape(n, Hkv, G, D).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    out = torch.empty((Hkv, G, n, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((Hkv, G, n), dtype=torch.float32, device=q.device)
    rows = max(1, GROUP_ELEMS // (H * BLOCK * D))  # grouping rows cannot change a row's result
    for i in range(0, n, rows):
        j = min(n, i + rows)
        out[:, :, i:j], lse[:, :, i:j] = _rows(qg[:, :, i:j], k, v, pos0 + i, scale)
    return out.permute(2, 0, 1, 3).reshape(n, H, D), lse.permute(2, 0, 1).reshape(n, H)


def _rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p0: int, scale: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows q float32 [Hkv, G, r, D] at positions p0..p0+r-1: every chunk, then the merge."""
    r = q.shape[2]
    parts = []  # (first row that sees the chunk, m, l, acc) per chunk
    for c0 in range(0, p0 + r, CHUNK):
        r0 = max(0, c0 - p0)  # rows before it end before the chunk starts
        parts.append((r0, *_chunk(q[:, :, r0:], k, v, p0 + r0, c0, min(c0 + CHUNK, p0 + r), scale)))
    m = parts[0][1].clone()  # [Hkv, G, r]: the max over chunks
    for r0, mc, _, _ in parts[1:]:
        m[:, :, r0:] = torch.maximum(m[:, :, r0:], mc)
    total = torch.zeros_like(m)
    out = torch.zeros_like(q)
    for r0, mc, lc, acc in parts:
        w = exp_f32(mc - m[:, :, r0:])
        total[:, :, r0:] = total[:, :, r0:] + lc * w
        out[:, :, r0:] = out[:, :, r0:] + w.unsqueeze(-1) * acc
    out = out / total.unsqueeze(-1)
    lse = m + torch.log(total.to(torch.float64)).to(torch.float32)
    return out, lse


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p0: int, j0: int, j1: int, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online softmax of rows q [Hkv, G, r, D] (positions p0..) over keys j0..j1-1: the running max
    m and sum l [Hkv, G, r] and the unnormalised output acc [Hkv, G, r, D]."""
    Hkv, G, r, D = q.shape
    fused = D % LANES == 0
    dev = q.device
    m = torch.full((Hkv, G, r), -math.inf, dtype=torch.float32, device=dev)
    l_ = torch.zeros((Hkv, G, r), dtype=torch.float32, device=dev)
    acc = torch.zeros((Hkv, G, r, D), dtype=torch.float32, device=dev)
    pos = torch.arange(p0, p0 + r, device=dev)  # [r]
    q64 = q.to(torch.float64) if fused else q
    for b0 in range(j0, j1, BLOCK):
        nb = min(BLOCK, j1 - b0)
        s = _scores(q64, k[:, b0:b0 + nb], fused) * scale  # [Hkv, G, r, nb]
        visible = torch.arange(b0, b0 + nb, device=dev)[None, :] <= pos[:, None]  # [r, nb]
        s = torch.where(visible, s, torch.full_like(s, -math.inf))
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_sub = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)  # no key yet: no NaN
        alpha = exp_f32(m - m_sub)  # 0 on a row's first block
        p = exp_f32(s - m_sub.unsqueeze(-1))  # [Hkv, G, r, nb]; 0 where masked
        l_ = l_ * alpha + _lane_sum(p)
        m = m_new
        acc = acc * alpha.unsqueeze(-1)  # the CPU skips this when alpha == 1: x * 1 == x
        _accumulate(acc, p, v[:, b0:b0 + nb], fused)
    return m, l_, acc


def _scores(q: torch.Tensor, k: torch.Tensor, fused: bool) -> torch.Tensor:
    """Dot products of rows q [Hkv, G, r, D] (float64 if fused) with keys k float16 [Hkv, nb, D]:
    float32 [Hkv, G, r, nb], in the CPU kernel's order."""
    Hkv, G, r, D = q.shape
    nb = k.shape[1]
    if fused:  # scores8: 16 lanes of fma chains over dims l, l + 16, ..., then a halving tree
        qc = q.reshape(Hkv, G, r, 1, D // LANES, LANES)
        kc = k.to(torch.float64).reshape(Hkv, 1, 1, nb, D // LANES, LANES)
        lanes = (qc[..., 0, :] * kc[..., 0, :]).to(torch.float32)  # fma(q, k, 0) [Hkv, G, r, nb, 16]
        for c in range(1, D // LANES):
            lanes.add_(qc[..., c, :] * kc[..., c, :])  # fma(q, k, lane): exact product, one rounding
        return tree_sum(lanes, -1)
    prods = q.unsqueeze(3) * k.to(torch.float32).reshape(Hkv, 1, 1, nb, D)  # [Hkv, G, r, nb, D]
    dot = prods[..., 0] + 0.0  # plain path: dot = 0; dot += q_d * k_d in order
    for d in range(1, D):
        dot = dot + prods[..., d]
    return dot


def _lane_sum(p: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a block's nb <= 64 keys) as the CPU kernel adds it: lane i sums keys
    i, i + 16, ... in order, then lane 0 + lane 1 + ... + lane 15."""
    nb = p.shape[-1]
    pad = -nb % LANES
    if pad:  # a lane without a key adds nothing: x + 0 == x for the sums of exps (>= +0)
        p = torch.cat([p, p.new_zeros((*p.shape[:-1], pad))], dim=-1)
    g = p.unflatten(-1, (-1, LANES))  # [..., nb/16, 16]
    lanes = g[..., 0, :] + 0.0
    for j in range(1, g.shape[-2]):
        lanes = lanes + g[..., j, :]
    total = lanes[..., 0] + 0.0
    for i in range(1, LANES):
        total = total + lanes[..., i]
    return total


def _accumulate(acc: torch.Tensor, p: torch.Tensor, v: torch.Tensor, fused: bool) -> None:
    """acc [Hkv, G, r, D] += p[..., j] * v[:, j] for the block's keys j in order, in place:
    fma (float64 product, one rounding) when fused, else a float32 multiply and add."""
    nb = v.shape[1]
    dt = torch.float64 if fused else torch.float32
    pw, vw = p.to(dt), v.to(dt)
    if p.numel() * v.shape[2] <= PRODUCTS_ELEMS:  # small (decode): every product at once, one op a key
        prods = pw.unsqueeze(-1) * vw[:, None, None]  # [Hkv, G, r, nb, D]
        for j in range(nb):
            acc.add_(prods[..., j, :])
    else:
        for j in range(nb):
            acc.add_(pw[..., j, None] * vw[:, None, None, j])  # [Hkv, G, r, D]
