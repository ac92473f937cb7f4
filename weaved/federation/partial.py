"""Partial attention of a batch of query rows over their sessions' KV shards, and the merge.

Each row (one token of one ring session) attends the first ``n_keys[row]`` rows of its session's
shard: the shard's positions are all older than the query except, in a multi-token chunk, the
chunk's own later tokens, which the per-row key count leaves out (causality across shards; see
``shards.shard_length``).  Every session's shard is a separate array, so one call covers the whole
batch through the kernel's per-row K/V addresses, the entry point under both ``ka.attend`` and
``ka.attend_partial``: one call per (layer, head group) instead of one per session.  Its arithmetic
is ``ka.attend_partial``'s (and, over a whole KV, ``ka.attend``'s), row by row.

The merge is ``ka.merge_partials``: float32 online softmax, an empty part (lse -inf) ignored.
"""

from __future__ import annotations

import numba
import numpy as np

from weaved.kernels import attention as ka
from weaved.kernels.threads import on_kernel_thread

_SCRATCH_FLOATS = 1 << 22  # as the kernel module's bound on partial results held at once
_SLICES = max(1, numba.config.NUMBA_NUM_THREADS)

merge = ka.merge_partials


class ShardBatch:
    """Where each row's KV shard lives: built once per step over the sessions' shard arrays
    (float16 [n_layers, 2, n_kv_heads, capacity, head_dim], C-contiguous, capacities may differ)."""

    def __init__(self, shards: list[np.ndarray], row_seq: np.ndarray, n_keys: np.ndarray):
        for i, a in enumerate(shards):
            if a.dtype != np.float16 or a.ndim != 5 or a.shape[1] != 2 or not a.flags.c_contiguous:
                raise ValueError(f"shard {i} must be C-contiguous float16 [L, 2, Hkv, cap, D], got {a.dtype} {a.shape}")
        if len({(a.shape[0], a.shape[2], a.shape[4]) for a in shards}) > 1:
            raise ValueError("shards of one batch must share n_layers, n_kv_heads and head_dim")
        self.n_layers, self.n_kv_heads = (shards[0].shape[0], shards[0].shape[2]) if shards else (0, 0)
        self.shards = shards  # referenced: the kernel reads them by address
        self.row_seq = np.asarray(row_seq, np.int64)  # [T] session of each row
        self.n_keys = np.ascontiguousarray(n_keys, np.int64)  # [T] shard rows each row attends
        caps = np.array([a.shape[3] for a in shards], np.int64)
        if len(self.n_keys) != len(self.row_seq):
            raise ValueError("one key count per row")
        if len(self.n_keys) and ((self.n_keys < 0).any() or (self.n_keys > caps[self.row_seq]).any()):
            raise ValueError("a row attends past its shard's capacity")
        base = np.array([a.ctypes.data for a in shards], np.int64)  # [S]
        strides = np.array([a.strides[:3] for a in shards], np.int64).reshape(-1, 3)  # [S, 3] layer, k|v, head
        self._base = base[self.row_seq]  # [T]
        self._st = strides[self.row_seq]  # [T, 3]

    @property
    def n_rows(self) -> int:
        return len(self.row_seq)

    @on_kernel_thread  # (a parallel kernel: started from the one thread, kernels.threads says why)
    def attend(self, q: np.ndarray, layer: int, h0: int, h1: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Rows' query heads of kv heads h0..h1-1, q float32 [T, (h1-h0) * G, D] (G query heads per
        kv head), over their shards at ``layer`` -> (out float32 [T, (h1-h0)*G, D], lse float32
        [T, (h1-h0)*G]); a row with no keys gives out 0, lse -inf."""
        T, Hq, D = q.shape
        if T != self.n_rows or not q.flags.c_contiguous or q.dtype != np.float32:
            raise ValueError(f"q must be C-contiguous float32 [{self.n_rows}, heads, D], got {q.dtype} {q.shape}")
        if T and not (0 <= layer < self.n_layers and 0 <= h0 < h1 <= self.n_kv_heads and Hq % (h1 - h0) == 0):
            raise ValueError(f"bad layer {layer} or kv heads [{h0}, {h1}) for {Hq} query heads")
        hs = np.arange(h0, h1, dtype=np.int64)
        # [T, h1-h0] address of (layer, K or V, head, position 0) in each row's shard
        kaddr = self._base[:, None] + layer * self._st[:, :1] + hs[None, :] * self._st[:, 2:3]
        vaddr = kaddr + self._st[:, 1:2]
        out = np.empty((T, Hq, D), np.float32)
        lse = np.empty((T, Hq), np.float32)
        if T:
            max_items = max(1, _SCRATCH_FLOATS // (Hq * (D + 2)))
            ka.attend_rows(q, kaddr, vaddr, self.n_keys, np.float32(scale), out, lse, _SLICES, max_items)
        return out, lse
