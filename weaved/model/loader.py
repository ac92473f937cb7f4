"""Open a model file: metadata, configuration and a check that the engine can run every tensor."""

from __future__ import annotations

from pathlib import Path

from weaved.model.architectures import check_tensors, read_config
from weaved.model.config import ModelConfig
from weaved.model.gguf_file import GGUFFile


def open_model(path: str | Path) -> tuple[GGUFFile, ModelConfig]:
    """The memory-mapped GGUF and its configuration; ValueError if it cannot be run as is."""
    f = GGUFFile(path)
    cfg = read_config(f)
    check_tensors(f, cfg)
    return f, cfg
