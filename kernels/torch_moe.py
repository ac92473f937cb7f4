"""A mixture of experts' router in torch: ``moe.route``'s recipe op for op, so the torch backend picks
the CPU backend's experts with its weights' bits.

Logits are float32 dot products in 16 interleaved lanes then a fixed tree (the CPU kernel's ``_logit``);
the softmax takes ``exp_f32`` of the max-subtracted logits and sums them in float64 in
16 interleaved lanes, then the lanes in order (``elementwise``'s softmax row); the top k go by a stable
descending sort (equal probabilities: the lower index first); their sum, in float64 in slot order, is
rounded to float32 and clamped below as ggml does before the division.
"""

from __future__ import annotations

import torch

from .torch_rowwise import check_tensor, exp_f32, tree_sum

WEIGHT_SUM_MIN = 6.103515625e-5  # float32-exact: ggml's clamp of the selected weights' sum
LANES = 16


def router_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h float32 [T, d], w float32 [E, d] (d a multiple of 16) -> float32 [T, E], as ``moe._logit``: 16
    interleaved float32 lanes, block after block (a multiply and an add, two roundings), then the lanes
    by the tree l + l+8, +4, +2, +1."""
    T, d = h.shape
    hb = h.reshape(T, 1, d // LANES, LANES)
    wb = w.reshape(1, w.shape[0], d // LANES, LANES)
    lanes = torch.zeros((T, w.shape[0], LANES), dtype=torch.float32, device=h.device)
    for b in range(d // LANES):
        lanes = lanes + hb[:, :, b] * wb[:, :, b]
    return tree_sum(lanes, -1)


def softmax_lanes(z: torch.Tensor) -> torch.Tensor:
    """The softmax of each row of z float32 [T, E], in the CPU kernel's order."""
    T, E = z.shape
    y = exp_f32(z - z.max(dim=-1, keepdim=True).values)
    y64 = torch.nn.functional.pad(y.to(torch.float64), (0, (-E) % LANES))  # + 0.0 changes no lane
    blocks = y64.reshape(T, -1, LANES)
    lanes = blocks[:, 0]
    for b in range(1, blocks.shape[1]):
        lanes = lanes + blocks[:, b]
    s = lanes[:, 0]
    for i in range(1, LANES):
        s = s + lanes[:, i]
    inv = torch.div(torch.ones_like(s), s).to(torch.float32)  # 1 / s in float64, then rounded
    return y * inv.unsqueeze(-1)


def route(h: torch.Tensor, w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts int64 [T, k], most probable first; weights float32 [T, k]) of h float32 [T, d] under the
    router w float32 [E, d]."""
    check_tensor("h", h, torch.float32, 2)
    check_tensor("w", w, torch.float32, 2)
    if h.shape[1] != w.shape[1] or h.shape[1] % LANES or not 1 <= k <= w.shape[0]:
        raise ValueError(f"route: h [T, {h.shape[1]}] against a router {tuple(w.shape)} with k = {k}")
    p = softmax_lanes(router_logits(h, w))
    ids = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :k]
    sel = p.gather(1, ids)
    s = sel[:, 0].to(torch.float64)
    for i in range(1, k):
        s = s + sel[:, i].to(torch.float64)
    total = torch.clamp(s.to(torch.float32), min=WEIGHT_SUM_MIN)
    return ids, torch.div(sel, total.unsqueeze(-1))
