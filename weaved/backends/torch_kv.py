"""Device mirrors of KV caches for the torch backend (the device tier of docs/architecture.md, "KV cache").

A session's ``KVCache`` (its array over the session's file) is the source of truth.  A mirror is
its copy in device memory, in the same layout and bytes: float16 [n_layers, 2, n_kv_heads,
positions, head_dim].  It is allocated for the positions in use, grown in steps of ``GROW``
positions (reallocate and copy) as the sequence grows, so idle capacity costs no device memory.

Mirrors are kept in a ``WeakKeyDictionary`` keyed by the cache object: a cache that is dropped
takes its mirror with it.  ``valid`` counts the leading rows known equal to the host's; the backend
writes every new row to both sides in the same step (write-through), and a cache whose length
grew elsewhere (rows the host has and the mirror lacks) is caught up from the host before use.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from weaved.kv.cache import KVCache


@dataclass(eq=False)
class Mirror:
    data: torch.Tensor  # float16 [n_layers, 2, n_kv_heads, allocated positions, head_dim]
    valid: int  # rows 0..valid-1 equal the host's

    @property
    def positions(self) -> int:
        return self.data.shape[3]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class KVMirrors:
    """The mirrors of one backend; ``h2d_bytes`` / ``d2h_bytes`` count KV bytes copied each way."""

    GROW = 256  # positions added per reallocation

    def __init__(self, device: torch.device):
        self.device = device
        self._mirrors: weakref.WeakKeyDictionary[KVCache, Mirror] = weakref.WeakKeyDictionary()
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def __contains__(self, kv: KVCache) -> bool:
        return kv in self._mirrors

    def nbytes(self) -> int:
        return sum(m.nbytes for m in self._mirrors.values())

    def _alloc(self, kv: KVCache, positions: int) -> torch.Tensor:
        L, two, Hkv, cap, D = kv.data.shape
        n = min(cap, -(-max(positions, 1) // self.GROW) * self.GROW)
        return torch.empty((L, two, Hkv, n, D), dtype=torch.float16, device=self.device)

    def _upload_rows(self, kv: KVCache, m: Mirror, a: int, b: int) -> int:
        """Copy host rows a..b-1 into the mirror; returns the bytes copied."""
        if b <= a:
            return 0
        src = torch.from_numpy(np.ascontiguousarray(kv.data[:, :, :, a:b]))  # [L, 2, Hkv, b - a, D]
        m.data[:, :, :, a:b].copy_(src)
        n = src.numel() * src.element_size()
        self.h2d_bytes += n
        return n

    def adopt(self, kv: KVCache) -> int:
        """Mirror ``kv`` (rows 0..length-1 copied once); a no-op returning 0 if already mirrored."""
        if kv in self._mirrors:
            return 0
        m = Mirror(self._alloc(kv, kv.length), 0)
        n = self._upload_rows(kv, m, 0, kv.length)
        m.valid = kv.length
        self._mirrors[kv] = m
        return n

    def release(self, kv: KVCache) -> int:
        """Drop ``kv``'s mirror.  Nothing to write back (every step wrote through): returns 0."""
        self._mirrors.pop(kv, None)
        return 0

    def prepare(self, kv: KVCache, n_new: int) -> Mirror:
        """The mirror of ``kv`` (adopted if new) holding rows 0..length-1 and room for ``n_new`` more."""
        self.adopt(kv)
        m = self._mirrors[kv]
        if kv.length < m.valid:  # truncated (e.g. rejected draft tokens): later rows are stale
            m.valid = kv.length
        need = kv.length + n_new
        if need > m.positions:  # grow: reallocate, copy the valid rows
            data = self._alloc(kv, need)
            data[:, :, :, :m.valid].copy_(m.data[:, :, :, :m.valid])
            m.data = data
        if kv.length > m.valid:  # the host went on without us: catch up
            self._upload_rows(kv, m, m.valid, kv.length)
            m.valid = kv.length
        return m

    def write_through(self, kv: KVCache, rows: np.ndarray, pos0: int) -> None:
        """Store a step's new rows (float16 [n_layers, 2, n_kv_heads, n, head_dim], already in the
        mirror) into the host array at positions pos0.., and count them as valid."""
        n = rows.shape[3]
        kv.data[:, :, :, pos0:pos0 + n] = rows
        self.d2h_bytes += rows.nbytes
        self._mirrors[kv].valid = pos0 + n
