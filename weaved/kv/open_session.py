"""What the KV store holds for a session it has open (``store.py``, ``store_prefixes.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weaved.kv.mapping import FileMapping


@dataclass
class OpenSession:
    capacity: int
    reserved: int  # positions [0, reserved) are backed by allocated blocks (or a shared prefix)
    mm: FileMapping
    data: np.ndarray  # [n_layers, 2, n_kv_heads, capacity, head_dim] float16 over mm
    prefix: str | None = None  # the shared prefix file mapped over its first positions
    shared: int = 0  # positions [0, shared) are that prefix's pages (read-only)
    memory_only: bool = False  # no file: private memory, for a session that never outlives its request
    readers: int = 0  # copies reading its rows off the store's lock (``KVStore.pinned``): its release waits
    deleted: bool = False  # deleted while read: the last reader lets go of its mapping
