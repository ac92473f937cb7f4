"""A mixture-of-experts layer's weights for the CPU backend: its router and its experts repacked into
the kernels' layout (``kernels.moe.ExpertWeights``).

Each expert's gate and up rows are fused into one matrix (one activation quantization per token for
both, as for a dense FFN) and packed on its own, so a step reads only the experts its tokens were routed
to.  The file's pages of a layer's experts are dropped from the resident set once the layer is packed:
a model larger than half the machine's memory is never resident twice, mapped and packed.
"""

from __future__ import annotations

import numpy as np

from weaved.kernels import matmul
from weaved.kernels.moe import ExpertWeights
from weaved.model.config import ModelConfig
from weaved.model.gguf_file import GGUFFile, release_view


def load_experts(gguf: GGUFFile, cfg: ModelConfig, layer: int) -> ExpertWeights:
    """Layer ``layer``'s router and packed experts."""
    t, p = gguf.tensors, f"blk.{layer}."
    E, ff, d = cfg.n_experts, cfg.d_ff_expert, cfg.d_model
    router_t = t[p + "ffn_gate_inp.weight"]
    router = np.ascontiguousarray(np.asarray(router_t.raw, dtype=np.float32).reshape(E, d))
    gate, up, down = (t[p + f"ffn_{m}_exps.weight"] for m in ("gate", "up", "down"))
    if gate.type_id != up.type_id:
        raise ValueError(f"{gguf.path.name}: {p}ffn_gate_exps and ffn_up_exps differ in type "
                         f"({gate.type_name}, {up.type_name}); the experts fuse them")
    gate_up = [matmul.pack_weight(matmul.concat_rows([gate.raw[e], up.raw[e]]), gate.type_id, 2 * ff, d)
               for e in range(E)]
    downs = [matmul.pack_weight(down.raw[e], down.type_id, d, ff) for e in range(E)]
    for x in (gate, up, down):
        release_view(x.raw)
    return ExpertWeights(router, gate_up, downs)
