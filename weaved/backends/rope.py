"""A model's RoPE as the kernels take it (shared by the CPU and torch backends and federation)."""

from __future__ import annotations

from weaved.kernels.elementwise import rope_params
from weaved.model.config import ModelConfig, RopeSpec


def kernel_rope(cfg: ModelConfig, spec: RopeSpec) -> tuple:
    """The kernels' rope tuple (``rope_params``) of one of the model's ropes."""
    return rope_params(cfg.n_rot, cfg.head_dim, spec.base, spec.freq_scale, cfg.rope_style.value, spec.freq_factors,
                       spec.ext_factor, spec.attn_factor, spec.orig_ctx, spec.beta_fast, spec.beta_slow)
