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
