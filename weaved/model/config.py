"""Model hyper-parameters read from GGUF metadata."""

from __future__ import annotations

import math
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
class RopeSpec:
    """How one kind of layer rotates q and k: llama.cpp's ``rope_ext`` parameters.

    The angle of pair i at position p is built as ggml builds it: ``theta = p * theta_scale**i`` (a
    running float32 product, ``theta_scale = base**(-2 / n_rot)``), divided by ``freq_factors[i]``
    (Llama 3's ``rope_freqs``), times ``freq_scale``; with YaRN (``ext_factor`` > 0) the interpolated
    and extrapolated angles are mixed by a ramp over the pairs between the correction dimensions of
    ``beta_fast`` and ``beta_slow`` at ``orig_ctx``, and cos/sin are scaled by ``attn_factor *
    (1 + 0.1 ln(1 / freq_scale))``.  Without YaRN they are scaled by ``attn_factor`` alone.
    """

    base: float = 10000.0
    freq_scale: float = 1.0  # 1 / the linear (or YaRN) scaling factor
    freq_factors: tuple[float, ...] | None = None  # float32 values, one per rotated pair
    ext_factor: float = 0.0  # YaRN: 1.0; 0: no extrapolation mix
    attn_factor: float = 1.0
    orig_ctx: int = 0  # YaRN: the context the model was trained at before scaling
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if not (self.base > 0 and self.freq_scale > 0 and self.attn_factor > 0):
            raise ValueError(f"rope base ({self.base}), frequency scale ({self.freq_scale}) and attention factor "
                             f"({self.attn_factor}) must be positive")
        if self.ext_factor and self.orig_ctx < 1:
            raise ValueError("YaRN rope needs the original context length")
        if self.freq_factors is not None and not all(f > 0 for f in self.freq_factors):
            raise ValueError("rope frequency factors must be positive")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3" | "qwen3moe" | "gemma3"
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
    rope: RopeSpec = RopeSpec()  # every layer's, or the global layers' when some use a sliding window
    rope_dims: int = 0  # rotated dimensions per head (0 = all of head_dim)
    attn_bias: bool = False  # qwen2: q/k/v projections have biases
    qk_norm: bool = False  # qwen3, gemma3: per-head RMSNorm on q and k before rope
    tied_output: bool = True  # output matrix is the token embedding
    # gemma3: sliding-window layers (window > 0) with their own rope; a layer is windowed when
    # swa_pattern > 0 and layer % swa_pattern < swa_pattern - 1 (llama.cpp's pattern)
    window: int = 0
    swa_pattern: int = 0
    rope_swa: RopeSpec | None = None
    embed_scale: float = 1.0  # gemma3: token embeddings times sqrt(d_model) (a float32 factor)
    attn_scale: float = 0.0  # the scores' scale; 0: 1 / sqrt(head_dim)
    post_norms: bool = False  # gemma3: RMSNorm of the attention and FFN outputs before each residual
    act: str = "silu"  # the gated FFN's activation: "silu" (SwiGLU) or "gelu" (GeGLU, tanh form)
    # mixture of experts (qwen3moe; llama files with experts, Mixtral-style): every layer's FFN is
    # n_experts SwiGLU experts of d_ff_expert, of which a router picks n_experts_used per token
    n_experts: int = 0  # 0: a dense FFN of d_ff
    n_experts_used: int = 0
    d_ff_expert: int = 0

    def __post_init__(self) -> None:
        for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "context_length"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1, got {getattr(self, key)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} attention heads do not share {self.n_kv_heads} key/value heads evenly")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ValueError(f"{self.n_rot} rotated dimensions of a {self.head_dim}-dimensional head: rope "
                             f"rotates pairs within the head")
        if not (self.d_ff > 0 or self.n_experts):
            raise ValueError(f"feed-forward length must be at least 1, got {self.d_ff}")
        if not self.rms_eps > 0:
            raise ValueError(f"the RMSNorm epsilon must be positive, got {self.rms_eps}")
        if self.n_experts and not (0 < self.n_experts_used <= self.n_experts and self.d_ff_expert > 0):
            raise ValueError(f"a mixture of experts needs 0 < experts used ({self.n_experts_used}) <= experts "
                             f"({self.n_experts}) and an expert feed-forward length, got {self.d_ff_expert}")

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

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

    @property
    def scores_scale(self) -> float:
        """What the attention multiplies q.k by."""
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def layer_window(self, layer: int) -> int:
        """Keys a query of ``layer`` attends: the last ``window`` positions (itself included), or all
        of them (0)."""
        windowed = self.window > 0 and self.swa_pattern > 0 and layer % self.swa_pattern < self.swa_pattern - 1
        return self.window if windowed else 0

    def layer_rope(self, layer: int) -> RopeSpec:
        """The rope of ``layer``: a windowed layer's own when the model has one."""
        return self.rope_swa if self.rope_swa is not None and self.layer_window(layer) else self.rope
