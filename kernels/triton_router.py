"""A mixture of experts' router as one Triton kernel (the torch backend's path on CUDA): every token's
experts and weights in one launch, with ``torch_moe.route``'s bits - itself the CPU kernel's recipe.

One program takes one token through the recipe, op for op (``enable_fp_fusion=False``):

* logits: 16 interleaved float32 lanes over the hidden size, a multiply and an add each (two
  roundings), then the lanes by the halving tree l + l+8, +4, +2, +1;
* softmax: ``exp_f32`` (the CPU kernels' polynomial) of the max-subtracted logits, summed in float64
  lane by lane over blocks of 16 experts and then the 16 lanes in order (E adds a token, as ggml's CPU
  sums); ``1 / sum`` in float64, rounded to float32, times each value;
* top k: k rounds of the largest probability, ties to the lowest expert (a stable descending sort's
  first k);
* the selected weights' sum in float64 in slot order, rounded to float32 and clamped below as ggml
  does, then each weight divided by it (``div_rn``).

A lane or block is taken out of a vector as a masked sum: every other term is +0.0 and the values are
never negative, so that sum is exactly the one value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from weaved.kernels.torch_moe import LANES, WEIGHT_SUM_MIN
from weaved.kernels.torch_rowwise import check_tensor
from weaved.kernels.triton_rowwise import FLAGS, exp_f32


@triton.jit
def _pick(v, at, i):
    """Element i of the non-negative vector v (``at``: its indices), exactly: a sum of it and zeros."""
    return tl.sum(tl.where(at == i, v, 0.0), axis=0)


@triton.jit
def _route(h_ptr, w_ptr, ids_ptr, wts_ptr, E, D, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
           NB: tl.constexpr, W_MIN: tl.constexpr):
    """Token t of h float32 [T, D] under the router w float32 [E, D] -> ids int64 [T, K], wts float32 [T, K]."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)  # [EP] experts, padded to a power of two >= 16
    em = e < E
    j = tl.arange(0, 16)  # [16] lanes
    lanes = tl.zeros((EP, 16), tl.float32)
    for b in range(0, D // 16):
        hb = tl.load(h_ptr + t * D + b * 16 + j)  # [16]
        wb = tl.load(w_ptr + e[:, None].to(tl.int64) * D + b * 16 + j[None, :], mask=em[:, None], other=0.0)
        lanes = lanes + hb[None, :] * wb  # [EP, 16]: no fma (enable_fp_fusion=False)
    z = tl.sum(tl.reshape(lanes, (EP, 2, 8)), axis=1)  # lane i + lane i+8: one add each
    z = tl.sum(tl.reshape(z, (EP, 2, 4)), axis=1)
    z = tl.sum(tl.reshape(z, (EP, 2, 2)), axis=1)
    z = tl.reshape(tl.sum(tl.reshape(z, (EP, 2, 1)), axis=1), (EP,))  # [EP] the logits
    z = tl.where(em, z, float("-inf"))
    y = exp_f32(z - tl.max(z, axis=0))  # [EP], 0 for the padding
    y2 = tl.reshape(y.to(tl.float64), (NB, 16))  # [NB, 16]: blocks of 16 experts
    blk = tl.arange(0, NB)
    acc = _pick(y2, blk[:, None], 0)  # [16] the lanes, block after block
    for b in tl.static_range(1, NB):
        acc = acc + _pick(y2, blk[:, None], b)
    s = _pick(acc, j, 0)
    for i in tl.static_range(1, 16):
        s = s + _pick(acc, j, i)
    inv = (1.0 / s).to(tl.float32)  # float64 division is IEEE on CUDA (div.rn.f64)
    p = tl.where(em, y * inv, -1.0)  # [EP]; the padding is never picked
    kk = tl.arange(0, KP)
    sel = tl.zeros((KP,), tl.float32)
    ids = tl.zeros((KP,), tl.int64)
    for i in tl.static_range(K):
        best = tl.argmax(p, axis=0, tie_break_left=True)
        sel = tl.where(kk == i, tl.max(p, axis=0), sel)
        ids = tl.where(kk == i, best.to(tl.int64), ids)
        p = tl.where(e == best, -1.0, p)
    tot = _pick(sel.to(tl.float64), kk, 0)
    for i in tl.static_range(1, K):
        tot = tot + _pick(sel.to(tl.float64), kk, i)
    total = tl.maximum(tot.to(tl.float32), W_MIN)
    km = kk < K
    tl.store(ids_ptr + t * K + kk, ids, mask=km)
    tl.store(wts_ptr + t * K + kk, tl.math.div_rn(sel, total), mask=km)


def route(h: torch.Tensor, w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts int64 [T, k], most probable first; weights float32 [T, k]) of h float32 [T, d] under the
    router w float32 [E, d]: ``torch_moe.route``'s result, bit for bit, in one launch."""
    check_tensor("h", h, torch.float32, 2)
    check_tensor("w", w, torch.float32, 2)
    if h.shape[1] != w.shape[1] or h.shape[1] % LANES or not 1 <= k <= w.shape[0]:
        raise ValueError(f"route: h [T, {h.shape[1]}] against a router {tuple(w.shape)} with k = {k}")
    T, d = h.shape
    E = w.shape[0]
    ids = torch.empty((T, k), dtype=torch.int64, device=h.device)
    wts = torch.empty((T, k), dtype=torch.float32, device=h.device)
    if T:
        ep = max(16, triton.next_power_of_2(E))
        _route[(T,)](h.contiguous(), w.contiguous(), ids, wts, E, d, K=k, KP=triton.next_power_of_2(k), EP=ep,
                     NB=ep // 16, W_MIN=WEIGHT_SUM_MIN, **FLAGS)
    return ids, wts
