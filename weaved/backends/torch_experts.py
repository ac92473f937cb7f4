"""A mixture of experts' FFN in the torch backend: the router (``kernels.torch_moe``) and each expert's
products over the tokens routed to it, as the CPU backend computes them (``kernels.moe``): the same
experts, each token's outputs scaled by its weights and added in slot order.

Each expert's gate and up rows are uploaded fused, in the file's encoding, like a dense FFN's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from weaved.kernels.torch_moe import route
from weaved.kernels.torch_q4 import DeviceWeight
from weaved.kernels.torch_rowwise import swiglu
from weaved.model.config import ModelConfig
from weaved.model.gguf_file import GGUFFile

Project = Callable[[tuple[DeviceWeight, ...], torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class DeviceExperts:
    router: torch.Tensor  # float32 [E, d]
    gate_up: tuple[DeviceWeight, ...]  # per expert: fused [2 * ff, d]
    down: tuple[DeviceWeight, ...]  # per expert: [d, ff]

    @property
    def nbytes(self) -> int:
        return (self.router.numel() * 4 + sum(w.nbytes for w in self.gate_up) + sum(w.nbytes for w in self.down))


def upload_experts(gguf: GGUFFile, cfg: ModelConfig, layer: int, device: torch.device) -> DeviceExperts:
    t, p = gguf.tensors, f"blk.{layer}."
    E, ff, d = cfg.n_experts, cfg.d_ff_expert, cfg.d_model
    router = torch.from_numpy(np.array(t[p + "ffn_gate_inp.weight"].raw, dtype=np.float32).reshape(E, d)).to(device)
    gate, up, down = (t[p + f"ffn_{m}_exps.weight"] for m in ("gate", "up", "down"))
    gu = tuple(DeviceWeight.upload(np.concatenate([np.asarray(gate.raw[e]), np.asarray(up.raw[e])]), gate.type_id,
                                   2 * ff, d, device) for e in range(E))
    dn = tuple(DeviceWeight.upload(np.asarray(down.raw[e]), down.type_id, d, ff, device) for e in range(E))
    return DeviceExperts(router, gu, dn)


def experts_ffn(h: torch.Tensor, ex: DeviceExperts, k: int, project: Project,
                glu: Callable[[torch.Tensor], torch.Tensor] = swiglu) -> torch.Tensor:
    """h float32 [T, d] (the FFN norm's output) -> float32 [T, d]; ``glu``: the kernel path's SwiGLU."""
    T, d = h.shape
    ids, wts = route(h, ex.router, k)
    flat, wflat = ids.reshape(-1), wts.reshape(-1)
    ys = torch.empty((T * k, d), dtype=torch.float32, device=h.device)
    for e in torch.unique(flat).tolist():
        rows = torch.nonzero(flat == e).squeeze(1)  # (token, slot) rows routed to expert e
        y = project((ex.down[e],), glu(project((ex.gate_up[e],), h[rows // k])))
        ys[rows] = y * wflat[rows].unsqueeze(-1)
    ys = ys.reshape(T, k, d)
    out = ys[:, 0]
    for i in range(1, k):
        out = out + ys[:, i]
    return out
