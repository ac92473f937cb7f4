"""The backend of a ``qring`` pool: the home daemon's ring sessions, decoded across its peers.

The batch engine drives it like any backend (``forward`` over a ragged batch, sampling and stops in
the engine), so ring sessions get the daemon's scheduling, streaming, journal and cancellation.
Underneath, each step is one ``RingMember.step`` of every ring session in the batch.

- **The ring** is formed on the first step, with every live peer that serves our model
  (``PeerRegistry.usable``), through their control planes (``ring_form``).  Rank 0 is this daemon.
- **Sessions** are ``RingKV``: a capacity and a transcript.  A session steps on the ring once it has
  been opened there; one whose shards no ring holds (new, after a restart, after a loss) is rebuilt
  first: opened, and its transcript prefilled through the ring (or, when it is long and the ring has
  stages enough, through a pipeline prefill of the same group that scatters straight into the ring's
  shards).  Its first prompt chunk, when long, takes the pipeline the same way.
- **Failure.**  A step that loses a peer (``PeerLost``) advances nothing.  The backend records the
  loss (``ring_lost`` event), re-checks the peers at once, forms a new ring of the survivors (a new
  group name: an epoch suffix) and retries the step; every session of the old ring is rebuilt from
  its transcript when it next steps.  The turn in flight completes; nothing the user sent is lost.

Thread safety: the engine thread calls ``forward``; ``truncate``/``drop`` come from the API thread
and ``close`` from shutdown; one lock serializes them (a ring carries one operation at a time).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from weaved.backends.base import Backend, BackendStats, Logits, SeqChunk
from weaved.backends.cpu import CPUBackend
from weaved.config.profile import PeerConfig
from weaved.federation.comm import PeerLost, host_store
from weaved.federation.handoff import Handoff
from weaved.federation.node_group import HomeGroup
from weaved.federation.qring import RingChunk, ShardRefused
from weaved.federation.ring_form import FormSpec, JoinFailed, form_group
from weaved.federation.ring_kv import RingKV
from weaved.federation.ring_sessions import RingSessions
from weaved.federation.shard_files import delete_group_files, group_prefix, shard_files
from weaved.federation.shards import shard_length
from weaved.kv.cache import KVCache
from weaved.kv.store import KVStore

log = logging.getLogger("weave.federation")
MAX_FORMS = 3  # ring formations one step may try before its turn fails


class RingUnavailable(RuntimeError):
    """No ring could be formed (the message says why); the turn fails, the daemon goes on."""

    http_status = 503


class RingBackend(RingSessions, Backend):
    def __init__(self, cpu: CPUBackend, peers, store: KVStore, spec: FormSpec, *, heads_per_group: int = 1,
                 pipeline_min_tokens: int = 8192, default_speed: float = 1.0,
                 publish: Callable[[str, dict], None] = lambda k, d: None, node_tokens: int | None = None):
        self.config = cpu.config
        self.cpu, self.peers, self.store, self.spec = cpu, peers, store, spec
        self.heads_per_group = heads_per_group
        self.pipeline_min_tokens = pipeline_min_tokens
        self.default_speed = default_speed  # this node's prefill rate until it has measured one
        # the context one node should hold of a session (the profile's [routing] node_kv_tokens; None: its
        # KV cap alone): a ring whose sessions hold more on a node, because peers were lost, spreads them
        # again over returning peers
        self.node_tokens = node_tokens
        self.stats = BackendStats()
        self._publish = publish
        self._lock = threading.RLock()
        self._rids = itertools.count(1)
        self._home: HomeGroup | None = None
        self._members: list[PeerConfig] = []
        self._epoch = 0
        self._tcp_store = None
        self.labels: dict[int, str] = {}  # rid -> the daemon's session id, for events
        self.counters = {"formed": 0, "lost": 0, "rebuilt_sessions": 0, "rebuilt_tokens": 0, "pipeline_prefills": 0}

    @property
    def name(self) -> str:
        return "qring"

    @property
    def host_parallel(self) -> bool:
        return True

    # ---- sessions ----------------------------------------------------------------------------------
    def new_kv(self, capacity: int, tokens=(), label: str | None = None) -> RingKV:  # type: ignore[override]
        kv = RingKV(next(self._rids), capacity, tokens, on_truncate=self._truncate)
        if label is not None:
            self.labels[kv.rid] = label
        return kv

    def _truncate(self, kv: RingKV, length: int) -> None:
        """No network here (the daemon may hold its lock): the shards are cut at the session's next
        placement (``_place``), on the engine thread."""
        kv.ring_cut = True

    def drop(self, kv) -> int:
        """The session is deleted: close it on the ring (its shards' files go on every node).  A step
        already prepared with it does not open it again (``_step``)."""
        with self._lock:
            self.labels.pop(getattr(kv, "rid", -1), None)
            if not isinstance(kv, RingKV):
                return 0
            kv.dropped = True
            if self._usable() and kv.rid in self._home.ring.capacity:  # (a stale open from a failed step too)
                try:
                    self._home.ring.close_session(kv.rid)
                except PeerLost as e:
                    self._lost(e)
            kv.epoch = None
        return 0

    # ---- the ring ----------------------------------------------------------------------------------
    def _usable(self) -> bool:
        return self._home is not None and not self._home.group.broken

    def _form(self) -> HomeGroup:
        if self._tcp_store is None:
            self._tcp_store = host_store(self.spec.host, 0, self.spec.timeout_s)
        peers = list(self.peers.usable())
        why = ""
        for _ in range(MAX_FORMS):
            self._epoch += 1
            name = f"ring-{self.spec.home}-{self._epoch}"
            try:
                group = form_group(name, peers, self._tcp_store, self.spec)
            except JoinFailed as e:
                for p, reason in e.failures:
                    self.peers.mark_dead(p.name, f"did not join ring {name}: {reason}")
                peers = [p for p in peers if p not in {f[0] for f in e.failures}]
                why = str(e)
                continue
            except PeerLost as e:  # a peer accepted but never joined: re-check who is alive
                self.peers.check_now()
                peers = list(self.peers.usable())
                why = str(e)
                continue
            make, close = shard_files(self.store, group_prefix(name))
            home = HomeGroup(group, self.cpu, make, close, self.heads_per_group)
            home.ring.start_keepalive(self.spec.idle_timeout_s / 3)
            self._home, self._members = home, peers
            self.counters["formed"] += 1
            self._publish("ring_formed", {"ring": name, "epoch": self._epoch, "members": [p.name for p in peers]})
            log.info("formed ring %s with %s", name, [p.name for p in peers] or "no peers")
            return home
        raise RingUnavailable(f"no ring could be formed after {MAX_FORMS} tries: {why}")

    def _lost(self, e: PeerLost) -> None:
        """The current ring lost a peer: drop it (its sessions will be rebuilt) and learn who is alive."""
        home, self._home = self._home, None
        if home is not None:
            home.group.close()
            home.ring.shards.close_all()
            delete_group_files(self.store, group_prefix(home.group.name))  # a half-done hand-off's too
        self.counters["lost"] += 1
        self._publish("ring_lost", {"ring": home.group.name if home else None, "error": str(e),
                                    "members": [p.name for p in self._members]})
        log.warning("ring lost a peer: %s", e)
        self.peers.check_now()  # a dead peer's control plane is gone too: it is not asked to rejoin

    def _ring(self) -> HomeGroup:
        if self._home is not None and self._home.group.broken:  # lost while idle (a failed keep-alive ping)
            self._lost(PeerLost(self._home.group.name, None, "keep-alive", "the ring broke between steps"))
        if self._usable() and (new := self._newcomers()):
            if not self._home.ring.capacity:
                self._retire("peers joined while the ring held no session")  # re-forming costs nothing now
            elif self._over_node_limit():  # (its sessions are rebuilt over the larger ring, in this step)
                self._retire(f"{', '.join(new)} joined, and its sessions hold more than {self.node_tokens} "
                             f"positions on a node")
        return self._home if self._usable() else self._form()

    def _over_node_limit(self) -> bool:
        """Whether a session of the current ring holds more than ``node_tokens`` positions on a node (the
        ring lost peers since it was placed: the survivors hold larger shares)."""
        if self.node_tokens is None:
            return False
        n = self._home.group.world_size
        return any(shard_length(cap, 0, n) > self.node_tokens for cap in self._home.ring.capacity.values())

    def _newcomers(self) -> list[str]:
        """Live peers serving our model that the current ring does not include."""
        have = {p.name for p in self._members}
        return [p.name for p in self.peers.usable() if p.name not in have]

    def _regrow(self) -> bool:
        """A session did not fit: when peers that the ring lacks are alive, stop this ring so that the
        next formation includes them (its sessions are rebuilt from their transcripts); True if so."""
        new = self._newcomers()
        if not new:
            return False
        self._retire(f"{', '.join(new)} can add room")
        return True

    def _retire(self, why: str) -> None:
        home, self._home = self._home, None
        if home is None:
            return
        try:
            home.stop()
        except Exception:  # a member already gone: the group is closed either way
            home.group.close()
        delete_group_files(self.store, group_prefix(home.group.name))
        self._publish("ring_retired", {"ring": home.group.name, "reason": why,
                                       "sessions": len(home.ring.capacity)})
        log.info("ring %s retired: %s", home.group.name, why)

    def close(self) -> None:
        """Stop the ring: its members leave their serve loops and free their shards."""
        with self._lock:
            self._retire("the daemon is stopping")
            self._tcp_store = None

    def describe(self) -> dict:
        home = self._home
        return {"ring": home.group.name if home else None, "epoch": self._epoch,
                "members": [p.name for p in self._members] if home else [],
                "sessions": len(home.ring.capacity) if home else 0, **self.counters,
                "steps": self.stats.steps, "wait_seconds": round(home.ring.stats.wait_seconds, 3) if home else 0.0}

    def prepare(self, kv, new_length: int) -> None:
        """Before a step: a session no ring holds is opened now (every node reserving its shard) and
        rebuilt from its transcript, so that a failure - no room on a node, no ring at all - fails its
        turn alone."""
        if not isinstance(kv, RingKV) or kv.dropped or kv.epoch == self._epoch and self._usable() and not kv.ring_cut:
            return
        with self._lock:
            self._on_ring(lambda home: self._place(home, kv), regrow=True)

    def _on_ring(self, fn, regrow: bool = False):
        """``fn(home)`` on the current ring (formed if need be).  A lost peer drops the ring, which is
        formed again of the survivors, and ``fn`` runs again, up to MAX_FORMS times; with ``regrow``, a
        session that does not fit re-forms the ring with the live peers it lacks."""
        for _ in range(MAX_FORMS):
            home = self._ring()
            try:
                return fn(home)
            except PeerLost as e:
                self._lost(e)
            except ShardRefused:
                if not (regrow and self._regrow()):
                    raise
        raise RingUnavailable(f"the ring kept losing peers ({MAX_FORMS} tries)")

    def pipeline_gather(self, kv: KVCache, tokens: list[int]) -> bool:
        """Prefill ``tokens`` (positions 0 .. of an empty standard session's cache ``kv``, its file)
        through a pipeline over the ring's group, gathering every layer's KV into ``kv``; False when no
        pipeline fits now (the caller prefills locally).  ``PeerLost`` drops the ring (it is formed
        again at the next use) and returns False: nothing was written to ``kv``."""
        if kv.length != 0 or len(tokens) > kv.capacity:
            raise ValueError("a pipeline prefill starts an empty cache and fits in it")
        ids = np.asarray(tokens, np.int32)
        with self._lock:
            try:
                home = self._ring()
                ranges = self._stages(home)
                if ranges is None or len(ids) < self.pipeline_min_tokens:
                    return False
                sid = -next(self._rids)  # not a ring session: a negative id the ring never opens
                home.targets[sid] = kv
                try:
                    t0 = time.perf_counter()
                    home.pipe.prefill([sid], [ids], ranges=ranges, capacities=[kv.capacity], handoff=Handoff.GATHER)
                finally:
                    home.targets.pop(sid, None)
            except (PeerLost, RingUnavailable) as e:
                # the hand-off may have written this stage's own layers and set the length before the
                # others' blocks failed to come: the cache is empty again (the caller prefills it all)
                kv.length = 0
                if isinstance(e, PeerLost):
                    self._lost(e)
                log.warning("pipeline prefill not run: %s", e)
                return False
        self.counters["pipeline_prefills"] += 1
        self._publish("pipeline_prefill", {"tokens": len(ids), "ring": home.group.name, "gather": True,
                                           "ranges": ranges, "seconds": round(time.perf_counter() - t0, 3)})
        return True

    # ---- a step ------------------------------------------------------------------------------------
    def forward(self, chunks: list[SeqChunk]) -> list[np.ndarray]:
        for c in chunks:
            kv = c.kv
            if not isinstance(kv, RingKV):
                raise TypeError(f"the ring backend runs RingKV sessions, got {type(kv).__name__}")
            if kv.length + len(c.tokens) > kv.capacity:
                raise ValueError(f"{len(c.tokens)} tokens exceed the session's capacity {kv.capacity}")
        t0 = time.perf_counter()
        with self._lock:
            out = self._on_ring(lambda home: self._step(home, chunks))
        st = self.stats
        n = [len(c.tokens) for c in chunks]
        st.steps += 1
        st.tokens += sum(n)
        st.prefill_tokens += sum(m for m in n if m > 1)
        st.decode_tokens += sum(m for m in n if m == 1)
        st.seconds += time.perf_counter() - t0
        return out

    def _step(self, home: HomeGroup, chunks: list[SeqChunk]) -> list[np.ndarray]:
        """One ring step of ``chunks``.  All or nothing for the transcripts: a step that fails (a lost
        peer, retried on the next ring) leaves every session's transcript as it was and every session
        it touched to be rebuilt from it, so a retry feeds each chunk once."""
        out: dict[int, np.ndarray] = {}
        before = [c.kv.length for c in chunks]
        live = []
        for i, c in enumerate(chunks):
            if c.kv.dropped:  # deleted since its step was prepared (its turn was cancelled): no ring work,
                out[i] = self._unread_rows(c)  # rows no one reads
            else:
                live.append(i)
        fed: list[int] = []  # sessions whose shards this attempt changed beyond their transcript's state
        try:
            for i in live:
                c = chunks[i]
                self._place(home, c.kv)  # a session whose ring was lost since ``prepare``
                if c.kv.length == 0 and c.logits is not Logits.ALL:  # a long first prompt: one pipeline prefill
                    fed.append(i)
                    first = self._pipeline_first(home, c)
                    if first is not None:
                        out[i] = first
            rest = [i for i in live if i not in out]
            if rest:
                fed += rest
                res = home.ring.step([RingChunk(chunks[i].kv.rid, chunks[i].tokens, chunks[i].logits) for i in rest])
                out.update(zip(rest, res, strict=True))
        except BaseException:
            for i in fed:
                kv = chunks[i].kv
                del kv.tokens[before[i]:]  # (a pipeline prefill had recorded its chunk)
                kv.epoch = None  # its shards may hold part of the step: opened anew and rebuilt before the next
            raise
        for i in rest:
            chunks[i].kv.tokens.extend(int(t) for t in chunks[i].tokens)
        return [out[i] for i in range(len(chunks))]

    def _unread_rows(self, c: SeqChunk) -> np.ndarray:
        n = {Logits.NONE: 0, Logits.LAST: 1}.get(c.logits, len(c.tokens))
        return np.zeros((n, self.config.vocab_size), np.float32)
