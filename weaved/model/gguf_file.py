"""Reading a GGUF file: metadata and memory-mapped tensors.

The header is walked with ``gguf_scan`` (struct reads, milliseconds) rather than gguf-py's
``GGUFReader``, which builds numpy objects for every vocabulary entry: seconds of start-up and
tens of MB that stay resident.  The vocabulary's token arrays are skipped entirely - the
tokenizer is llama.cpp's own, which reads them itself.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weaved.model.gguf_scan import scan_gguf, tensor_views

# ggml type ids this engine runs natively (values are ggml's): F32, F16, Q4_0, Q8_0.
NATIVE_TYPE_IDS = {0: "F32", 1: "F16", 2: "Q4_0", 8: "Q8_0"}
_SKIPPED_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges")


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
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model file not found: {self.path}")
        header = scan_gguf(self.path, want=lambda key: key not in _SKIPPED_ARRAYS)
        self._meta = header.metadata
        views = tensor_views(self.path, header)
        self.tensors: dict[str, Tensor] = {
            t.name: Tensor(t.name, int(t.type), t.type.name, tuple(int(n) for n in t.shape), views[t.name])
            for t in header.tensors
        }

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as a Python scalar, string or list (``default`` if absent)."""
        item = self._meta.get(key)
        if item is None:
            return default
        return _plain(item.value)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path.name}: metadata key '{key}' is missing")
        return value

    def keys(self) -> list[str]:
        return list(self._meta)

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident set (they stay in the page cache and
        come back on the next read): after the weights were repacked, only embedding rows are read."""
        for t in self.tensors.values():  # every view shares the file's one mapping
            mm = _mapping_of(t.raw)
            if mm is not None:
                mm.madvise(mmap.MADV_DONTNEED)
            return


def release_view(view: np.ndarray) -> None:
    """Drop the pages under ``view`` (a tensor's memory-mapped data) from this process's resident set.

    The pages stay in the page cache, so the next read maps them again without I/O.  Reading a few
    scattered rows of a mapped file maps whole page-cache folios (hundreds of KB per row on kernels
    with large folios), so a reader of scattered rows that runs forever - the logits' refinement -
    would otherwise make the whole tensor resident twice, beside its packed copy."""
    mm = _mapping_of(view)
    if mm is None or view.nbytes == 0:
        return
    start = view.__array_interface__["data"][0] - np.frombuffer(mm, np.uint8).__array_interface__["data"][0]
    first = start - start % mmap.PAGESIZE
    mm.madvise(mmap.MADV_DONTNEED, first, start + view.nbytes - first)


def _mapping_of(view: np.ndarray) -> mmap.mmap | None:
    base = view
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.base
    return base


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v
