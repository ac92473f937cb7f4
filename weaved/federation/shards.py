"""How a ring session's KV is spread over the ring: position p lives on rank p mod N, row p // N.

Why round-robin rather than contiguous blocks: decode appends one position per step, and Q-Ring
wants the shards balanced at every length (the slowest shard sets the step time).  With blocks the
newest positions would all pile onto one node; with round-robin the append rule and the prefill
layout are the same rule, shard sizes never differ by more than one position, and a pipeline
prefill's hand-off can scatter by the same rule.  A node's shard is an ordinary KV array in the
standard layout ([layer][k|v][kv_head][row][head_dim], float16): a ``KVCache`` whose ``length`` is the
number of its rows, so it can be file-backed like any session's cache.  Keys are stored already
rotated (RoPE at the home), so attention over a shard needs no positions, only how many of its rows
a query may see: a query at position q sees the rows of positions < q + 1 (``shard_length(q + 1)``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from weaved.kv.cache import KVCache
from weaved.model.config import ModelConfig

# (session id, capacity in positions) -> an empty cache of the full model's layers: in memory by
# default; a daemon passes one that creates the session's file (``KVStore.create``) instead
KVFactory = Callable[[int, int], KVCache]


def shard_length(length, rank: int, n: int):
    """How many of positions 0 .. length-1 live on ``rank`` of ``n`` (those p with p % n == rank);
    ``length`` may be an int or an int64 array."""
    return (length + (n - 1 - rank)) // n


def shard_positions(length: int, rank: int, n: int) -> slice:
    """The positions (of a full cache of ``length``) that ``rank``'s shard holds, in row order."""
    return slice(rank, length, n)


def split_kv(data: np.ndarray, length: int, n: int) -> list[np.ndarray]:
    """The rows of positions 0 .. length-1 of a full KV array (float16 [L, 2, Hkv, cap, D]) cut
    into ``n`` shards: contiguous float16 [L, 2, Hkv, shard_length(length, r, n), D] per rank."""
    return [np.ascontiguousarray(data[:, :, :, shard_positions(length, r, n)]) for r in range(n)]


def join_shards(shards: list[np.ndarray], length: int, out: np.ndarray) -> None:
    """The inverse of ``split_kv``: write every shard's rows back to their positions in ``out``."""
    n = len(shards)
    for r, s in enumerate(shards):
        m = shard_length(length, r, n)
        out[:, :, :, shard_positions(length, r, n)] = s[:, :, :, :m]


def memory_kv_factory(config: ModelConfig) -> KVFactory:
    """Caches in memory (``KVCache.allocate``)."""
    return lambda sid, capacity: KVCache.allocate(config, capacity)


class ShardTable:
    """This rank's shards of the ring's sessions: session id -> ``KVCache`` of the shard."""

    def __init__(self, config: ModelConfig, rank: int, n: int, kv_factory: KVFactory | None = None,
                 on_close: Callable[[int, KVCache], None] | None = None):
        self.config, self.rank, self.n = config, rank, n
        self.kv_factory = kv_factory or memory_kv_factory(config)
        self.on_close = on_close  # a closed shard's cache goes back to whoever made it (e.g. its file)
        self.kv: dict[int, KVCache] = {}
        self.lengths: dict[int, int] = {}  # a session's full length (all shards), for checks

    def open(self, sid: int, capacity: int, length: int = 0, rows: np.ndarray | None = None) -> KVCache:
        """A shard for a session of ``capacity`` positions; ``rows`` (float16 [L, 2, Hkv, m, D], m =
        shard_length(length)) are its first rows when the session arrives with history."""
        if sid in self.kv:
            raise ValueError(f"session {sid} already has a shard on rank {self.rank}")
        if not 0 <= length <= capacity:
            raise ValueError(f"length {length} outside capacity {capacity}")
        kv = self.kv_factory(sid, shard_length(capacity, self.rank, self.n))
        m = shard_length(length, self.rank, self.n)
        if m:
            if rows is None or rows.shape[3] != m:
                raise ValueError(f"session {sid}: expected {m} shard rows")
            kv.data[:, :, :, :m] = rows
        kv.length = m
        self.kv[sid] = kv
        self.lengths[sid] = length
        return kv

    def adopt(self, sid: int, kv: KVCache, length: int) -> None:
        """Take a shard built elsewhere in this process (a pipeline prefill's scatter hand-off)."""
        if kv.length != shard_length(length, self.rank, self.n):
            raise ValueError(f"session {sid}: a shard of {kv.length} rows is not rank {self.rank}'s part of {length}")
        if sid in self.kv:
            raise ValueError(f"session {sid} already has a shard on rank {self.rank}")
        self.kv[sid] = kv
        self.lengths[sid] = length

    def close(self, sid: int) -> None:
        kv = self.kv.pop(sid, None)
        self.lengths.pop(sid, None)
        if kv is not None and self.on_close is not None:
            self.on_close(sid, kv)

    def close_all(self) -> None:
        for sid in list(self.kv):
            self.close(sid)

    def truncate(self, sid: int, length: int) -> None:
        self.kv[sid].truncate(shard_length(length, self.rank, self.n))
        self.lengths[sid] = length

    def get(self, sid: int) -> KVCache:
        try:
            return self.kv[sid]
        except KeyError:
            raise KeyError(f"no shard of session {sid} on rank {self.rank}") from None
