"""One group a home daemon forms with its peers, serving both federated strategies on the same ranks.

A home's ring and its pipeline prefills share one ``PeerGroup``: a pipeline prefill that scatters its
KV by position (``Handoff.SCATTER``) then lands each rank's rows straight in the shard table of the
ring that decodes the session, with no second transfer.  The two protocols take turns on the group
under one lock (the ring's), so a keep-alive ping never interleaves with a prefill.

``HomeGroup`` is rank 0's side; ``serve_member`` is the loop a member daemon runs for the group until
the home stops it or a peer is lost.
"""

from __future__ import annotations

from collections.abc import Callable

from weaved.backends.cpu import CPUBackend
from weaved.federation import protocol as P
from weaved.federation.comm import PeerGroup
from weaved.federation.layers import LayerRunner
from weaved.federation.pipeline import PipelineMember
from weaved.federation.qring import RingMember
from weaved.federation.shards import KVFactory
from weaved.kv.cache import KVCache

OnClose = Callable[[int, KVCache], None]


def reuse_open(ring: RingMember, make: KVFactory, targets: dict[int, KVCache] | None = None) -> KVFactory:
    """The pipeline's hand-off caches: a session the home already opened on the ring (empty shards,
    their room reserved on every rank, so a full node refused it cleanly before any work) hands its
    empty shard to the pipeline, which fills it and gives it back to the ring (``ShardTable.adopt``).
    ``targets`` (the home's): full caches a ``GATHER`` hand-off writes into (a standard session's file)."""

    def factory(sid: int, capacity: int) -> KVCache:
        if targets is not None and sid in targets:
            return targets[sid]
        kv = ring.shards.kv.get(sid)
        if kv is not None and kv.length == 0 and ring.shards.lengths.get(sid) == 0 and kv.capacity >= capacity:
            del ring.shards.kv[sid], ring.shards.lengths[sid]  # adopt puts it back, with its rows
            return kv
        return make(sid, capacity)

    return factory


class HomeGroup:
    """Rank 0 of a group: the ring's home and the pipeline's first stage."""

    def __init__(self, group: PeerGroup, backend: CPUBackend, kv_factory: KVFactory, on_close: OnClose,
                 heads_per_group: int = 1):
        if group.rank != 0:
            raise ValueError("the home is rank 0")
        self.group = group
        self.ring = RingMember(group, backend.config, LayerRunner(backend), kv_factory=kv_factory,
                               heads_per_group=heads_per_group, on_close=on_close)
        self.targets: dict[int, KVCache] = {}  # sid -> the cache a GATHER hand-off fills (not a shard)
        self.pipe = PipelineMember(group, backend, kv_factory=reuse_open(self.ring, kv_factory, self.targets),
                                   on_kv=self._landed, lock=self.ring.lock)

    def _landed(self, sid: int, kv: KVCache, length: int) -> None:
        if sid not in self.targets:  # a SCATTER's shard: the ring's now
            self.ring.shards.adopt(sid, kv, length)

    def stop(self) -> None:
        """Release the members and free this rank's shards."""
        try:
            self.ring.stop()
        finally:
            self.ring.shards.close_all()


def serve_member(group: PeerGroup, backend: CPUBackend, kv_factory: KVFactory, on_close: OnClose) -> None:
    """A member's loop: ring commands and pipeline prefills from the home until STOP.  Raises
    ``PeerLost`` / ``ProtocolError`` as the ring's and pipeline's loops do; the group is closed and this
    rank's shards freed either way."""
    if group.rank == 0:
        raise ValueError("rank 0 is the home; members serve")
    ring = RingMember(group, backend.config, kv_factory=kv_factory, on_close=on_close)
    pipe = PipelineMember(group, backend, kv_factory=reuse_open(ring, kv_factory), on_kv=ring.shards.adopt,
                          lock=ring.lock)
    try:
        while True:
            cmd, args, body = P.recv_cmd(group, 0, group.spec.idle_timeout_s)
            if cmd == P.Cmd.STOP:
                return
            if cmd == P.Cmd.PREFILL:
                pipe.serve_prefill(args, body)
            else:
                ring.serve_cmd(cmd, args, body)
    finally:
        group.close()
        ring.shards.close_all()
