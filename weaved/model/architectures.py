"""Supported architectures: their hyper-parameters from GGUF metadata and their tensor names.

llama, qwen2 and qwen3 share one decoder block (RMSNorm, GQA attention with RoPE, SwiGLU MLP); they
differ in the rope style llama.cpp uses for them, qwen2's q/k/v biases and qwen3's per-head
RMSNorm on q and k.
"""

from __future__ import annotations

from dataclasses import dataclass

from weaved.model.config import ModelConfig, RopeStyle
from weaved.model.gguf_file import NATIVE_TYPE_IDS, GGUFFile


@dataclass(frozen=True)
class ArchSpec:
    rope_style: RopeStyle
    attn_bias: bool
    qk_norm: bool


# llama.cpp: LLM_ARCH_LLAMA uses LLAMA_ROPE_TYPE_NORM; QWEN2 and QWEN3 use LLAMA_ROPE_TYPE_NEOX.
ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(RopeStyle.NORM, attn_bias=False, qk_norm=False),
    "qwen2": ArchSpec(RopeStyle.NEOX, attn_bias=True, qk_norm=False),
    "qwen3": ArchSpec(RopeStyle.NEOX, attn_bias=False, qk_norm=True),
}

LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def read_config(f: GGUFFile) -> ModelConfig:
    """ModelConfig from a GGUF's metadata; ValueError naming what is unsupported or missing."""
    arch = f.require("general.architecture")
    if arch not in ARCHS:
        raise ValueError(
            f"{f.path.name}: architecture '{arch}' is not supported (supported: {', '.join(ARCHS)})"
        )
    spec = ARCHS[arch]
    n_heads = int(f.require(f"{arch}.attention.head_count"))
    d_model = int(f.require(f"{arch}.embedding_length"))
    head_dim = int(f.get(f"{arch}.attention.key_length", d_model // n_heads))
    vocab = f.get("tokenizer.ggml.tokens")
    vocab_size = len(vocab) if vocab is not None else f.tensors["token_embd.weight"].shape[0]

    rope_scale = 1.0
    scaling = f.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope_scale = float(f.require(f"{arch}.rope.scaling.factor"))
    elif scaling not in ("none", None):
        raise ValueError(f"{f.path.name}: rope scaling '{scaling}' is not supported (supported: none, linear)")
    if f.get(f"{arch}.rope.scale_linear") is not None:  # older converters' key
        rope_scale = float(f.get(f"{arch}.rope.scale_linear"))

    return ModelConfig(
        arch=arch,
        name=str(f.get("general.name", f.path.stem)),
        n_layers=int(f.require(f"{arch}.block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(f.require(f"{arch}.feed_forward_length")),
        vocab_size=vocab_size,
        context_length=int(f.get(f"{arch}.context_length", 2048)),
        rms_eps=float(f.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_style=spec.rope_style,
        rope_base=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scale=rope_scale,
        rope_dims=int(f.get(f"{arch}.rope.dimension_count", 0)),
        attn_bias=spec.attn_bias,
        qk_norm=spec.qk_norm,
        tied_output="output.weight" not in f.tensors,
    )


def required_tensors(cfg: ModelConfig) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    if not cfg.tied_output:
        names.append("output.weight")
    for i in range(cfg.n_layers):
        names += [f"blk.{i}.attn_norm.weight", f"blk.{i}.ffn_norm.weight"]
        names += [f"blk.{i}.{m}.weight" for m in LAYER_MATRICES]
        if cfg.attn_bias:
            names += [f"blk.{i}.attn_{x}.bias" for x in "qkv"]
        if cfg.qk_norm:
            names += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
    return names


def check_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    """Every tensor the architecture needs is present, of a type the engine runs natively."""
    missing = [n for n in required_tensors(cfg) if n not in f.tensors]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"{f.path.name}: tensors missing for {cfg.arch}: {', '.join(missing[:3])}{more}")
    bad = sorted({t.type_name for n in required_tensors(cfg) if (t := f.tensors[n]).type_id not in NATIVE_TYPE_IDS})
    if bad:
        raise ValueError(
            f"{f.path.name}: tensor types {', '.join(bad)} are not run natively "
            f"(native: {', '.join(NATIVE_TYPE_IDS.values())}); convert the file with `weave convert`"
        )
