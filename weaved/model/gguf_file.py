"""Reading a GGUF file: metadata and memory-mapped tensors, through gguf-py's reader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# ggml type ids this engine runs natively (values are ggml's): F32, F16, Q4_0, Q8_0.
NATIVE_TYPE_IDS = {0: "F32", 1: "F16", 2: "Q4_0", 8: "Q8_0"}


@dataclass(frozen=True)
class Tensor:
    """One tensor as stored: ``raw`` is the memory-mapped data (no copy).

    ``shape`` is row-major (outermost first), the reverse of ggml's ``ne`` order; for a weight
    matrix it is ``(n_out, n_in)``.  Quantized tensors come as uint8 ``[n_out, row_bytes]``.
    """

    name: str
    type_id: int
    type_name: str
    shape: tuple[int, ...]
    raw: np.ndarray


class GGUFFile:
    """Metadata and tensors of one GGUF file (memory-mapped, read-only)."""

    def __init__(self, path: str | Path):
        import gguf  # gguf-py; imported here so that importing this module stays cheap

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model file not found: {self.path}")
        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as exc:  # gguf-py raises ValueError / struct errors on non-GGUF input
            raise ValueError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self.tensors: dict[str, Tensor] = {}
        for t in self._reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            type_id = int(t.tensor_type)
            self.tensors[t.name] = Tensor(t.name, type_id, t.tensor_type.name, shape, t.data)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as a Python scalar, string or list (``default`` if absent)."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path.name}: metadata key '{key}' is missing")
        return value

    def keys(self) -> list[str]:
        return list(self._reader.fields.keys())
