"""Fixtures of the federation tests: a deeper tiny model, so that a pipeline has layers to split."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_gguf


@pytest.fixture(scope="session")
def tiny_llama_deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama with 5 layers (the shared tiny models have 2)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "llama5.gguf", "llama", n_layers=5, output_norm_scale=4.0)
