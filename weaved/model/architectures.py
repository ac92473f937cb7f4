"""Supported architectures: their hyper-parameters from GGUF metadata and their tensor names.

llama, qwen2 and qwen3 share one decoder block (RMSNorm, GQA attention with RoPE, SwiGLU MLP); they
differ in the rope style llama.cpp uses for them, qwen2's q/k/v biases and qwen3's per-head RMSNorm
on q and k.  gemma3 adds what llama.cpp's gemma3 graph does: token embeddings scaled by
sqrt(d_model), q/k norms, sliding-window layers with a rope of their own (every ``swa_pattern``-th
layer is global), a query scale from the head size, RMSNorms of the attention and FFN outputs
before their residuals, and a GELU-gated FFN.  (Its GGUF norm weights already hold 1 + w.)

RoPE comes from the metadata as llama.cpp reads it: ``rope.freq_base``, ``rope.scaling.type``
(none, linear or yarn, with ``factor``, ``original_context_length`` and ``attn_factor``) and, for
Llama 3.x, the ``rope_freqs.weight`` tensor of per-pair frequency divisors.

qwen3moe is qwen3's attention with a mixture-of-experts FFN in every layer (``expert_count`` experts of
``expert_feed_forward_length``, ``expert_used_count`` picked per token by the ``ffn_gate_inp`` router,
the experts stacked in 3-D ``ffn_{gate,up,down}_exps`` tensors); a llama file with ``expert_count``
(Mixtral's layout) has the same FFN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weaved.model.config import ModelConfig, RopeSpec, RopeStyle
from weaved.model.gguf_file import NATIVE_TYPE_IDS, GGUFFile


@dataclass(frozen=True)
class ArchSpec:
    rope_style: RopeStyle
    attn_bias: bool = False
    qk_norm: bool = False
    gemma: bool = False  # gemma3's block (see the module docstring)
    moe: bool = False  # every layer's FFN is a mixture of experts (a llama file may have them too)


# llama.cpp: LLM_ARCH_LLAMA uses LLAMA_ROPE_TYPE_NORM; QWEN2, QWEN3 and GEMMA3 use LLAMA_ROPE_TYPE_NEOX.
ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(RopeStyle.NORM),
    "qwen2": ArchSpec(RopeStyle.NEOX, attn_bias=True),
    "qwen3": ArchSpec(RopeStyle.NEOX, qk_norm=True),
    "qwen3moe": ArchSpec(RopeStyle.NEOX, qk_norm=True, moe=True),
    "gemma3": ArchSpec(RopeStyle.NEOX, qk_norm=True, gemma=True),
}

ROPE_SCALING = ("none", "linear", "yarn")
GEMMA_SWA_PATTERN = 6  # llama.cpp's default: layers 5, 11, 17, ... attend globally
GEMMA_SWA_ROPE_BASE = 10000.0


def _f32(x: float) -> np.float32:
    return np.float32(x)


def _yarn_attn_factor(factor: float, gguf_attn_factor: float) -> float:
    """llama.cpp's ``yarn_attn_factor`` for a YaRN model without a log multiplier, in float32:
    ``get_mscale(factor) / (1 + 0.1 ln factor)`` (the kernel multiplies the second factor back in),
    times the file's ``rope.scaling.attn_factor``."""
    s = _f32(factor)
    mscale = _f32(1.0) if s <= 1 else _f32(0.1) * np.log(s) + _f32(1.0)
    v = mscale * (_f32(1.0) / (_f32(1.0) + _f32(0.1) * np.log(s)))
    return float(np.float32(v * _f32(gguf_attn_factor)))


def _rope(f: GGUFFile, arch: str, context_length: int) -> RopeSpec:
    """The rope of the model's (global) layers from its metadata and ``rope_freqs.weight``."""
    base = float(f.get(f"{arch}.rope.freq_base", 10000.0))
    # llama.cpp: the type defaults to linear, so a factor (or the older scale_linear key) alone scales
    # the frequencies; a type of "none" never scales
    scaling = f.get(f"{arch}.rope.scaling.type", "linear") or "linear"
    if scaling not in ROPE_SCALING:
        raise ValueError(f"{f.path.name}: rope scaling '{scaling}' is not supported "
                         f"(supported: {', '.join(ROPE_SCALING)})")
    factor = float(f.get(f"{arch}.rope.scaling.factor", 0.0) or f.get(f"{arch}.rope.scale_linear", 0.0) or 0.0)
    freq_scale = float(np.float32(1.0) / np.float32(factor)) if factor and scaling != "none" else 1.0
    ff = None
    if "rope_freqs.weight" in f.tensors:
        t = f.tensors["rope_freqs.weight"]
        if t.type_id != 0:
            raise ValueError(f"{f.path.name}: rope_freqs.weight must be F32, got {t.type_name}")
        ff = tuple(float(v) for v in np.asarray(t.raw, dtype=np.float32).reshape(-1))
    if scaling != "yarn":
        return RopeSpec(base=base, freq_scale=freq_scale, freq_factors=ff)
    if not factor:
        raise ValueError(f"{f.path.name}: YaRN rope scaling needs {arch}.rope.scaling.factor")
    orig = int(f.get(f"{arch}.rope.scaling.original_context_length", context_length))
    attn = _yarn_attn_factor(factor, float(f.get(f"{arch}.rope.scaling.attn_factor", 1.0)))
    return RopeSpec(base=base, freq_scale=freq_scale, freq_factors=ff, ext_factor=1.0, attn_factor=attn,
                    orig_ctx=orig)


def _one_value(f: GGUFFile, key: str, value):
    """A hyper-parameter llama.cpp may read per layer (``get_key_or_arr``): an array of one repeated value
    is that value; one that varies by layer is refused by name (Weave's layers are alike)."""
    if isinstance(value, (list, tuple)):
        if not value or any(v != value[0] for v in value):
            raise ValueError(f"{f.path.name}: {key} varies by layer ({list(value)[:8]}...): Weave runs models "
                             f"whose layers have one shape")
        return value[0]
    return value


def read_config(f: GGUFFile) -> ModelConfig:
    """ModelConfig from a GGUF's metadata; ValueError naming what is unsupported or missing."""
    split = f.get("split.count")
    if split is not None and int(split) > 1:
        raise ValueError(f"{f.path.name} is one of the {int(split)} parts of a split model (split.count): Weave "
                         f"serves one file - merge the parts first with llama.cpp's `llama-gguf-split --merge "
                         f"{f.path.name} merged.gguf`")
    arch = f.require("general.architecture")
    if arch not in ARCHS:
        raise ValueError(
            f"{f.path.name}: architecture '{arch}' is not supported (supported: {', '.join(ARCHS)})"
        )
    spec = ARCHS[arch]

    def get(key: str, default=None):
        return _one_value(f, key, f.get(key, default))

    def require(key: str):
        return _one_value(f, key, f.require(key))

    def number(key: str, kind=int, default=None, required: bool = False):
        v = require(key) if required else get(key, default)
        try:
            return kind(v)
        except (TypeError, ValueError):
            raise ValueError(f"{f.path.name}: {key} is {v!r}, not a {'whole ' if kind is int else ''}number") from None

    n_heads = number(f"{arch}.attention.head_count", required=True)
    d_model = number(f"{arch}.embedding_length", required=True)
    if n_heads < 1 or d_model < 1:
        raise ValueError(f"{f.path.name}: {arch}.attention.head_count ({n_heads}) and {arch}.embedding_length "
                         f"({d_model}) must be at least 1")
    head_dim = number(f"{arch}.attention.key_length", default=d_model // n_heads)
    embd = f.tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        raise ValueError(f"{f.path.name}: no token embedding matrix (token_embd.weight)")
    vocab_size = embd.shape[0]  # the rows the model has (a tokenizer's vocabulary may not exceed them)
    context_length = number(f"{arch}.context_length", default=2048)
    n_layers = number(f"{arch}.block_count", required=True)
    gemma: dict = {}
    if spec.gemma:
        window = int(f.get(f"{arch}.attention.sliding_window", 0) or 0)
        pattern = f.get(f"{arch}.attention.sliding_window_pattern", GEMMA_SWA_PATTERN) if window else 0
        if isinstance(pattern, (list, tuple)):  # per layer, whether it slides: llama.cpp's every-sixth-global
            want = [(i + 1) % GEMMA_SWA_PATTERN != 0 for i in range(n_layers)]
            if [bool(v) for v in pattern] != want:
                raise ValueError(f"{f.path.name}: {arch}.attention.sliding_window_pattern is not every "
                                 f"{GEMMA_SWA_PATTERN}th layer global, the only pattern Weave (and llama.cpp) runs")
            pattern = GEMMA_SWA_PATTERN
        pattern = int(pattern)
        swa_base = float(f.get(f"{arch}.rope.freq_base_swa", GEMMA_SWA_ROPE_BASE))
        # llama.cpp: 1/sqrt(n_embd / n_head) for the 62-layer 27B, else 1/sqrt(head_dim), in float32
        q_size = d_model // n_heads if n_layers == 62 else head_dim
        gemma = dict(window=window, swa_pattern=pattern, rope_swa=RopeSpec(base=swa_base) if window else None,
                     embed_scale=float(np.sqrt(np.float32(d_model))),
                     attn_scale=float(_f32(1.0) / np.sqrt(_f32(q_size))), post_norms=True, act="gelu")
    n_experts = int(f.get(f"{arch}.expert_count", 0) or 0)
    if spec.moe and not n_experts:
        raise ValueError(f"{f.path.name}: {arch} needs {arch}.expert_count")
    moe = {}
    if n_experts:
        used = int(f.require(f"{arch}.expert_used_count"))
        n_ff = int(require(f"{arch}.feed_forward_length"))
        # llama.cpp: a llama file's experts are feed_forward_length long; qwen3moe has a key of its own
        # (without it, the dense length over the experts used)
        d_ff_expert = n_ff if arch == "llama" else int(f.get(f"{arch}.expert_feed_forward_length", 0) or 0) or (
            n_ff // used)
        moe = dict(n_experts=n_experts, n_experts_used=used, d_ff_expert=d_ff_expert)
    try:
        return _config(f, arch, spec, number, n_layers, d_model, n_heads, head_dim, vocab_size, context_length,
                       gemma, moe)
    except ValueError as e:
        if str(e).startswith(f.path.name):
            raise
        raise ValueError(f"{f.path.name}: {e}") from None


def _config(f: GGUFFile, arch: str, spec: ArchSpec, number, n_layers, d_model, n_heads, head_dim, vocab_size,
            context_length, gemma: dict, moe: dict) -> ModelConfig:
    return ModelConfig(
        arch=arch,
        name=str(f.get("general.name", f.path.stem)),
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=number(f"{arch}.attention.head_count_kv", default=n_heads),
        head_dim=head_dim,
        d_ff=number(f"{arch}.feed_forward_length", default=0) if moe else number(
            f"{arch}.feed_forward_length", required=True),
        vocab_size=vocab_size,
        context_length=context_length,
        rms_eps=number(f"{arch}.attention.layer_norm_rms_epsilon", float, required=True),
        rope_style=spec.rope_style,
        rope=_rope(f, arch, context_length),
        rope_dims=number(f"{arch}.rope.dimension_count", default=0),
        attn_bias=spec.attn_bias,
        qk_norm=spec.qk_norm,
        tied_output="output.weight" not in f.tensors,
        **gemma,
        **moe,
    )


def required_tensors(cfg: ModelConfig) -> list[str]:
    """The tensors the architecture needs, in the file's usual order (those ``expected_shapes`` gives)."""
    return list(expected_shapes(cfg))


def check_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    """Every tensor the architecture needs is present, in its shape, of a type the engine runs natively,
    and none it would leave unread (``check_layout``)."""
    check_layout(f, cfg)
    bad = sorted({t.type_name for n in required_tensors(cfg) if (t := f.tensors[n]).type_id not in NATIVE_TYPE_IDS})
    if bad:
        raise ValueError(
            f"{f.path.name}: tensor types {', '.join(bad)} are not run natively "
            f"(native: {', '.join(NATIVE_TYPE_IDS.values())}); convert the file with `weave convert`"
        )


def check_layout(f: GGUFFile, cfg: ModelConfig) -> None:
    """Every tensor the architecture needs is present, in the shape the metadata implies, and none it
    would leave unread: llama.cpp refuses tensors an architecture has no place for, and adds some
    optional ones (a llama file's biases) that Weave does not implement - refused rather than ignored.
    Whatever the tensors' types (checked before a conversion too)."""
    required = expected_shapes(cfg)
    missing = [n for n in required if n not in f.tensors]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"{f.path.name}: tensors missing for {cfg.arch}: {', '.join(missing[:3])}{more}")
    extra = sorted(set(f.tensors) - set(required) - {"rope_freqs.weight"})
    if extra:
        more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
        raise ValueError(f"{f.path.name}: tensors Weave does not implement for {cfg.arch} (llama.cpp would use or "
                         f"refuse them; left out, the model would compute something else): "
                         f"{', '.join(extra[:3])}{more}")
    if cfg.rope.freq_factors is not None and len(cfg.rope.freq_factors) < cfg.n_rot // 2:
        raise ValueError(f"{f.path.name}: rope_freqs.weight has {len(cfg.rope.freq_factors)} values, "
                         f"the model rotates {cfg.n_rot // 2} pairs")
    # shapes as llama.cpp checks them: a kernel would read past a matrix, or compute something else, where the
    # file and its metadata disagree
    for name, shape in required.items():
        got = tuple(f.tensors[name].shape)
        if got != shape:
            moe = f" ({cfg.n_experts} experts of {cfg.d_ff_expert})" if "_exps" in name or "gate_inp" in name else ""
            raise ValueError(f"{f.path.name}: {name} has shape {got}, the metadata says {shape}{moe}")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every required tensor's shape (numpy order: rows of a matrix first) as the metadata implies it."""
    d, q, kv, hd = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    want = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tied_output:
        want["output.weight"] = (cfg.vocab_size, d)
    layer = {"attn_norm.weight": (d,), "ffn_norm.weight": (d,), "attn_q.weight": (q, d), "attn_k.weight": (kv, d),
             "attn_v.weight": (kv, d), "attn_output.weight": (d, q)}
    if cfg.moe:
        E, ff = cfg.n_experts, cfg.d_ff_expert
        layer |= {"ffn_gate_inp.weight": (E, d), "ffn_gate_exps.weight": (E, ff, d),
                  "ffn_up_exps.weight": (E, ff, d), "ffn_down_exps.weight": (E, d, ff)}
    else:
        layer |= {"ffn_gate.weight": (cfg.d_ff, d), "ffn_up.weight": (cfg.d_ff, d), "ffn_down.weight": (d, cfg.d_ff)}
    if cfg.attn_bias:
        layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if cfg.qk_norm:
        layer |= {"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)}
    if cfg.post_norms:
        layer |= {"post_attention_norm.weight": (d,), "post_ffw_norm.weight": (d,)}
    for i in range(cfg.n_layers):
        want |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return want
