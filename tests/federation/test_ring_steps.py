"""A ring backend's step against a scripted ring: all-or-nothing transcripts when a peer is lost
mid-step, a deleted session never reopened, transcript cuts applied on the engine thread."""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import numpy as np

from weaved.backends.base import BackendStats, Logits, SeqChunk
from weaved.federation.comm import PeerLost
from weaved.federation.ring_backend import RingBackend

VOCAB = 11


class ScriptedRing:
    """The home's ring member as the backend uses it: sessions' shard lengths and every token fed."""

    def __init__(self):
        self.capacity: dict[int, int] = {}
        self.lengths: dict[int, int] = {}
        self.fed: list[tuple[int, list[int]]] = []
        self.truncated: list[tuple[int, int]] = []
        self.fail_next_step: Exception | None = None

    def open_session(self, rid, capacity):
        self.capacity[rid], self.lengths[rid] = capacity, 0

    def close_session(self, rid):
        self.capacity.pop(rid), self.lengths.pop(rid)

    def truncate(self, rid, length):
        self.truncated.append((rid, length))
        self.lengths[rid] = length

    def step(self, chunks):
        out = []
        for c in chunks:  # the rows land on the nodes before a peer's loss is seen
            self.lengths[c.sid] += len(c.tokens)
            self.fed.append((c.sid, [int(t) for t in c.tokens]))
            out.append(np.zeros(({Logits.NONE: 0, Logits.LAST: 1}.get(c.logits, len(c.tokens)), VOCAB), np.float32))
        if self.fail_next_step is not None:
            e, self.fail_next_step = self.fail_next_step, None
            raise e
        return out


def _home(ring: ScriptedRing, pipelined: list):
    def prefill(sids, prompts, *, ranges, capacities, handoff):
        for sid, p in zip(sids, prompts, strict=True):
            ring.lengths[sid] = len(p)
            pipelined.append((sid, len(p)))
        return SimpleNamespace(logits=[np.ones((1, VOCAB), np.float32) for _ in sids])

    return SimpleNamespace(ring=ring, pipe=SimpleNamespace(prefill=prefill),
                           group=SimpleNamespace(broken=False, world_size=2, name="g"))


def _backend():
    """A RingBackend whose ring is scripted: ``rings[-1]`` is the current one; a lost peer forms the next."""
    rb = object.__new__(RingBackend)
    rings, pipelined = [ScriptedRing()], []
    rb.config = SimpleNamespace(vocab_size=VOCAB, n_layers=4)
    rb._lock, rb._rids, rb.stats, rb.labels = threading.RLock(), itertools.count(1), BackendStats(), {}
    rb.counters = {"formed": 0, "lost": 0, "rebuilt_sessions": 0, "rebuilt_tokens": 0, "pipeline_prefills": 0}
    rb._publish, rb.pipeline_min_tokens = (lambda kind, data: None), 6
    rb._epoch, rb._home = 1, _home(rings[0], pipelined)
    rb._stages = lambda home: [(0, 2), (2, 4)]

    def lost(e):
        rings.append(ScriptedRing())
        rb._epoch += 1
        rb._home = _home(rings[-1], pipelined)

    rb._lost, rb._ring = lost, (lambda: rb._home)
    return rb, rings, pipelined


def test_a_peer_lost_after_a_pipelined_first_prompt_feeds_it_once_on_the_next_ring():
    rb, rings, pipelined = _backend()
    new = rb.new_kv(64)  # its first prompt is long: one pipeline prefill
    old = rb.new_kv(64, tokens=[1, 2])
    rb.prepare(old, 3)
    rings[0].fail_next_step = PeerLost("g", 1, "step", "its process is gone")
    prompt = np.arange(20, 28, dtype=np.int32)
    out = rb.forward([SeqChunk(new, prompt, Logits.LAST), SeqChunk(old, np.array([3], np.int32), Logits.LAST)])
    assert [o.shape for o in out] == [(1, VOCAB), (1, VOCAB)]
    assert new.tokens == list(prompt) and old.tokens == [1, 2, 3]
    ring = rings[-1]
    assert len(rings) == 2 and ring.lengths == {new.rid: 8, old.rid: 3}
    assert (new.rid, list(prompt)) not in ring.fed  # not stepped again after its pipeline prefill
    assert pipelined[-1] == (new.rid, 8)


def test_a_failed_step_leaves_the_transcripts_and_rebuilds_what_it_touched():
    rb, rings, _ = _backend()
    kv = rb.new_kv(64, tokens=[5, 6])
    rb.prepare(kv, 3)
    rings[0].fail_next_step = RuntimeError("a bug")
    try:
        rb.forward([SeqChunk(kv, np.array([7], np.int32), Logits.LAST)])
    except RuntimeError:
        pass
    assert kv.tokens == [5, 6] and kv.epoch is None  # the shards hold a row the transcript does not
    rb.forward([SeqChunk(kv, np.array([7], np.int32), Logits.LAST)])
    assert kv.tokens == [5, 6, 7] and rings[0].lengths[kv.rid] == 3  # opened anew, rebuilt, stepped


def test_a_session_deleted_after_its_step_was_prepared_is_not_opened_again():
    rb, rings, _ = _backend()
    kv = rb.new_kv(64, tokens=[1, 2])
    rb.prepare(kv, 3)
    assert kv.rid in rings[0].capacity
    rb.drop(kv)  # the API thread, between the engine's prepare and its forward
    out = rb.forward([SeqChunk(kv, np.array([3], np.int32), Logits.LAST)])
    assert out[0].shape == (1, VOCAB)
    assert kv.rid not in rings[0].capacity and kv.tokens == [1, 2]
    rb.prepare(kv, 4)
    assert kv.rid not in rings[0].capacity


def test_a_transcript_cut_reaches_the_ring_before_the_next_step_not_at_the_cut():
    rb, rings, _ = _backend()
    kv = rb.new_kv(64, tokens=[1, 2, 3, 4])
    rb.prepare(kv, 5)
    kv.truncate(2)  # the daemon, under its own lock: no network call here
    assert rings[0].truncated == [] and kv.tokens == [1, 2]
    rb.forward([SeqChunk(kv, np.array([9], np.int32), Logits.LAST)])
    assert rings[0].truncated == [(kv.rid, 2)] and rings[0].lengths[kv.rid] == 3 and kv.tokens == [1, 2, 9]


def _degraded(node_tokens, capacity: int, world: int = 1, members=(), alive=("b",)):
    """A ring of ``world`` node(s) holding one session of ``capacity`` positions, with ``alive`` peers up."""
    rb = object.__new__(RingBackend)
    ring = ScriptedRing()
    ring.open_session(1, capacity)
    rb._home = _home(ring, [])
    rb._home.group.world_size = world
    rb.node_tokens = node_tokens
    rb._members = [SimpleNamespace(name=m) for m in members]
    rb.peers = SimpleNamespace(usable=lambda: [SimpleNamespace(name=a) for a in alive])
    retired, formed = [], []
    rb._retire = lambda why: (retired.append(why), setattr(rb, "_home", None))
    rb._form = lambda: formed.append(True) or "new ring"
    return rb, retired, formed


def test_a_ring_that_lost_peers_spreads_its_sessions_again_when_they_return():
    """The survivors of a lost peer hold larger shares than the node limit the routing placed the session
    by (a 400-position session on one node, limit 256): a returning peer re-forms the ring (its sessions
    are rebuilt over both); a ring within the limit, or one no peer can join, stays."""
    rb, retired, formed = _degraded(256, 400)
    assert rb._ring() == "new ring" and formed
    assert retired == ["b joined, and its sessions hold more than 256 positions on a node"]
    for kw in ({"world": 2, "members": ("b",), "alive": ("b", "c")},  # 200 a node: within the limit
               {"alive": ()}):  # nobody to spread to
        rb, retired, formed = _degraded(256, 400, **kw)
        assert rb._ring() is rb._home and not retired and not formed
    rb, retired, _ = _degraded(None, 400)  # no limit but the KV cap's: the cap refuses what does not fit
    rb._ring()
    assert not retired
