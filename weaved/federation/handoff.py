"""After a pipeline prefill: hand each stage's KV (its own layers, every position) to the decode
strategy's layout.

- ``GATHER`` (standard decode on one node): rank ``dst`` assembles every layer into one full cache
  per session, ``[n_layers, 2, Hkv, capacity, D]``.
- ``SCATTER`` (Q-Ring decode): rank r assembles every layer of the positions p with p mod N == r
  (``shards``), the shard layout the ring appends to.
- ``KEEP``: no transfer; each stage keeps its layers' cache (layer axis counted from its first layer).

Each (source stage, destination rank) pair exchanges one message: the sessions' blocks, float16,
back to back.  Every rank posts its receives before its sends, so the exchange cannot deadlock.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from weaved.federation.comm import PeerGroup, wait_all
from weaved.federation.protocol import TAG_KV
from weaved.federation.shards import KVFactory, shard_length, shard_positions
from weaved.kv.cache import KVCache
from weaved.model.config import ModelConfig


class Handoff(IntEnum):
    KEEP = 0
    GATHER = 1
    SCATTER = 2


def _positions(mode: Handoff, length: int, r: int, n: int) -> slice:
    return slice(0, length) if mode == Handoff.GATHER else shard_positions(length, r, n)


def _n_positions(mode: Handoff, length: int, r: int, n: int) -> int:
    return length if mode == Handoff.GATHER else shard_length(length, r, n)


def hand_off(group: PeerGroup, config: ModelConfig, mode: Handoff, dst: int, ranges: list[tuple[int, int]],
             stage_kv: list[KVCache], sids: list[int], lens: list[int], caps: list[int], kv_factory: KVFactory
             ) -> list[KVCache]:
    """Run this rank's part of the hand-off; returns the caches that land here, one per session
    (none for GATHER on a rank other than ``dst``; the stage caches themselves for KEEP)."""
    if mode == Handoff.KEEP:
        return stage_kv
    n, me = group.world_size, group.rank
    Hkv, D = config.n_kv_heads, config.head_dim
    receivers = [dst] if mode == Handoff.GATHER else list(range(n))
    out: list[KVCache] = []
    recvs = []
    if me in receivers:  # allocate the destination caches and post a receive per other stage
        for sid, cap in zip(sids, caps, strict=True):
            out.append(kv_factory(int(sid), cap if mode == Handoff.GATHER else shard_length(cap, me, n)))
        for src in range(n):
            if src == me:
                continue
            a, b = ranges[src]
            size = sum((b - a) * 2 * Hkv * _n_positions(mode, m, me, n) * D for m in lens)
            buf = np.empty(size, np.float16)
            recvs.append((src, buf, group.irecv(buf, src, TAG_KV)))
    sends = []
    for r in receivers:
        if r == me:
            continue
        blocks = [kv.data[:, :, :, _positions(mode, m, r, n)].reshape(-1) for kv, m in zip(stage_kv, lens, strict=True)]
        sends.append(group.isend(np.concatenate(blocks) if blocks else np.zeros(0, np.float16), r, TAG_KV))
    if me in receivers:
        a, b = ranges[me]
        for kv, m, dest in zip(stage_kv, lens, out, strict=True):  # this stage's own layers
            k = _n_positions(mode, m, me, n)
            dest.data[a:b, :, :, :k] = kv.data[:, :, :, _positions(mode, m, me, n)]
            dest.length = k
        for src, buf, pending in recvs:
            pending.wait()
            a, b = ranges[src]
            o = 0
            for m, dest in zip(lens, out, strict=True):
                k = _n_positions(mode, m, me, n)
                size = (b - a) * 2 * Hkv * k * D
                dest.data[a:b, :, :, :k] = buf[o : o + size].reshape(b - a, 2, Hkv, k, D)
                o += size
    wait_all(sends)
    return out
