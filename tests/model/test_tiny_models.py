"""The tiny synthetic models: llama.cpp's metadata and tensor names, a real tokenizer, and they run."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.oracles import llama_logits, llama_model
from tests.tiny_models import TINY_ARCHS, smollm2_tokenizer_metadata, write_tiny_gguf
from weaved.model.default import shipped_smollm2_path
from weaved.model.gguf_scan import scan_gguf, tensor_views


def _meta(path) -> dict:
    return {k: v.value for k, v in scan_gguf(path).metadata.items()}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_metadata_is_what_llama_cpp_reads(tmp_path, arch):
    path = write_tiny_gguf(tmp_path / "m.gguf", arch, n_layers=3, d_model=96, n_heads=6, n_kv_heads=2,
                           d_ff=160, rope_base=5e5, context_length=4096)
    meta = _meta(path)
    assert meta["general.architecture"] == arch.encode()
    assert meta[f"{arch}.block_count"] == 3
    assert meta[f"{arch}.embedding_length"] == 96
    assert meta[f"{arch}.feed_forward_length"] == 160
    assert meta[f"{arch}.attention.head_count"] == 6
    assert meta[f"{arch}.attention.head_count_kv"] == 2
    assert meta[f"{arch}.context_length"] == 4096
    assert meta[f"{arch}.rope.freq_base"] == 5e5
    assert meta[f"{arch}.rope.dimension_count"] == 16
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] > 0
    assert meta[f"{arch}.vocab_size"] == 49152
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        assert meta[f"{arch}.attention.key_length"] == meta[f"{arch}.attention.value_length"] == 16
    else:
        assert f"{arch}.attention.key_length" not in meta
    if arch == "qwen3moe":  # its default experts: 8, 2 a token, 32 long
        assert (meta["qwen3moe.expert_count"], meta["qwen3moe.expert_used_count"],
                meta["qwen3moe.expert_feed_forward_length"]) == (8, 2, 32)


def test_tokenizer_is_smollm2s(tiny_llama):
    ours = scan_gguf(tiny_llama, want=lambda k: k.startswith("tokenizer.")).metadata
    theirs = scan_gguf(shipped_smollm2_path(), want=lambda k: k.startswith("tokenizer.")).metadata
    assert ours == theirs == smollm2_tokenizer_metadata()
    assert len(ours["tokenizer.ggml.tokens"].value) == 49152
    assert "tokenizer.chat_template" in ours


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tensors_per_architecture(tmp_path, arch):
    head_dim = 32 if arch == "qwen3" else None
    path = write_tiny_gguf(tmp_path / "m.gguf", arch, n_layers=2, head_dim=head_dim)
    header = scan_gguf(path)
    shapes = {t.name: t.shape for t in header.tensors}
    types = {t.name: t.type for t in header.tensors}
    hd = head_dim or 16
    assert shapes["token_embd.weight"] == (49152, 64)
    assert "output.weight" not in shapes  # tied by default
    assert shapes["blk.1.attn_q.weight"] == (4 * hd, 64)
    assert shapes["blk.1.attn_k.weight"] == shapes["blk.1.attn_v.weight"] == (2 * hd, 64)
    assert shapes["blk.1.attn_output.weight"] == (64, 4 * hd)
    if arch == "qwen3moe":  # a router (kept F32, as llama.cpp's quantizer keeps it) and stacked experts
        assert shapes["blk.1.ffn_gate_inp.weight"] == (8, 64) and types["blk.1.ffn_gate_inp.weight"] == Q.F32
        assert shapes["blk.1.ffn_gate_exps.weight"] == shapes["blk.1.ffn_up_exps.weight"] == (8, 32, 64)
        assert shapes["blk.1.ffn_down_exps.weight"] == (8, 64, 32) and "blk.1.ffn_up.weight" not in shapes
        assert types["blk.0.ffn_up_exps.weight"] == Q.Q4_0 and types["token_embd.weight"] == Q.Q8_0
    else:
        assert shapes["blk.1.ffn_gate.weight"] == shapes["blk.1.ffn_up.weight"] == (128, 64)
        assert shapes["blk.1.ffn_down.weight"] == (64, 128)
        assert types["blk.0.ffn_up.weight"] == Q.Q4_0 and types["token_embd.weight"] == Q.Q8_0
    assert types["blk.0.attn_norm.weight"] == Q.F32
    has_bias = {n for n in shapes if n.endswith(".bias")}
    has_qk_norm = {n for n in shapes if "_q_norm" in n or "_k_norm" in n}
    if arch == "qwen2":
        assert shapes["blk.0.attn_q.bias"] == (64,) and shapes["blk.0.attn_k.bias"] == (32,)
        assert len(has_bias) == 6 and not has_qk_norm
    elif arch in ("qwen3", "qwen3moe", "gemma3"):
        hd_ = 32 if arch == "qwen3" else 16
        assert shapes["blk.0.attn_q_norm.weight"] == shapes["blk.0.attn_k_norm.weight"] == (hd_,)
        assert len(has_qk_norm) == 4 and not has_bias
        post = {n for n in shapes if ".post_" in n}
        assert post == ({"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight", "blk.1.post_attention_norm"
                         ".weight", "blk.1.post_ffw_norm.weight"} if arch == "gemma3" else set())
    else:
        assert not has_bias and not has_qk_norm


def test_untied_types_and_determinism(tmp_path):
    a = write_tiny_gguf(tmp_path / "a.gguf", tied=False, wtype=Q.F16, embd_type=Q.F32, seed=3)
    b = write_tiny_gguf(tmp_path / "b.gguf", tied=False, wtype=Q.F16, embd_type=Q.F32, seed=3)
    c = write_tiny_gguf(tmp_path / "c.gguf", tied=False, wtype=Q.F16, embd_type=Q.F32, seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    header = scan_gguf(a)
    types = {t.name: t.type for t in header.tensors}
    assert types["output.weight"] == types["token_embd.weight"] == Q.F32
    assert types["blk.0.attn_q.weight"] == Q.F16
    w = tensor_views(a, header)
    assert 0.8 < float(np.std(w["blk.0.ffn_down.weight"])) * 128**0.5 < 1.2  # std 1/sqrt(fan-in)
    assert abs(float(np.mean(w["blk.0.ffn_norm.weight"])) - 1) < 0.05


@pytest.mark.llama
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_runs_in_llama_cpp(request, arch):
    path = request.getfixturevalue(f"tiny_{arch}")
    llm = llama_model(path, n_ctx=256)
    tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog.", add_bos=False)
    assert tokens[:3] == [504, 2365, 6354]  # SmolLM2's tokenizer
    logits = llama_logits(llm, tokens)  # [T, vocab]
    assert logits.shape == (len(tokens), 49152)
    assert np.isfinite(logits).all()
    assert 0.3 < float(logits.std(axis=-1).mean()) < 5  # sane scale: neither flat nor exploding
