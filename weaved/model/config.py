"""Model hyper-parameters read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RopeStyle(StrEnum):
    """How rotary embedding pairs dimensions (llama.cpp's rope types).

    NORM rotates adjacent pairs (x[2i], x[2i+1]) - llama, whose GGUF converter permutes Q/K rows so
    that this matches the original model.  NEOX rotates (x[i], x[i + d/2]) - qwen2, qwen3.
    """

    NORM = "norm"
    NEOX = "neox"


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3"
    name: str
    n_layers: int
    d_model: int  # embedding length
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int  # feed-forward length
    vocab_size: int
    context_length: int  # the model's trained context
    rms_eps: float
    rope_style: RopeStyle
    rope_base: float
    rope_scale: float = 1.0  # linear scaling: positions are multiplied by 1/rope_scale
    rope_dims: int = 0  # rotated dimensions per head (0 = all of head_dim)
    attn_bias: bool = False  # qwen2: q/k/v projections have biases
    qk_norm: bool = False  # qwen3: per-head RMSNorm on q and k before rope
    tied_output: bool = True  # output matrix is the token embedding

    @property
    def n_rot(self) -> int:
        return self.rope_dims or self.head_dim

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """float16 K and V rows of every layer for one position."""
        return self.n_layers * 2 * self.kv_dim * 2
