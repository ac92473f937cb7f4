"""Per-step bookkeeping of a Q-Ring step on one rank: which rows of the step this rank's shards own,
how many shard rows each query may see, and the packet layout that travels the ring."""

from __future__ import annotations

import numpy as np

from weaved.federation.partial import ShardBatch
from weaved.federation.protocol import ProtocolError
from weaved.federation.shards import ShardTable, shard_length


def head_groups(n_kv_heads: int, per_group: int) -> list[tuple[int, int]]:
    """The kv heads [h0, h1) of each travelling head group, ``per_group`` heads a group, in order."""
    return [(h0, h0 + per_group) for h0 in range(0, n_kv_heads, per_group)]


class StepRows:
    """The rows of one step (session s contributes ns[s] tokens at positions pos0[s] ...) as seen by
    ``table``'s rank: the shards they attend, the rows it must store, the key count of each row."""

    def __init__(self, table: ShardTable, sids: np.ndarray, pos0: np.ndarray, ns: np.ndarray):
        r, n = table.rank, table.n
        self.table = table
        self.sids, self.pos0, self.ns = (np.asarray(a, np.int64) for a in (sids, pos0, ns))
        starts = np.zeros(len(ns) + 1, np.int64)
        starts[1:] = np.cumsum(self.ns)
        self.starts = starts
        self.n_rows = int(starts[-1])
        self.row_seq = np.repeat(np.arange(len(ns), dtype=np.int64), self.ns)  # [T]
        self.positions = np.arange(self.n_rows, dtype=np.int64) - starts[self.row_seq] + self.pos0[self.row_seq]  # [T]
        self.kvs = [table.get(int(sid)) for sid in self.sids]
        self.owned: list[tuple[np.ndarray, int, int, int]] = []  # (session index, rows, local l0, l1)
        for s, (sid, p0, m) in enumerate(zip(self.sids, self.pos0, self.ns, strict=True)):
            if table.lengths[int(sid)] != p0:
                raise ProtocolError(f"rank {r}: session {sid} is at {table.lengths[int(sid)]}, step says {p0}")
            first = p0 + (r - p0) % n  # first position of the chunk that lives here
            if first >= p0 + m:
                continue
            l0, l1 = first // n, shard_length(int(p0 + m), r, n)
            if l1 > self.kvs[s].capacity:
                raise ProtocolError(f"rank {r}: session {sid} shard full ({l1} > {self.kvs[s].capacity})")
            rows = np.arange(starts[s] + first - p0, starts[s + 1], n, dtype=np.int64)
            self.owned.append((s, rows, int(l0), int(l1)))
        # causality across shards: a query at position q sees this shard's rows of positions <= q
        n_keys = shard_length(self.positions + 1, r, n)
        self.batch = ShardBatch([kv.data for kv in self.kvs], self.row_seq, n_keys)

    def store(self, layer: int, h0: int, h1: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write the rows this rank owns of k, v (float32 [T, h1-h0, D], kv heads h0..h1-1) into the
        shards as float16 (numpy's cast rounds to nearest even, as the kernels' stores do)."""
        for s, rows, l0, l1 in self.owned:
            data = self.kvs[s].data  # [L, 2, Hkv, cap, D]
            data[layer, 0, h0:h1, l0:l1] = k[rows].transpose(1, 0, 2)
            data[layer, 1, h0:h1, l0:l1] = v[rows].transpose(1, 0, 2)

    def commit(self) -> None:
        """The step is complete: advance every session's full length and this rank's shard lengths."""
        t = self.table
        for sid, kv, p0, m in zip(self.sids, self.kvs, self.pos0, self.ns, strict=True):
            end = int(p0 + m)
            kv.length = shard_length(end, t.rank, t.n)
            t.lengths[int(sid)] = end


class Packet:
    """One head group's ring message, one float32 buffer: q [T, Gq, D] | k [T, hg, D] | v [T, hg, D]
    | out [T, Gq, D] | lse [T, Gq] (Gq = hg * query heads per kv head).  The tail ``out | lse`` is
    the travelling accumulator; the last member sends only the tail home (``with_qkv=False``
    allocates just that)."""

    def __init__(self, T: int, Gq: int, hg: int, D: int, with_qkv: bool = True):
        nq, nk, no = T * Gq * D, T * hg * D, T * Gq * D
        head = nq + 2 * nk if with_qkv else 0
        self.buf = np.empty(head + no + T * Gq, np.float32)
        b = self.buf
        if with_qkv:
            self.q = b[:nq].reshape(T, Gq, D)
            self.k = b[nq : nq + nk].reshape(T, hg, D)
            self.v = b[nq + nk : head].reshape(T, hg, D)
        self.out = b[head : head + no].reshape(T, Gq, D)
        self.lse = b[head + no :].reshape(T, Gq)
        self.tail = b[head:]
