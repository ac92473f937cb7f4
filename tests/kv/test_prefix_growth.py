"""A prefix file grows in place: a publication whose stored part is exactly one file's blocks appends its
new blocks to that file (a stateless conversation sent again one message longer, forks at growing
depths), so its disk and its writes grow with the conversation, not with its square; sessions mapping the
file's first blocks read what they read before; a branch starts a file of its own; a stop midway leaves
the file as its sidecar says."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from tests.kv.test_prefixes import tokens
from tests.kv.test_store import BPT, CFG, allocated, fill
from weaved.kv.errors import DiskFull
from weaved.kv.prefixes import BLOCK, PrefixStore, chain_keys
from weaved.kv.store import KVStore


def conversation(store: KVStore, sid: str, prompt: list[int], seed: int, capacity: int = 2048):
    """A session that maps the longest stored prefix of ``prompt``, computes the rest (random rows) and
    publishes its full blocks; (session, its rows)."""
    kv = store.create(sid, capacity=capacity, memory_only=True)
    shared = store.share_prefix(kv, prompt + [0])
    store.reserve(kv, len(prompt))
    rows = np.array(kv.data[:, :, :, : len(prompt)])
    rows[:, :, :, shared:] = fill(kv, shared, len(prompt), seed=seed)
    store.publish_prefix(kv, prompt)
    return kv, rows


def prefix_disk(store: KVStore) -> int:
    return sum(allocated(p) for p in store.prefixes.dir.glob("*.kv"))


def test_a_growing_conversation_keeps_one_file_whose_disk_grows_with_it(tmp_path):
    store = KVStore(tmp_path, CFG)
    talk = tokens(8 * BLOCK + 50, seed=3)
    lengths = [BLOCK + 20, 3 * BLOCK + 7, 4 * BLOCK + 90, 6 * BLOCK + 1, 8 * BLOCK + 50]
    first, first_rows = conversation(store, "t0", talk[: lengths[0]], seed=0)
    every = {0: first_rows}
    for i, n in enumerate(lengths[1:], start=1):
        _, every[i] = conversation(store, f"t{i}", talk[:n], seed=i)
    st = store.prefixes.status()
    assert st["files"] == 1 and st["published"] == 5 and st["extended"] == 4
    (path,) = store.prefixes.dir.glob("*.kv")
    # each block once, and the file system's own few pages (one file per length: 22 blocks)
    assert 8 * BLOCK * BPT <= prefix_disk(store) < 9 * BLOCK * BPT
    # every session reads what it computed or mapped: the first one's block is unchanged under it
    assert np.array_equal(first.data[:, :, :, :BLOCK], first_rows[:, :, :, :BLOCK])
    for i in range(1, len(lengths)):
        held = lengths[i - 1] // BLOCK * BLOCK
        assert np.array_equal(every[i][:, :, :, :held], every[i - 1][:, :, :, :held])
    # a new request with the whole conversation maps all eight blocks: the rows their sessions computed
    late = store.create("late", capacity=2048, memory_only=True)
    assert store.share_prefix(late, talk + [1]) == 8 * BLOCK
    assert np.array_equal(late.data[:, :, :, : 8 * BLOCK], every[4][:, :, :, : 8 * BLOCK])
    meta = json.loads(path.with_suffix(".json").read_text())
    assert len(meta["keys"]) == 8 and meta["shape"][3] == 2048  # room for its publisher's context


def test_a_branch_or_a_file_without_room_starts_a_new_file(tmp_path):
    store = KVStore(tmp_path, CFG)
    a = tokens(3 * BLOCK, seed=1)
    conversation(store, "a", a, seed=1)
    branch = a[: 2 * BLOCK] + tokens(2 * BLOCK, seed=2)  # the file holds a third block these tokens lack
    conversation(store, "b", branch, seed=2)
    st = store.prefixes.status()
    assert st["files"] == 2 and st["extended"] == 0
    small = tokens(5 * BLOCK, seed=4)
    conversation(store, "c", small[:BLOCK], seed=3, capacity=BLOCK)  # a file with room for one block
    conversation(store, "d", small, seed=4)
    st = store.prefixes.status()
    assert st["files"] == 4 and st["extended"] == 0
    e = store.create("e", capacity=2048, memory_only=True)
    assert store.share_prefix(e, small + [0]) == 5 * BLOCK


def test_a_restart_maps_a_grown_file_for_old_and_new_sessions(tmp_path):
    store = KVStore(tmp_path, CFG)
    talk = tokens(4 * BLOCK + 10, seed=5)
    kv = store.create("s", capacity=1024)  # a session with a file: its sidecar names the prefix's length
    store.reserve(kv, 2 * BLOCK + 10)
    rows = fill(kv, 0, 2 * BLOCK + 10, seed=5)
    assert store.publish_prefix(kv, talk[: 2 * BLOCK + 10]) == 2 * BLOCK
    _, grown = conversation(store, "g", talk, seed=6)
    assert store.prefixes.status()["extended"] == 1
    del store, kv
    store = KVStore(tmp_path, CFG)
    (p,) = store.prefixes._by_key.values()
    assert p.positions == 4 * BLOCK and p.capacity == 1024  # room for its first publisher's context
    kv = store.open("s", 2 * BLOCK + 10)
    assert np.array_equal(kv.data[:, :, :, : 2 * BLOCK + 10], rows)
    new = store.create("n", capacity=1024)
    assert store.share_prefix(new, talk + [0]) == 4 * BLOCK
    assert np.array_equal(new.data[:, :, :, : 4 * BLOCK], grown[:, :, :, : 4 * BLOCK])


def test_a_failed_extension_leaves_the_file_as_its_sidecar_says(tmp_path, monkeypatch):
    store = KVStore(tmp_path, CFG)
    talk = tokens(4 * BLOCK, seed=7)
    _, rows = conversation(store, "a", talk[:BLOCK], seed=7)
    before = prefix_disk(store)

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PrefixStore, "_write_meta", no_room)  # the rows are written, their sidecar is not
    kv = store.create("b", capacity=2048, memory_only=True)
    store.share_prefix(kv, talk + [0])
    store.reserve(kv, len(talk))
    fill(kv, BLOCK, len(talk), seed=8)
    with pytest.raises(DiskFull):
        store.prefixes.publish(kv.data, talk)
    assert prefix_disk(store) == before  # the blocks it took are given back
    monkeypatch.undo()
    store = KVStore(tmp_path, CFG)  # a restart reads the file as it was
    assert store.prefixes.covered(talk) == BLOCK
    c = store.create("c", capacity=2048)
    assert store.share_prefix(c, talk) == BLOCK
    assert np.array_equal(c.data[:, :, :, :BLOCK], rows[:, :, :, :BLOCK])


def test_the_file_being_extended_is_not_evicted(tmp_path, monkeypatch):
    store = KVStore(tmp_path, CFG, cap_bytes=4 * 64 * BLOCK * BPT)
    talk = tokens(3 * BLOCK, seed=9)
    conversation(store, "a", talk[:BLOCK], seed=9)
    store.delete("a")  # nobody maps the file now
    real = store.prefixes.covered

    def evict_meanwhile(toks):  # sessions need all the room just as the publication looks for its file
        held = real(toks)
        assert store.prefixes.evict(free=10**12) == 0  # the file is not free to go: it is being grown
        return held

    kv = store.create("b", capacity=2048, memory_only=True)
    store.reserve(kv, len(talk))
    fill(kv, 0, len(talk), seed=10)
    monkeypatch.setattr(store.prefixes, "_extendable", _pinning_then(store.prefixes._extendable, evict_meanwhile,
                                                                     talk))
    store.publish_prefix(kv, talk, adopt=False)
    st = store.prefixes.status()
    assert st["files"] == 1 and st["extended"] == 1 and st["in_use"] == 0


def _pinning_then(extendable, check, talk):
    def wrapped(*args):
        p = extendable(*args)
        check(talk)
        return p
    return wrapped


def test_a_publisher_adopts_only_its_own_blocks_of_a_file_grown_meanwhile(tmp_path, monkeypatch):
    """The file a publication returns may hold more blocks by the time its session maps it: the session
    maps its own count, never another conversation's rows over its own."""
    store = KVStore(tmp_path, CFG)
    talk = tokens(4 * BLOCK, seed=11)
    a = store.create("a", capacity=2048)
    store.reserve(a, 2 * BLOCK + 3)
    mine = fill(a, 0, 2 * BLOCK + 3, seed=11)
    real = store.prefixes.publish

    def and_then_grown(data, toks, user=None):
        p = real(data, toks, user)
        if len(toks) < len(talk):
            conversation(store, "other", talk, seed=12)  # extends the same file to four blocks
        return p

    monkeypatch.setattr(store.prefixes, "publish", and_then_grown)
    assert store.publish_prefix(a, talk[: 2 * BLOCK + 3]) == 2 * BLOCK
    assert store._open["a"].shared == 2 * BLOCK and store.prefixes.status()["extended"] == 1
    assert np.array_equal(a.data[:, :, :, : 2 * BLOCK + 3], mine)


def test_an_older_file_with_no_room_still_serves(tmp_path):
    """Files stored before files had room to grow (their capacity their own blocks) map as before; a longer
    conversation then starts a file of its own."""
    store = KVStore(tmp_path, CFG)
    talk = tokens(3 * BLOCK, seed=13)
    _, rows = conversation(store, "a", talk[:BLOCK], seed=13, capacity=BLOCK)
    (meta,) = store.prefixes.dir.glob("*.json")
    m = json.loads(meta.read_text())
    del m["shape"], m["block"]
    meta.write_text(json.dumps(m))
    store = KVStore(tmp_path, CFG)
    b = store.create("b", capacity=2048)
    assert store.share_prefix(b, talk) == BLOCK
    assert np.array_equal(b.data[:, :, :, :BLOCK], rows[:, :, :, :BLOCK])
    conversation(store, "c", talk, seed=14)
    assert store.prefixes.status()["files"] == 2


def test_a_file_with_room_to_grow_costs_only_the_blocks_it_holds(tmp_path):
    """Its rows are written, not stored through a mapping: on recent kernels a store into a mapped page
    of a sparse file dirties the whole folio around it, whose writeback fills the holes beside it (64
    runs of one block each so made 5.6 MB of disk for 1 MB of rows)."""
    cfg = replace(CFG, n_layers=8, n_kv_heads=4)
    store = KVStore(tmp_path, cfg)
    kv = store.create("a", capacity=4096)
    store.reserve(kv, BLOCK + 1)
    fill(kv, 0, BLOCK + 1, seed=15)
    assert store.publish_prefix(kv, tokens(BLOCK + 1), adopt=False) == BLOCK
    (path,) = store.prefixes.dir.glob("*.kv")
    assert path.stat().st_size == 4096 * cfg.kv_bytes_per_token  # room for the whole context
    assert allocated(path) < 1.25 * BLOCK * cfg.kv_bytes_per_token


def test_forks_at_growing_depths_share_one_file(tmp_path):
    store = KVStore(tmp_path, CFG)
    talk = tokens(4 * BLOCK + 9, seed=16)
    parent = store.create("p", capacity=2048)
    store.reserve(parent, 2 * BLOCK + 5)
    rows = fill(parent, 0, 2 * BLOCK + 5, seed=16)
    first = store.create("f1", capacity=2048)
    assert store.fork_prefix(parent, first, talk[: 2 * BLOCK + 5]) == 2 * BLOCK
    store.reserve(parent, len(talk))
    rows = np.concatenate([rows, fill(parent, 2 * BLOCK + 5, len(talk), seed=17)], axis=3)
    second = store.create("f2", capacity=2048)
    assert store.fork_prefix(parent, second, talk) == 4 * BLOCK
    st = store.prefixes.status()
    assert st["files"] == 1 and st["extended"] == 1
    for kv, n in ((parent, len(talk)), (first, 2 * BLOCK + 5), (second, len(talk))):
        assert np.array_equal(kv.data[:, :, :, :n], rows[:, :, :, :n])


def test_a_file_grown_past_the_cap_by_a_publisher_that_maps_nothing_is_kept(tmp_path):
    """The file just grown is spared by the eviction its growth causes (as a new file is): the store keeps
    the conversation it was asked to keep, the older files nobody maps go first."""
    store = KVStore(tmp_path, CFG, cap_bytes=4 * 5 * BLOCK * BPT // 2)  # prefixes get 2.5 blocks' bytes
    talk = tokens(3 * BLOCK, seed=18)
    conversation(store, "a", talk[: 2 * BLOCK], seed=18)
    store.delete("a")
    kv = store.create("b", capacity=2048, memory_only=True)  # computed it all itself: maps no prefix
    store.reserve(kv, len(talk))
    fill(kv, 0, len(talk), seed=19)
    assert store.publish_prefix(kv, talk, adopt=False) == 3 * BLOCK
    st = store.prefixes.status()
    assert st["files"] == 1 and st["extended"] == 1 and st["in_use"] == 0
    assert store.prefixes.covered(talk) == 3 * BLOCK


def test_a_lookup_that_read_a_stale_index_is_a_miss(tmp_path):
    """The index is read off the lock: a file it names may have been evicted since and made again under
    the same name with fewer blocks - the lookup must not hand out blocks the file does not hold."""
    store = KVStore(tmp_path, CFG)
    talk = tokens(3 * BLOCK + 2, seed=20)
    conversation(store, "a", talk[: 2 * BLOCK], seed=20)
    conversation(store, "b", talk, seed=21)  # grown to three blocks
    (p,) = store.prefixes._by_key.values()
    name, third = p.key, chain_keys(store.fingerprint, talk)[2]
    store.delete("a")
    store.delete("b")
    assert store.prefixes.evict(free=10**12) > 0
    conversation(store, "c", talk[: 2 * BLOCK], seed=22)  # the same name, two blocks
    assert store.prefixes.get(name).positions == 2 * BLOCK
    store.prefixes._index[third] = (name, 3)  # what a lookup read before the eviction
    assert store.prefixes.longest(talk, len(talk) - 1) is None


def test_a_file_cut_short_is_removed_at_start(tmp_path):
    """A read past a mapped file's end kills the process: a file shorter than its sidecar says is never
    indexed (its disk goes back)."""
    store = KVStore(tmp_path, CFG)
    conversation(store, "a", tokens(BLOCK + 3, seed=23), seed=23)
    (path,) = store.prefixes.dir.glob("*.kv")
    with open(path, "r+b") as f:
        f.truncate(BLOCK * BPT)
    store = KVStore(tmp_path, CFG)
    assert store.prefixes.status()["files"] == 0 and not list(store.prefixes.dir.iterdir())


def test_rows_a_stop_left_past_the_sidecar_give_their_disk_back_at_start(tmp_path, monkeypatch):
    store = KVStore(tmp_path, CFG)
    talk = tokens(4 * BLOCK, seed=24)
    _, rows = conversation(store, "a", talk[:BLOCK], seed=24)
    (path,) = store.prefixes.dir.glob("*.kv")

    def stop(*args, **kwargs):  # the process dies between the rows and the sidecar naming them
        raise SystemExit

    monkeypatch.setattr(PrefixStore, "_write_meta", stop)
    kv = store.create("b", capacity=2048, memory_only=True)
    store.reserve(kv, len(talk))
    fill(kv, 0, len(talk), seed=25)
    with pytest.raises(SystemExit):
        store.prefixes.publish(kv.data, talk)
    assert allocated(path) >= 4 * BLOCK * BPT  # three blocks more than the sidecar names
    monkeypatch.undo()
    store = KVStore(tmp_path, CFG)
    assert allocated(path) < 2 * BLOCK * BPT and store.prefixes.covered(talk) == BLOCK
    c = store.create("c", capacity=2048)
    assert store.share_prefix(c, talk) == BLOCK
    assert np.array_equal(c.data[:, :, :, :BLOCK], rows[:, :, :, :BLOCK])
