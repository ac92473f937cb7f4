"""The data plane inside one process (each rank a thread): tagged messages, several groups over one
store, and every way a peer can be lost ending in ``PeerLost`` rather than a hang."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from weaved.backends.cpu import CPUBackend
from weaved.federation.comm import GroupSpec, PeerGroup, PeerLost, host_store
from weaved.federation.layers import LayerRunner
from weaved.federation.qring import RingMember
from weaved.kv.cache import KVCache

pytestmark = pytest.mark.federation

TIMEOUT_S = 1.0


_FORMED: list[PeerGroup] = []


def _form(name: str, world: int, store, **kw) -> list[PeerGroup]:
    """Every rank of a group, formed concurrently (formation waits for all ranks)."""
    port = store.port
    with ThreadPoolExecutor(world) as ex:
        futs = [ex.submit(PeerGroup.form, GroupSpec(name, r, world, port=port, timeout_s=TIMEOUT_S, **kw),
                          store if r == 0 else None) for r in range(world)]
        groups = [f.result(30) for f in futs]
    _FORMED.extend(groups)
    return groups


@pytest.fixture()
def store():
    yield host_store(timeout_s=TIMEOUT_S)
    # a failed test may leave a serve thread waiting on a peer: closing every group ends those waits
    # (a thread still inside gloo at interpreter exit aborts the process)
    while _FORMED:
        _FORMED.pop().close()


def test_tagged_messages_match_by_tag_not_order(store):
    a, b = _form("tags", 2, store)
    x1 = np.arange(6, dtype=np.float32).reshape(2, 3)
    x2 = np.arange(4, dtype=np.float16)
    r2 = b.irecv(np.empty(4, np.float16), 0, 2)  # posted first, for the message sent second
    r1 = b.irecv(np.empty((2, 3), np.float32), 0, 1)
    a.send(x1, 1, 1)
    a.send(x2, 1, 2)
    r1.wait()
    r2.wait()
    assert np.array_equal(r1._keep[0], x1) and np.array_equal(r2._keep[0], x2)
    b.send(np.zeros(0, np.int64), 0, 3)  # empty arrays are not sent at all: nothing to wait for
    assert a.recv(np.zeros(0, np.int64), 1, 3).size == 0
    for g in (a, b):
        g.close()


def test_groups_over_one_store_are_independent(store):
    g1 = _form("one", 2, store)
    g2 = _form("two", 2, store)
    # a send completes once the receiver has posted its receive (gloo's rendezvous), so post first
    r1, r2 = g1[0].irecv(np.empty(1, np.int64), 1, 5), g2[0].irecv(np.empty(1, np.int64), 1, 5)
    g1[1].send(np.array([1], np.int64), 0, 5)
    g2[1].send(np.array([2], np.int64), 0, 5)
    r2.wait()
    r1.wait()
    assert r1._keep[0][0] == 1 and r2._keep[0][0] == 2
    for g in g1:  # losing one group leaves the other working
        g.close()
    r3 = g2[1].irecv(np.empty(1, np.int64), 0, 6)
    g2[0].send(np.array([3], np.int64), 1, 6)
    r3.wait()
    assert r3._keep[0][0] == 3
    with pytest.raises(PeerLost):
        g1[0].send(np.array([1], np.int64), 1, 7)
    for g in g2:
        g.close()


def test_silent_peer_times_out(store):
    a, b = _form("silent", 2, store)
    with pytest.raises(PeerLost, match="rank 1 during recv from 1") as e:
        a.recv(np.empty(3, np.float32), 1, 1)
    assert e.value.peer == 1 and a.broken
    with pytest.raises(PeerLost, match="already broken"):  # broken for good
        a.send(np.zeros(1, np.float32), 1, 1)
    # gloo closed the pair on the timeout: the other side learns at once instead of waiting out its own
    with pytest.raises(PeerLost):
        b.recv(np.empty(3, np.float32), 0, 1, timeout_s=30)
    a.close()
    b.close()


def test_closed_peer_fails_pending_receive(store):
    a, b = _form("closed", 2, store)
    pending = a.irecv(np.empty(3, np.float32), 1, 1)
    b.close()
    # gloo says "closed" or, when the peer's socket goes first under load, "reset by peer"
    with pytest.raises(PeerLost, match="Connection (closed|reset)"):
        pending.wait(timeout_s=30)
    a.close()


def test_rendezvous_without_the_peers_raises(store):
    with pytest.raises(PeerLost, match="rendezvous"):
        PeerGroup.form(GroupSpec("alone", 0, 2, timeout_s=TIMEOUT_S), store)


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return LayerRunner(CPUBackend.from_file(tiny_llama, threads=1))


def _serve(member: RingMember, box: dict) -> threading.Thread:
    def run():
        try:
            member.serve()
            box["ended"] = "stop"
        except PeerLost as e:
            box["ended"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_member_gives_up_on_a_silent_home_and_keepalive_prevents_it(store, runner):
    cfg = runner.config
    home, member = _form("idle", 2, store, idle_timeout_s=0.5)
    box: dict = {}
    _serve(RingMember(member, cfg), box).join(30)
    assert isinstance(box["ended"], PeerLost) and box["ended"].peer == 0
    home.close()

    home, member = _form("alive", 2, store, idle_timeout_s=1.0)
    h = RingMember(home, cfg, runner)
    box = {}
    t = _serve(RingMember(member, cfg), box)
    h.start_keepalive(0.2)
    t.join(2.5)  # well past the idle timeout: pings keep the member serving
    assert t.is_alive() and "ended" not in box
    h.open_session(4, 16)  # a command round trip (acked) while the keepalive runs
    h.stop()
    t.join(30)
    assert box["ended"] == "stop"


def test_member_refusing_an_open_leaves_the_ring_usable(store, runner):
    """A member that cannot hold a session's shard refuses the open; every rank is back in step, so
    the home reports it (ShardRefused) and the ring goes on serving."""
    from weaved.federation.qring import ShardRefused

    home, member = _form("refuse", 2, store)
    box: dict = {}
    t = _serve(RingMember(member, runner.config), box)
    h = RingMember(home, runner.config, runner)
    kv = KVCache.allocate(runner.config, 8)
    kv.length = 3
    h.shards.adopt(1, kv, 5)  # the home holds its shard of a 5-position session; the member holds none
    with pytest.raises(ShardRefused, match="could not hold its shard"):
        h.open_session(1, 16, held_length=5)
    assert not home.broken and 1 not in h.shards.kv and 1 not in h.capacity
    h.ping()
    h.open_session(2, 16)  # the ring still opens sessions
    h.stop()
    t.join(30)
    assert box["ended"] == "stop"


def test_two_rank_ring_in_threads_truncates_and_leaves(store, runner):
    """A ring of two inside one process: truncating every shard and decoding again reproduces the
    same logits; a member that leaves makes the home's next step raise, and its serve loop ends."""
    from weaved.backends.base import SeqChunk
    from weaved.federation.qring import RingChunk

    cfg = runner.config
    home, member = _form("threads", 2, store)
    box: dict = {}
    m = RingMember(member, cfg)
    t = _serve(m, box)
    h = RingMember(home, cfg, runner)
    kv = KVCache.allocate(cfg, 32)
    runner.backend.forward([SeqChunk(kv, np.array([1, 504, 3458, 282, 4649], np.int32))])
    h.open_session(0, 32, kv=kv)
    first = [h.step([RingChunk(0, np.array([tok], np.int32))])[0] for tok in (7, 8, 9)]
    h.ping()  # a round trip: the member has finished every step and command before it
    assert h.shards.lengths[0] == 8 and (h.shards.kv[0].length, m.shards.kv[0].length) == (4, 4)
    h.truncate(0, 6)
    h.ping()  # a round trip: the member has followed every command before it
    assert (h.shards.kv[0].length, m.shards.kv[0].length) == (3, 3) and m.shards.lengths[0] == 6
    again = [h.step([RingChunk(0, np.array([tok], np.int32))])[0] for tok in (8, 9)]
    assert all(np.array_equal(a, b) for a, b in zip(first[1:], again, strict=True))
    # A member leaving aborts its group; a wait already under way in its own serve thread is not
    # woken by that (gloo), so the home's next message is what ends it, and the home then fails fast.
    m.leave()
    with pytest.raises(PeerLost):
        h.step([RingChunk(0, np.array([1], np.int32))])
    t.join(30)
    assert isinstance(box["ended"], PeerLost)
    assert h.shards.lengths[0] == 8  # nothing advanced
