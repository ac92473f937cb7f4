"""The member side of a Q-Ring: follow the home's commands, hold this rank's shards, and add this
rank's partial attention to every packet that passes (see ``qring`` for the step)."""

from __future__ import annotations

import numpy as np

from weaved.federation import protocol as P
from weaved.federation.comm import PeerGroup, wait_all
from weaved.federation.partial import merge
from weaved.federation.ring_rows import Packet, StepRows, head_groups
from weaved.federation.shards import ShardTable, shard_length
from weaved.model.config import ModelConfig

HOME = 0


class RingServe:
    """Mixed into ``RingMember``: what a rank other than the home runs."""

    group: PeerGroup
    config: ModelConfig
    shards: ShardTable
    scale: float

    @property
    def n(self) -> int:
        return self.group.world_size

    def serve(self) -> None:
        """A member's loop: follow the home's commands until STOP.  Raises ``PeerLost`` when the home
        or a neighbour is lost (or the home stays silent past ``idle_timeout_s``), ``ProtocolError``
        on a command it cannot follow; either way the group is closed first."""
        if self.group.rank == HOME:
            raise RuntimeError("the home drives the ring; members serve")
        try:
            while True:
                cmd, args, body = P.recv_cmd(self.group, HOME, self.group.spec.idle_timeout_s)
                if cmd == P.Cmd.STOP:
                    break
                self.serve_cmd(cmd, args, body)
        finally:
            self.group.close()

    def serve_cmd(self, cmd: P.Cmd, args: np.ndarray, body: np.ndarray) -> None:
        g = self.group
        if cmd == P.Cmd.PING:
            P.send_ack(g, HOME)
        elif cmd == P.Cmd.CLOSE:
            self.shards.close(int(args[0]))
        elif cmd == P.Cmd.TRUNCATE:
            self.shards.truncate(int(args[0]), int(args[1]))
        elif cmd == P.Cmd.OPEN:
            self._serve_open(*(int(a) for a in args[:4]), body)
        elif cmd == P.Cmd.STEP:
            S, hg = int(args[0]), int(args[2])
            self._serve_step(StepRows(self.shards, body[:S], body[S : 2 * S], body[2 * S : 3 * S]), hg)
        else:
            raise P.ProtocolError(f"rank {g.rank}: unexpected command {cmd.name} on a ring")

    def _serve_open(self, sid: int, capacity: int, length: int, mode: int, shape: np.ndarray) -> None:
        cfg, r = self.config, self.group.rank
        L, Hkv, D = (int(a) for a in shape)
        rows = None
        if mode == P.Rows.SENT:  # receive first (its size is the home's to say), then judge
            rows = self.group.recv(np.empty((L, 2, Hkv, shard_length(length, r, self.n), D), np.float16),
                                   HOME, P.TAG_LOAD)
        status = 0
        try:
            if (L, Hkv, D) != (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
                raise ValueError(f"model shape {(L, Hkv, D)} is not this rank's")
            if mode == P.Rows.HELD:
                if self.shards.lengths.get(sid) != length:
                    raise ValueError(f"no held shard of session {sid} at length {length}")
            else:
                self.shards.open(sid, capacity, length, rows)
        except Exception:  # a bad shape, no room under this node's KV cap, a full disk
            status = 1  # the home undoes the open on every rank and reports it; the ring goes on
        P.send_ack(self.group, HOME, status)

    def _serve_step(self, rows: StepRows, hg: int) -> None:
        cfg, g, n, r = self.config, self.group, self.n, self.group.rank
        G, D, T = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim, rows.n_rows
        groups = head_groups(cfg.n_kv_heads, hg)
        nxt = (r + 1) % n
        for li in range(cfg.n_layers):
            pks = [Packet(T, hg * G, hg, D) for _ in groups]
            recvs = [g.irecv(pk.buf, r - 1, P.TAG_RING + li * len(groups) + j) for j, pk in enumerate(pks)]
            sends = []
            for j, ((h0, h1), pk, rv) in enumerate(zip(groups, pks, recvs, strict=True)):
                rv.wait()  # group j+1 keeps arriving while j computes
                rows.store(li, h0, h1, pk.k, pk.v)
                out, lse = rows.batch.attend(pk.q, li, h0, h1, self.scale)
                pk.out[...], pk.lse[...] = merge(pk.out, pk.lse, out, lse)
                sends.append(g.isend(pk.buf if nxt != HOME else pk.tail, nxt, P.TAG_RING + li * len(groups) + j))
            wait_all(sends)
        rows.commit()
