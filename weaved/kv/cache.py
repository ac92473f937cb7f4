"""The KV cache of one sequence, in the one layout every backend shares.

``data`` is float16 ``[n_layers, 2, n_kv_heads, capacity, head_dim]`` ([layer][k|v][kv_head]
[position][head_dim]): a position's rows for one head are contiguous and a head's rows for all
positions are one strided run, which is what decode attention reads.  The array may be an
in-memory buffer or a memory-mapped file; code that reads or writes KV only sees the array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weaved.model.config import ModelConfig


@dataclass(frozen=True)
class SharedRows:
    """The leading positions of a cache that are a shared prefix's rows (read-only, ``weaved.kv.prefixes``).

    ``keys[j]`` is the content key of positions [0, (j + 1) * block): equal keys mean equal tokens from
    position 0 under the same model, hence equal KV bits, wherever they are held - which is what lets a
    device hold a prefix's rows once for every session that maps it."""

    keys: tuple[str, ...]
    block: int  # positions per key

    @property
    def positions(self) -> int:
        return len(self.keys) * self.block


class KVCache:
    """KV rows of one sequence plus its length (positions 0 .. length-1 are valid)."""

    def __init__(self, data: np.ndarray, length: int = 0):
        if data.ndim != 5 or data.shape[1] != 2 or data.dtype != np.float16:
            raise ValueError(f"KV data must be float16 [L, 2, Hkv, cap, D], got {data.dtype} {data.shape}")
        self.data = data  # [n_layers, 2, n_kv_heads, capacity, head_dim] float16
        self.length = length
        self.shared: SharedRows | None = None  # set by the store while a prefix file is mapped over rows

    @classmethod
    def allocate(cls, config: ModelConfig, capacity: int) -> KVCache:
        """In-memory cache.  np.zeros maps untouched pages lazily, so unused capacity costs nothing."""
        shape = (config.n_layers, 2, config.n_kv_heads, capacity, config.head_dim)
        return cls(np.zeros(shape, dtype=np.float16))

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    @property
    def nbytes_used(self) -> int:
        L, _, H, _, D = self.data.shape
        return L * 2 * H * self.length * D * 2

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (rows are overwritten by the next writes)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
