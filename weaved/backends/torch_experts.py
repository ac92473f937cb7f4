"""A mixture of experts' FFN in the torch backend: the router (``kernels.torch_moe``) and each expert's
products over the tokens routed to it, as the CPU backend computes them (``kernels.moe``): the same
experts, each token's outputs scaled by its weights and added in slot order.

Each expert's gate and up rows are uploaded fused, in the file's encoding, like a dense FFN's; quantized
experts are stacked in one tensor per product, so on the Triton path every expert's rows of a step run
in one grouped launch (``kernels.triton_moe``) instead of a host sync and two launches per expert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from weaved.kernels.torch_products import Rowwise
from weaved.kernels.torch_q4 import BLOCK_BYTES, QK, DeviceWeight, Q8Act
from weaved.model.config import ModelConfig
from weaved.model.gguf_file import GGUFFile

Project = Callable[[tuple[DeviceWeight, ...], torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class DeviceExperts:
    router: torch.Tensor  # float32 [E, d]
    gate_up: tuple[DeviceWeight, ...]  # per expert: fused [2 * ff, d] (views of gate_up_stack)
    down: tuple[DeviceWeight, ...]  # per expert: [d, ff] (views of down_stack)
    # Q4_0 / Q8_0 experts: all of them in one tensor uint8 [E, n_out, nb, bytes], for the grouped kernels
    gate_up_stack: torch.Tensor | None = None
    down_stack: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return (self.router.numel() * 4 + sum(w.nbytes for w in self.gate_up) + sum(w.nbytes for w in self.down))


def _stack(raws: list[np.ndarray], qtype: int, n_out: int, n_in: int, device: torch.device
           ) -> tuple[tuple[DeviceWeight, ...], torch.Tensor | None]:
    """The experts' matrices as one device tensor and per-expert views of it (quantized types), or one
    upload each (float types)."""
    if qtype not in BLOCK_BYTES:
        return tuple(DeviceWeight.upload(r, qtype, n_out, n_in, device) for r in raws), None
    stack = torch.from_numpy(np.stack(raws)).to(device).reshape(len(raws), n_out, n_in // QK, BLOCK_BYTES[qtype])
    return tuple(DeviceWeight(qtype, n_out, n_in, stack[e]) for e in range(len(raws))), stack


def upload_experts(gguf: GGUFFile, cfg: ModelConfig, layer: int, device: torch.device) -> DeviceExperts:
    t, p = gguf.tensors, f"blk.{layer}."
    E, ff, d = cfg.n_experts, cfg.d_ff_expert, cfg.d_model
    router = torch.from_numpy(np.array(t[p + "ffn_gate_inp.weight"].raw, dtype=np.float32).reshape(E, d)).to(device)
    gate, up, down = (t[p + f"ffn_{m}_exps.weight"] for m in ("gate", "up", "down"))
    gu, gu_stack = _stack([np.concatenate([np.asarray(gate.raw[e]), np.asarray(up.raw[e])]) for e in range(E)],
                          gate.type_id, 2 * ff, d, device)
    dn, dn_stack = _stack([np.asarray(down.raw[e]) for e in range(E)], down.type_id, d, ff, device)
    return DeviceExperts(router, gu, dn, gu_stack, dn_stack)


def experts_ffn(h: torch.Tensor, ex: DeviceExperts, k: int, project: Project, ops: Rowwise) -> torch.Tensor:
    """h float32 [T, d] (the FFN norm's output) -> float32 [T, d]; ``ops``: the kernel path's row-wise
    operations, whose router and SwiGLU it takes (``torch_moe.route``'s and ``torch_rowwise``'s bits either
    way).  On the Triton path, with stacked quantized experts, every expert's rows run in one grouped
    launch per product (``kernels.triton_moe``), with the same bits."""
    T, d = h.shape
    ids, wts = ops.route(h, ex.router, k)
    flat, wflat = ids.reshape(-1), wts.reshape(-1)
    glu = ops.swiglu
    if ops.path == "triton" and ex.gate_up_stack is not None and ex.down_stack is not None:
        return _grouped_ffn(h, ex, k, flat, wflat, glu, ops.quantize_act)
    ys = torch.empty((T * k, d), dtype=torch.float32, device=h.device)
    for e in torch.unique(flat).tolist():
        rows = torch.nonzero(flat == e).squeeze(1)  # (token, slot) rows routed to expert e
        y = project((ex.down[e],), glu(project((ex.gate_up[e],), h[rows // k])))
        ys[rows] = y * wflat[rows].unsqueeze(-1)
    return _sum_slots(ys, T, k)


def _grouped_ffn(h: torch.Tensor, ex: DeviceExperts, k: int, flat: torch.Tensor, wflat: torch.Tensor,
                 glu: Callable[[torch.Tensor], torch.Tensor], quantize: Callable[[torch.Tensor], Q8Act]
                 ) -> torch.Tensor:
    from weaved.kernels import triton_moe

    T, d = h.shape
    order, tile_e, r0, r1, _ = triton_moe.plan(flat, ex.router.shape[0])
    gu = triton_moe.grouped_linear(ex.gate_up_stack, ex.gate_up[0].qtype, quantize(h), order // k, tile_e, r0, r1)
    g = glu(gu)  # [P, ff] in sorted pair order
    y = triton_moe.grouped_linear(ex.down_stack, ex.down[0].qtype, quantize(g),
                                  torch.arange(g.shape[0], device=h.device), tile_e, r0, r1)
    ys = torch.empty((T * k, d), dtype=torch.float32, device=h.device)
    ys[order] = y * wflat[order].unsqueeze(-1)
    return _sum_slots(ys, T, k)


def _sum_slots(ys: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """ys float32 [T * k, d], a token's slots in a row -> [T, d]: each token's slot outputs added in slot
    order, ``((y0 + y1) + y2) ...``, as the CPU kernel adds them."""
    ys = ys.reshape(T, k, -1)
    out = ys[:, 0]
    for i in range(1, k):
        out = out + ys[:, i]
    return out
