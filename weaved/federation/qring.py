"""Q-Ring decode: KV shards stay on their nodes, only queries (and the new tokens' K/V) travel.

A ring is one ``PeerGroup``; rank 0 is the home of the ring's sessions (a daemon that homes ring
sessions forms a ring with itself at rank 0; a daemon may be a member of several rings).  The home
holds the weights and runs every dense layer (one product over all rows of the step, as the CPU
backend does); every rank, the home included, holds a shard of every ring session's KV
(``shards``: position p on rank p mod N) and computes attention over it.

One step, per layer (N = 3, head groups g0, g1 of the kv heads)::

    home (rank 0)                      rank 1                         rank 2
    q,k,v = dense(x)  ── g0: q|k|v|acc ──▶ store own k,v; acc ⊕= attn(q, shard1) ── g0 ──▶ store; acc ⊕= attn(q, shard2)
                      ── g1: q|k|v|acc ──▶   (g1 arrives while g0 computes)      ── g1 ──▶       │
    own = attn(q, shard0)  (while the packets travel)                                           │
    att = own ⊕ acc   ◀──────────────────────────── g0, g1: out|lse (acc only) ─────────────────┘
    x = dense(x, att)

``⊕`` is the float32 online-softmax merge of (out, lse) pairs; a packet's accumulator holds the
attention over every shard it has visited, so it is complete when it comes home: no All2All.  The
new tokens' K/V ride along with their queries, and the rank that owns a position (position mod N)
stores it before it attends, so shards grow round-robin and stay balanced.

Home API (rank 0): ``open_session``, ``step``, ``truncate``, ``close_session``, ``ping``, ``stop``;
members run ``serve()`` until the home stops the ring or a peer is lost.  A chunk may hold several
tokens (a new turn's prompt): each row sees only the shard rows of older positions (and itself).
Every operation has the group's timeout; a lost peer raises ``PeerLost`` on every survivor, and the
group is then closed for good (a later step re-forms a ring; that is the control plane's job).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from weaved.backends.base import Logits
from weaved.federation import protocol as P
from weaved.federation.comm import PeerGroup, PeerLost, wait_all
from weaved.federation.layers import LayerRunner, split_rows, wanted_rows
from weaved.federation.partial import merge
from weaved.federation.ring_rows import Packet, StepRows, head_groups
from weaved.federation.ring_serve import HOME, RingServe
from weaved.federation.shards import KVFactory, ShardTable, split_kv
from weaved.kernels.threads import on_kernel_thread
from weaved.kv.cache import KVCache
from weaved.model.config import ModelConfig


class ShardRefused(ValueError):
    """A member could not open a session's shard (its KV cap, its disk); the ring itself is fine."""

    http_status = 503  # the ring is full: retry later, or free sessions


@dataclass(frozen=True)
class RingChunk:
    """One ring session's part of a step: ``tokens`` at the session's next positions."""

    sid: int
    tokens: np.ndarray  # [n] int32, n >= 1
    logits: Logits = Logits.LAST


@dataclass
class RingStats:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0  # the home blocked on returning packets: ring time the overlap did not hide


def check_heads_per_group(n_kv_heads: int, heads_per_group: int) -> None:
    """ValueError unless ``heads_per_group`` (the profile's ``ring_heads_per_group``: kv heads per
    travelling packet) divides the model's kv heads."""
    if heads_per_group < 1 or n_kv_heads % heads_per_group:
        ok = ", ".join(str(d) for d in range(1, n_kv_heads + 1) if n_kv_heads % d == 0)
        raise ValueError(f"[federation] ring_heads_per_group = {heads_per_group} must divide the model's "
                         f"{n_kv_heads} kv heads (e.g. {ok})")


class RingMember(RingServe):
    """This daemon's place in one ring: the home's driver (rank 0) or a member's serve loop
    (``RingServe.serve``).  Home operations check their arguments before the first message; once a
    message is out, any failure closes the ring (the members are mid-protocol) and propagates."""

    def __init__(self, group: PeerGroup, config: ModelConfig, runner: LayerRunner | None = None,
                 kv_factory: KVFactory | None = None, heads_per_group: int = 1,
                 on_close: Callable[[int, KVCache], None] | None = None):
        if group.rank == HOME and (runner is None or runner.first != 0 or runner.last != config.n_layers):
            raise ValueError("the home needs a LayerRunner over every layer")
        check_heads_per_group(config.n_kv_heads, heads_per_group)
        self.group, self.config, self.runner = group, config, runner
        self.shards = ShardTable(config, group.rank, group.world_size, kv_factory, on_close)
        self.capacity: dict[int, int] = {}  # home: each open session's capacity (all shards)
        self.heads_per_group = heads_per_group
        self.scale = config.scores_scale  # the CPU backend's float
        self.stats = RingStats()
        # one home operation at a time (step, ping, open ...); a pipeline member on the same rank shares it
        self.lock = threading.Lock()

    def _home(self, what: str) -> None:
        if self.group.rank != HOME:
            raise RuntimeError(f"{what} is the home's (rank 0) operation")

    def _guard(self, fn, *args):
        """Run the messaging part of a home operation (the lock already held)."""
        try:
            return fn(*args)
        except ShardRefused:  # every member answered: the protocol is in step, the ring stays usable
            raise
        except BaseException:
            self.group.close()
            raise

    def leave(self) -> None:
        """Leave the ring now (any rank): the group is aborted, so the others raise ``PeerLost`` at
        once (a member's ``serve`` in another thread included)."""
        self.group.close()

    # ---- home: sessions --------------------------------------------------------------------------------

    def open_session(self, sid: int, capacity: int, kv: KVCache | None = None, held_length: int | None = None) -> None:
        """Give session ``sid`` a shard of ``capacity`` positions on every rank.  Its history comes
        from ``kv`` (a full cache, e.g. a standard prefill's: split and sent), or is already held by
        every rank (``held_length``: shards adopted from a pipeline prefill), or is empty."""
        self._home("open_session")
        cfg, n = self.config, self.n
        with self.lock:
            if sid in self.capacity:
                raise ValueError(f"session {sid} is already open on this ring")
            if kv is not None:
                mode, length, rows = P.Rows.SENT, kv.length, split_kv(kv.data, kv.length, n)
            elif held_length is not None:
                mode, length, rows = P.Rows.HELD, held_length, None
            else:
                mode, length, rows = P.Rows.NONE, 0, None
            if not 0 <= length <= capacity:
                raise ValueError(f"length {length} outside capacity {capacity}")
            if mode == P.Rows.HELD:
                if self.shards.lengths.get(sid) != length:
                    raise KeyError(f"no adopted shard of session {sid} at length {length} on the home")
            else:
                self.shards.open(sid, capacity, length, rows[0] if rows else None)  # a full disk fails here
            shape = np.array([cfg.n_layers, cfg.n_kv_heads, cfg.head_dim], np.int64)

            def send() -> None:
                pend = []
                for r in range(1, n):
                    pend += P.send_cmd(self.group, r, P.Cmd.OPEN, sid, capacity, length, int(mode), body=shape)
                    if mode == P.Rows.SENT:
                        pend.append(self.group.isend(rows[r], r, P.TAG_LOAD))
                wait_all(pend)
                try:
                    P.recv_acks(self.group, f"open session {sid}")
                except P.ProtocolError as e:  # a member cannot hold its shard: undo the others' opens
                    wait_all(P.broadcast_cmd(self.group, P.Cmd.CLOSE, sid))
                    raise ShardRefused(f"session {sid}: a member could not hold its shard (its KV cap or "
                                       f"disk): {e}") from None

            try:
                self._guard(send)
            except BaseException:
                self.shards.close(sid)
                raise
            self.capacity[sid] = capacity

    def close_session(self, sid: int) -> None:
        self._home("close_session")
        with self.lock:
            self._guard(lambda: wait_all(P.broadcast_cmd(self.group, P.Cmd.CLOSE, sid)))
            self.shards.close(sid)
            self.capacity.pop(sid, None)

    def truncate(self, sid: int, length: int) -> None:
        """Forget positions from ``length`` on (a cancelled turn); every shard drops its part."""
        self._home("truncate")
        with self.lock:
            if not 0 <= length <= self.shards.lengths[sid]:
                raise ValueError(f"cannot truncate session {sid} of length {self.shards.lengths[sid]} to {length}")
            self._guard(lambda: wait_all(P.broadcast_cmd(self.group, P.Cmd.TRUNCATE, sid, length)))
            self.shards.truncate(sid, length)

    def ping(self) -> None:
        """Round trip to every member (they treat a long silence from the home as its loss)."""
        self._home("ping")
        with self.lock:
            self._guard(lambda: (wait_all(P.broadcast_cmd(self.group, P.Cmd.PING)), P.recv_acks(self.group, "ping")))

    def stop(self) -> None:
        """Release the members' serve loops and leave the ring."""
        self._home("stop")
        with self.lock:
            try:
                wait_all(P.broadcast_cmd(self.group, P.Cmd.STOP))
            except PeerLost:
                pass
            self.group.close()

    # ---- home: one step ------------------------------------------------------------------------------

    def step(self, chunks: list[RingChunk]) -> list[np.ndarray]:
        """One forward step of ring sessions batched together; one float32 logits array per chunk
        (``[1, vocab]`` LAST, ``[n, vocab]`` ALL, ``[0, vocab]`` NONE).  Lengths advance on return;
        on ``PeerLost`` (or any failure once the step is under way) nothing advanced and the ring is
        closed."""
        self._home("step")
        if not chunks:
            return []
        cfg = self.config
        with self.lock:
            sids = np.array([c.sid for c in chunks], np.int64)
            ns = np.array([len(c.tokens) for c in chunks], np.int64)
            if len(set(sids.tolist())) != len(sids):
                raise ValueError("a session appears twice in one step")
            for c, m in zip(chunks, ns, strict=True):
                if c.sid not in self.capacity:
                    raise KeyError(f"session {c.sid} is not open on this ring")
                if m < 1 or self.shards.lengths[c.sid] + m > self.capacity[c.sid]:
                    raise ValueError(f"session {c.sid}: {m} tokens do not fit (capacity {self.capacity[c.sid]})")
            ids = np.concatenate([np.asarray(c.tokens, np.int32) for c in chunks])  # [T]
            if ids.min() < 0 or ids.max() >= cfg.vocab_size:
                raise ValueError(f"token id out of range [0, {cfg.vocab_size})")
            pos0 = np.array([self.shards.lengths[int(s)] for s in sids], np.int64)
            return self._guard(self._step, chunks, ids, StepRows(self.shards, sids, pos0, ns))

    def _step(self, chunks: list[RingChunk], ids: np.ndarray, rows: StepRows) -> list[np.ndarray]:
        t0 = time.perf_counter()
        cfg = self.config
        body = np.concatenate([rows.sids, rows.pos0, rows.ns])
        pend = P.broadcast_cmd(self.group, P.Cmd.STEP, len(chunks), rows.n_rows, self.heads_per_group, body=body)
        x = self.runner.embed(ids)  # [T, d_model]
        att = np.empty((rows.n_rows, cfg.n_heads, cfg.head_dim), np.float32)
        qkv = self.runner.pre_attention(0, x, rows.positions)
        for li in range(cfg.n_layers):
            self._home_attention(li, *qkv, rows, att)
            qkv = self._dense_between(li, x, att, rows.positions)
        wait_all(pend)
        starts = rows.starts[:-1]
        want = [wanted_rows(c.logits, int(s), int(m)) for c, s, m in zip(chunks, starts, rows.ns, strict=True)]
        logits = self.runner.logits(x[[r for w in want for r in w]])
        rows.commit()
        st = self.stats
        st.steps += 1
        st.tokens += rows.n_rows
        st.seconds += time.perf_counter() - t0
        return split_rows(logits, [len(w) for w in want])

    @on_kernel_thread
    def _dense_between(self, li: int, x: np.ndarray, att: np.ndarray, positions: np.ndarray) -> tuple:
        """Layer ``li`` after attention, then layer ``li + 1`` up to it (q, k, v; Nones after the last layer):
        one call on the kernel thread, where the two would be two hand-offs (~20 us each)."""
        self.runner.post_attention(li, x, att)
        if li + 1 == self.config.n_layers:
            return None, None, None
        return self.runner.pre_attention(li + 1, x, positions)

    def _home_attention(self, li: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, rows: StepRows,
                        att: np.ndarray) -> None:
        """Layer ``li``'s attention around the ring into att [T, H, D]: q [T, H, D], k and v [T, Hkv, D]
        (the per-layer exchange; a subclass that exchanges otherwise replaces this)."""
        cfg, n, hg = self.config, self.n, self.heads_per_group
        G, D, T = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim, rows.n_rows
        groups = head_groups(cfg.n_kv_heads, hg)
        sends, rets = [], []
        if n > 1:  # every head group leaves at once; rank 1 starts on g0 while the rest is on the wire
            for g, (h0, h1) in enumerate(groups):
                pk = Packet(T, hg * G, hg, D)
                pk.q[...] = q[:, h0 * G : h1 * G]
                pk.k[...] = k[:, h0:h1]
                pk.v[...] = v[:, h0:h1]
                pk.out.fill(0.0)
                pk.lse.fill(-np.inf)  # an empty accumulator: the first merge takes the partial as is
                tag = P.TAG_RING + li * len(groups) + g
                sends.append(self.group.isend(pk.buf, 1, tag))
                ret = Packet(T, hg * G, hg, D, with_qkv=False)
                rets.append((ret, self.group.irecv(ret.buf, n - 1, tag)))
        rows.store(li, 0, cfg.n_kv_heads, k, v)
        for g, (out, lse) in enumerate(self._local_partials(li, q, groups, rows)):
            if n > 1:
                out, lse = self._merge_back(out, lse, *rets[g])
            h0, h1 = groups[g]
            att[:, h0 * G : h1 * G] = out
        wait_all(sends)

    @on_kernel_thread
    def _local_partials(self, li: int, q: np.ndarray, groups: list[tuple[int, int]], rows: StepRows) -> list:
        """This node's part of every head group's attention at layer ``li``, (out, lse) per group, in one
        call on the kernel thread (a hand-off per group would cost ~20 us each)."""
        G = self.config.n_heads // self.config.n_kv_heads
        return [rows.batch.attend(np.ascontiguousarray(q[:, h0 * G : h1 * G]), li, h0, h1, self.scale)
                for h0, h1 in groups]

    def _merge_back(self, out: np.ndarray, lse: np.ndarray, ret: Packet, pending) -> tuple[np.ndarray, np.ndarray]:
        """Wait for a returning packet (timed: the ring time the overlap did not hide) and merge its
        partial attention into (out, lse)."""
        t = time.perf_counter()
        pending.wait()
        self.stats.wait_seconds += time.perf_counter() - t
        return merge(out, lse, ret.out, ret.lse)

    # ---- liveness ------------------------------------------------------------------------------------

    def start_keepalive(self, interval_s: float) -> threading.Thread:
        """Home: ping the members every ``interval_s`` (below their ``idle_timeout_s``) until the ring
        closes; a failed ping closes the ring, so the next step raises ``PeerLost`` at once."""
        self._home("keepalive")

        def run() -> None:
            while not self.group.broken:
                time.sleep(interval_s)
                try:
                    self.ping()
                except (PeerLost, P.ProtocolError):
                    return

        t = threading.Thread(target=run, name=f"ring-keepalive-{self.group.name}", daemon=True)
        t.start()
        return t
