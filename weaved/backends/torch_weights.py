"""The torch backend's model weights on its device, uploaded once from the GGUF as stored.

Layer matrices keep their file encoding (Q4_0 blocks, or whatever type the file has); q|k|v and
gate|up are fused into one matrix each by stacking their raw rows (same bytes, one product and one
activation quantization instead of three), as the CPU backend does, unless their types differ.
Norms and biases are float32.  A tied output matrix is the embedding tensor itself (one copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from weaved.backends.torch_experts import DeviceExperts, upload_experts
from weaved.kernels.torch_q4 import DeviceWeight
from weaved.model.config import ModelConfig
from weaved.model.gguf_file import GGUFFile


@dataclass(frozen=True, eq=False)
class LayerWeights:
    attn_norm: torch.Tensor  # [d_model] f32
    wqkv: tuple[DeviceWeight, ...]  # fused [q_dim + 2*kv_dim, d_model], or q, k, v (mixed types)
    bqkv: torch.Tensor | None  # [q_dim + 2*kv_dim] f32 (qwen2)
    q_norm: torch.Tensor | None  # [head_dim] f32 (qwen3)
    k_norm: torch.Tensor | None
    wo: DeviceWeight  # [d_model, q_dim]
    ffn_norm: torch.Tensor  # [d_model] f32
    wgu: tuple[DeviceWeight, ...]  # fused [2*d_ff, d_model], or gate, up (empty: a mixture of experts)
    wdown: DeviceWeight | None  # [d_model, d_ff]
    post_attn_norm: torch.Tensor | None = None  # [d_model] f32 (gemma3)
    post_ffn_norm: torch.Tensor | None = None
    experts: DeviceExperts | None = None  # a mixture of experts' router and experts (qwen3moe)


@dataclass(frozen=True, eq=False)
class ModelWeights:
    layers: tuple[LayerWeights, ...]
    embedding: DeviceWeight  # [vocab, d_model]
    output: DeviceWeight  # [vocab, d_model]; the embedding itself when tied
    output_norm: torch.Tensor  # [d_model] f32

    @property
    def nbytes(self) -> int:
        """Device bytes of every weight (what the upload copied)."""
        mats = {id(w): w for L in self.layers for w in (*L.wqkv, L.wo, *L.wgu, L.wdown) if w is not None}
        mats[id(self.embedding)] = self.embedding
        mats[id(self.output)] = self.output
        vecs = [self.output_norm] + [v for L in self.layers for v in (L.attn_norm, L.ffn_norm, L.bqkv, L.q_norm,
                                                                       L.k_norm, L.post_attn_norm, L.post_ffn_norm)
                                     if v is not None]
        experts = sum(L.experts.nbytes for L in self.layers if L.experts is not None)
        return sum(w.nbytes for w in mats.values()) + sum(v.numel() * v.element_size() for v in vecs) + experts


def upload_model(gguf: GGUFFile, cfg: ModelConfig, device: torch.device) -> ModelWeights:
    """Copy every tensor the forward pass needs to ``device``."""
    t = gguf.tensors

    def vec(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(t[name].raw, dtype=np.float32).reshape(-1)).to(device)

    def matrix(names: list[str]) -> tuple[DeviceWeight, ...]:
        parts = [t[n] for n in names]
        if len({p.type_id for p in parts}) > 1:  # mixed types: one product each
            return tuple(matrix([n])[0] for n in names)
        raw = np.concatenate([np.asarray(p.raw) for p in parts]) if len(parts) > 1 else np.asarray(parts[0].raw)
        n_out = sum(p.shape[0] for p in parts)
        return (DeviceWeight.upload(raw, parts[0].type_id, n_out, parts[0].shape[1], device),)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=vec(p + "attn_norm.weight"),
            wqkv=matrix([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
            bqkv=torch.cat([vec(p + f"attn_{x}.bias") for x in "qkv"]) if cfg.attn_bias else None,
            q_norm=vec(p + "attn_q_norm.weight") if cfg.qk_norm else None,
            k_norm=vec(p + "attn_k_norm.weight") if cfg.qk_norm else None,
            wo=matrix([p + "attn_output.weight"])[0],
            ffn_norm=vec(p + "ffn_norm.weight"),
            wgu=() if cfg.moe else matrix([p + "ffn_gate.weight", p + "ffn_up.weight"]),
            wdown=None if cfg.moe else matrix([p + "ffn_down.weight"])[0],
            post_attn_norm=vec(p + "post_attention_norm.weight") if cfg.post_norms else None,
            post_ffn_norm=vec(p + "post_ffw_norm.weight") if cfg.post_norms else None,
            experts=upload_experts(gguf, cfg, i, device) if cfg.moe else None,
        ))
    embedding = matrix(["token_embd.weight"])[0]
    output = embedding if cfg.tied_output else matrix(["output.weight"])[0]
    return ModelWeights(tuple(layers), embedding, output, vec("output_norm.weight"))
