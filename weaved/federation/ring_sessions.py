"""Putting a session on the current ring: opening it, rebuilding it from its transcript, and the
pipeline prefill that fills its shards (mixed into ``RingBackend``; its lock is held).

- **Open first.**  A session comes onto a ring by ``open_session`` with empty shards: every node
  reserves its part under its KV cap, and one that cannot refuses before any work is done
  (``ShardRefused``, the ring goes on).  A transcript is then prefilled into those shards.
- **Pipeline or ring steps.**  A prefill of at least ``pipeline_min_tokens`` from position 0 runs as
  one pipeline prefill over the ring's own group when it has at least two ranks and no more ranks than
  the model has layers; its ``SCATTER`` hand-off writes into the shards just opened
  (``node_group.reuse_open``).  Otherwise the tokens go through ring steps of ``REPLAY_CHUNK``.
- **Layer split** in proportion to each node's prefill speed: this node's measured on its CPU backend
  (once it has prefilled enough to say), a peer's from its report (measured, or its profile's figure).
"""

from __future__ import annotations

import time

import numpy as np

from weaved.backends.base import Logits, SeqChunk
from weaved.federation.handoff import Handoff
from weaved.federation.node_group import HomeGroup
from weaved.federation.node_report import measured_prefill_rate
from weaved.federation.pipeline import split_layers
from weaved.federation.qring import RingChunk, ShardRefused
from weaved.federation.ring_kv import RingKV
from weaved.federation.shards import shard_length
from weaved.kv.errors import KVStoreError

REPLAY_CHUNK = 512  # tokens per ring step when a transcript is prefilled through the ring


class RingSessions:
    """Needs: ``config``, ``cpu``, ``peers``, ``_members``, ``_epoch``, ``pipeline_min_tokens``,
    ``default_speed``, ``counters``, ``labels``, ``_publish``."""

    def _place(self, home: HomeGroup, kv: RingKV) -> None:
        """Make sure ``kv`` is open on ``home``'s ring with its whole transcript in the shards (and no
        more: a transcript cut since the last step is cut on the ring now)."""
        if kv.epoch == self._epoch:
            if kv.ring_cut:
                home.ring.truncate(kv.rid, kv.length)
                kv.ring_cut = False
            return
        kv.ring_cut = False  # opened anew below: the shards are made from the transcript as it is
        if kv.rid in home.ring.capacity:  # a stale open from a step that failed half-way
            home.ring.close_session(kv.rid)
        n = home.group.world_size
        try:
            home.ring.open_session(kv.rid, kv.capacity)
        except (ShardRefused, KVStoreError) as e:
            raise ShardRefused(f"the ring of {n} node(s) has no room for this session's KV ({kv.capacity} positions, "
                               f"{shard_length(kv.capacity, 0, n)} on each node): {e}") from None
        kv.epoch = self._epoch
        if kv.length:
            self._rebuild(home, kv)

    def _rebuild(self, home: HomeGroup, kv: RingKV) -> None:
        """Prefill the transcript (the home's record of every token the session's KV held) into the
        shards just opened."""
        t0 = time.perf_counter()
        ids = np.asarray(kv.tokens, np.int32)
        via = "pipeline"
        if self._pipeline(home, kv, ids) is None:
            via = "ring"
            for a in range(0, len(ids), REPLAY_CHUNK):
                home.ring.step([RingChunk(kv.rid, ids[a : a + REPLAY_CHUNK], Logits.NONE)])
        self.counters["rebuilt_sessions"] += 1
        self.counters["rebuilt_tokens"] += len(ids)
        self._publish("ring_rebuild", {"session": self.labels.get(kv.rid), "tokens": len(ids), "via": via,
                                       "ring": home.group.name, "seconds": round(time.perf_counter() - t0, 3)})

    def _stages(self, home: HomeGroup) -> list[tuple[int, int]] | None:
        """Layer ranges for a pipeline over the group, or None when it cannot have one stage per rank."""
        n = home.group.world_size
        if n < 2 or n > self.config.n_layers:
            return None
        speeds = [measured_prefill_rate(self.cpu.stats) or self.default_speed]
        reports = {p["name"]: p for p in self.peers.list()}
        for p in self._members:
            sp = ((reports.get(p.name) or {}).get("speed") or {}).get("prefill_tokens_per_s")
            speeds.append(float(sp) if sp and sp > 0 else speeds[0])
        return split_layers(self.config.n_layers, speeds)

    def _pipeline(self, home: HomeGroup, kv: RingKV, tokens: np.ndarray) -> np.ndarray | None:
        """Prefill ``tokens`` (positions 0 ..) of the open, empty session ``kv`` through the group's
        pipeline into its shards; the last token's logits [1, vocab], or None when no pipeline fits."""
        ranges = self._stages(home)
        if ranges is None or len(tokens) < self.pipeline_min_tokens:
            return None
        res = home.pipe.prefill([kv.rid], [tokens], ranges=ranges, capacities=[kv.capacity],
                                handoff=Handoff.SCATTER)
        self.counters["pipeline_prefills"] += 1
        return res.logits[0]

    def _pipeline_first(self, home: HomeGroup, c: SeqChunk) -> np.ndarray | None:
        """An empty session's first chunk through the pipeline, or None (it then takes a ring step)."""
        kv = c.kv
        ids = np.asarray(c.tokens, np.int32)
        t0 = time.perf_counter()
        logits = self._pipeline(home, kv, ids)
        if logits is None:
            return None
        kv.tokens.extend(int(t) for t in ids)
        self._publish("pipeline_prefill", {"session": self.labels.get(kv.rid), "tokens": len(ids),
                                           "ring": home.group.name, "seconds": round(time.perf_counter() - t0, 3)})
        return logits if c.logits is Logits.LAST else logits[:0]
