"""Shared prefixes: published once, mapped (not copied) by the sessions that start with the same tokens,
read-only under them, taken back on a rewrite, kept across a restart, evicted only when unused."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from tests.kv.test_store import CFG, fill
from weaved.kv import store_prefixes
from weaved.kv.errors import KVCapExceeded
from weaved.kv.prefixes import BLOCK, chain_keys
from weaved.kv.store import KVStore


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 100, n)]


def test_chain_keys_depend_on_everything_before():
    a, b = tokens(3 * BLOCK), tokens(3 * BLOCK)
    b[10] = (b[10] + 1) % 100
    ka, kb = chain_keys("fp", a), chain_keys("fp", b)
    assert len(ka) == 3 and all(x != y for x, y in zip(ka, kb, strict=True))  # block 0 differs: all differ
    assert chain_keys("other-model", a)[0] != ka[0]
    assert chain_keys("fp", a + [1, 2])[:3] == ka  # a partial block adds no key


def test_a_second_session_maps_the_first_ones_prefix(tmp_path):
    store = KVStore(tmp_path, CFG)
    prompt = tokens(2 * BLOCK + 40)
    a = store.create("a", capacity=1024)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=1)
    assert store.publish_prefix(a, prompt) == 2 * BLOCK
    assert store.publish_prefix(a, prompt) == 0  # already held
    b = store.create("b", capacity=1024)
    assert store.share_prefix(b, prompt[: 2 * BLOCK] + tokens(30, seed=9)) == 2 * BLOCK
    assert b.length == 2 * BLOCK
    assert np.array_equal(b.data[:, :, :, : 2 * BLOCK], rows[:, :, :, : 2 * BLOCK])
    # the pages are the prefix file's, read-only: b's own rows start after them
    store.reserve(b, 2 * BLOCK + 8)
    own = fill(b, 2 * BLOCK, 2 * BLOCK + 8, seed=2)
    assert np.array_equal(a.data[:, :, :, 2 * BLOCK: 2 * BLOCK + 8], rows[:, :, :, 2 * BLOCK: 2 * BLOCK + 8])
    status = store.prefixes.status()
    assert status["hits"] == 1 and status["reused_tokens"] == 2 * BLOCK and status["in_use"] == 1
    # a restart: b maps its prefix again and reads the same rows
    b_len = b.length
    del store
    store2 = KVStore(tmp_path, CFG)
    b2 = store2.open("b", b_len)
    assert np.array_equal(b2.data[:, :, :, : 2 * BLOCK], rows[:, :, :, : 2 * BLOCK])
    assert np.array_equal(b2.data[:, :, :, 2 * BLOCK: b_len], own)
    # a template rewrite inside the prefix: b takes its own copy of what it keeps
    store2.unshare(b2, BLOCK + 5)
    b2.data[:, :, :, BLOCK + 5] = 7  # writable now, and only b's
    assert np.array_equal(b2.data[:, :, :, : BLOCK + 5], rows[:, :, :, : BLOCK + 5])
    c = store2.create("c", capacity=1024)
    assert store2.share_prefix(c, prompt) == 2 * BLOCK
    assert np.array_equal(c.data[:, :, :, : 2 * BLOCK], rows[:, :, :, : 2 * BLOCK])


def test_no_prefix_shorter_than_a_block_and_one_token_is_left_to_feed(tmp_path):
    store = KVStore(tmp_path, CFG)
    prompt = tokens(BLOCK)
    a = store.create("a", capacity=512)
    store.reserve(a, BLOCK)
    fill(a, 0, BLOCK, seed=1)
    assert store.publish_prefix(a, prompt[: BLOCK - 1]) == 0
    assert store.publish_prefix(a, prompt) == BLOCK
    b = store.create("b", capacity=512)
    assert store.share_prefix(b, prompt) == 0  # all of it would leave nothing to feed: none applies
    assert store.share_prefix(b, prompt + [5]) == BLOCK


def test_eviction_spares_prefixes_in_use(tmp_path):
    bpt = CFG.kv_bytes_per_token
    store = KVStore(tmp_path, CFG, cap_bytes=4 * 2 * BLOCK * bpt)  # prefixes get a quarter: 2 blocks
    firsts = []
    for i in range(3):
        p = tokens(BLOCK, seed=10 + i)
        kv = store.create(f"s{i}", capacity=512)
        store.reserve(kv, BLOCK)
        fill(kv, 0, BLOCK, seed=i)
        store.publish_prefix(kv, p)  # the publisher maps it too
        firsts.append(p)
        if i == 0:
            user = store.create("user", capacity=512)
            assert store.share_prefix(user, p + [1]) == BLOCK
        if i == 1:
            store.delete("s1")  # its prefix is now free
    status = store.prefixes.status()
    assert status["files"] == 2 and status["bytes"] <= store.prefixes.cap_bytes
    assert store.prefixes.covered(firsts[0]) == BLOCK  # in use: kept
    assert store.prefixes.covered(firsts[1]) == 0  # the least recently used free one went
    store.delete("user")
    store.delete("s0")
    store.delete("s2")
    assert store.prefixes.status()["in_use"] == 0


def test_prefixes_over_their_cap_go_when_their_last_user_does_and_at_a_restart_with_a_lower_cap(tmp_path):
    """Files kept while mapped past the cap go as soon as nobody maps them; a restart with a lower cap
    trims the unused ones at once, but keeps a file a session's own file names (its rows are nowhere
    else) until that session is deleted."""
    bpt = CFG.kv_bytes_per_token
    store = KVStore(tmp_path, CFG)  # no cap: three files, each mapped by its publisher
    prompts = [tokens(BLOCK, seed=20 + i) for i in range(3)]
    for i, p in enumerate(prompts):
        kv = store.create(f"s{i}", capacity=512)
        store.reserve(kv, BLOCK)
        fill(kv, 0, BLOCK, seed=i)
        store.publish_prefix(kv, p)
        store.share_prefix(store.create(f"u{i}", capacity=512), p + [1])
    for i in range(3):  # the publishers go; the users map on
        store.delete(f"s{i}")
    del store
    low = KVStore(tmp_path, CFG, cap_bytes=4 * BLOCK * bpt)  # prefixes get one block
    assert low.prefixes.status()["files"] == 3  # every file is named by a session's own: kept
    low.delete("u0")  # never opened: its prefix is unused now, and the prefixes are over their cap
    assert low.prefixes.status()["files"] == 2 and low.prefixes.covered(prompts[0]) == 0
    u1 = low.open("u1", BLOCK)
    low.delete("u1", wait=True)  # opened, then deleted: the same
    del u1
    assert low.prefixes.status()["files"] == 1 and low.prefixes.covered(prompts[2]) == BLOCK
    low.delete("u2")
    del low
    assert KVStore(tmp_path, CFG, cap_bytes=4 * BLOCK * bpt).prefixes.status()["files"] == 1  # within the cap
    assert KVStore(tmp_path, CFG, cap_bytes=2 * BLOCK * bpt).prefixes.status()["files"] == 0  # a lower one


def test_a_session_that_takes_its_own_copy_at_a_restart_lets_the_prefix_go(tmp_path):
    """A session stopped before its journal committed the prefix it mapped gets its own copy of what it
    committed at the restart: the file kept for it since the start is then nobody's, and can go."""
    store = KVStore(tmp_path, CFG)
    prompt = tokens(2 * BLOCK + 8, seed=31)
    a = store.create("a", capacity=1024)
    store.reserve(a, len(prompt))
    fill(a, 0, len(prompt), seed=3)
    store.publish_prefix(a, prompt)
    b = store.create("b", capacity=1024)
    assert store.share_prefix(b, prompt) == 2 * BLOCK
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in (tmp_path / "prefixes").glob("*.kv"))  # (the user's)
    store.delete("a")
    del store, a, b
    again = KVStore(tmp_path, CFG)
    assert again.prefixes.status()["in_use"] == 1  # kept for b, not opened yet
    again.open("b", BLOCK)  # its journal had committed one block of the two it mapped: its own copy
    assert again.prefixes.status()["in_use"] == 0 and again.prefixes.evict(free=1) > 0


def test_another_models_prefix_file_named_by_its_session_is_kept_for_it(tmp_path):
    """The data directory served another model before: its session's file maps that model's prefix, whose
    rows are nowhere else - kept at a start over the cap, let go once that session is deleted."""
    import json

    store = KVStore(tmp_path, CFG)
    prompt = tokens(BLOCK + 4, seed=32)
    a = store.create("a", capacity=512)
    store.reserve(a, len(prompt))
    fill(a, 0, len(prompt), seed=4)
    store.publish_prefix(a, prompt)
    del store, a
    for meta in (tmp_path / "prefixes").glob("*.json"):  # as if written by another model
        m = json.loads(meta.read_text())
        meta.write_text(json.dumps({**m, "fingerprint": "another-model"}))
    low = KVStore(tmp_path, CFG, cap_bytes=8)  # prefixes' cap: 2 bytes
    assert low.prefixes.status()["other_models"]["files"] == 1  # named by session a's sidecar: kept
    low.delete("a")
    low.prefixes.evict()
    assert low.prefixes.status()["other_models"]["files"] == 0


def test_reserve_does_not_allocate_the_shared_positions(tmp_path):
    store = KVStore(tmp_path, CFG)
    prompt = tokens(BLOCK + 3)
    a = store.create("a", capacity=1024)
    store.reserve(a, BLOCK)
    fill(a, 0, BLOCK, seed=1)
    store.publish_prefix(a, prompt[:BLOCK])
    b = store.create("b", capacity=1024)
    store.share_prefix(b, prompt)
    before = store.reserved_bytes()
    store.reserve(b, BLOCK + 3)  # up to the chunk's end: its own blocks past the prefix, not the prefix's
    own = (-(-(BLOCK + 3) // store.chunk) * store.chunk - BLOCK) * CFG.kv_bytes_per_token
    assert (tmp_path / "b.kv").stat().st_blocks * 512 <= own + 8192
    assert store.reserved_bytes() - before == own


def test_the_publisher_keeps_one_copy_and_a_fork_shares_it(tmp_path):
    store = KVStore(tmp_path, CFG)
    prompt = tokens(2 * BLOCK + 50)
    a = store.create("a", capacity=1024)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=3)
    on_disk = (tmp_path / "a.kv").stat().st_blocks * 512
    store.publish_prefix(a, prompt)
    # the publisher maps the prefix file now and gave its own blocks for those rows back
    assert (tmp_path / "a.kv").stat().st_blocks * 512 <= on_disk - 2 * BLOCK * CFG.kv_bytes_per_token + 8192
    assert np.array_equal(a.data[:, :, :, : len(prompt)], rows)
    child = store.create("child", capacity=1024)
    assert store.fork_prefix(a, child, prompt) == 2 * BLOCK
    assert child.length == len(prompt)
    assert np.array_equal(child.data[:, :, :, : len(prompt)], rows)
    store.delete("a")  # the fork does not need its parent
    assert np.array_equal(child.data[:, :, :, : len(prompt)], rows)


def test_a_lookup_waits_for_an_announced_publication(tmp_path):
    import threading
    import time

    store = KVStore(tmp_path, CFG)
    prompt = tokens(BLOCK + 20)
    a = store.create("a", capacity=512)
    store.reserve(a, len(prompt))
    fill(a, 0, len(prompt), seed=4)
    store.prefixes.announce(prompt)

    def publish_late():
        time.sleep(0.3)
        store.publish_prefix(a, prompt, adopt=False)

    threading.Thread(target=publish_late).start()
    b = store.create("b", capacity=512)
    store.prefixes.await_announced(prompt)  # (outside the locks a lookup runs under)
    assert store.share_prefix(b, prompt) == BLOCK  # not a miss: it waited for the block being copied
    store.prefixes.announce(tokens(BLOCK, seed=99))
    store.prefixes.settle(tokens(BLOCK, seed=99))  # an announcement that came to nothing waits for nobody
    c = store.create("c", capacity=512)
    assert store.share_prefix(c, tokens(BLOCK, seed=99) + [1]) == 0


def test_sessions_push_unused_prefixes_out_of_a_full_cap(tmp_path):
    bpt = CFG.kv_bytes_per_token
    store = KVStore(tmp_path, CFG, cap_bytes=3 * BLOCK * bpt, chunk=BLOCK)
    p = tokens(BLOCK)
    a = store.create("a", capacity=4 * BLOCK)
    store.reserve(a, BLOCK)
    fill(a, 0, BLOCK, seed=1)
    store.publish_prefix(a, p, adopt=False)
    store.delete("a")  # the prefix file stays, mapped by nobody
    assert store.prefixes.status()["files"] == 1
    b = store.create("b", capacity=4 * BLOCK)
    store.reserve(b, 3 * BLOCK)  # the whole cap: the stored prefix is a cache, it goes
    assert store.prefixes.status()["files"] == 0


def test_a_memory_only_session_shares_publishes_and_unshares_prefixes_without_a_file(tmp_path):
    store = KVStore(tmp_path, CFG)
    prompt = tokens(2 * BLOCK + 40)
    a = store.create("a", capacity=1024, memory_only=True)  # an ephemeral request's KV
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=1)
    assert store.publish_prefix(a, prompt) == 2 * BLOCK  # adopted: a now maps the prefix file's pages
    assert np.array_equal(a.data[:, :, :, : len(prompt)], rows)
    b = store.create("b", capacity=1024, memory_only=True)
    assert store.share_prefix(b, prompt[: 2 * BLOCK] + tokens(30, seed=9)) == 2 * BLOCK
    assert np.array_equal(b.data[:, :, :, : 2 * BLOCK], rows[:, :, :, : 2 * BLOCK])
    store.unshare(b, BLOCK + 5)  # a template rewrite: b's own copy of what it keeps, in fresh memory
    b.data[:, :, :, BLOCK + 5] = 7
    assert np.array_equal(b.data[:, :, :, : BLOCK + 5], rows[:, :, :, : BLOCK + 5])
    assert np.array_equal(a.data[:, :, :, : 2 * BLOCK], rows[:, :, :, : 2 * BLOCK])  # the prefix is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefixes"]  # no session file, no sidecar
    assert store.session_ids() == [] and store.tiers()["sessions"] == 2
    store.delete("a", wait=False)
    store.delete("b")
    assert store.settle(5.0) and store.reserved_bytes() == store.prefixes.nbytes()
    assert store.prefixes.status()["in_use"] == 0


def test_short_prefixes_are_copied_block_by_block_and_leave_a_token_to_feed(tmp_path):
    from weaved.kv.hot_prefixes import BLOCK as HOT

    store = KVStore(tmp_path, CFG)
    prompt = tokens(3 * HOT + 5, seed=3)  # 53 tokens: three full short blocks
    a = store.create("a", capacity=512, memory_only=True)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=4)
    assert store.keep_prefix(a, prompt) == 3 and store.keep_prefix(a, prompt) == 0  # kept once
    b = store.create("b", capacity=512)
    other = prompt[: 2 * HOT] + tokens(20, seed=8)  # the same first two blocks, then its own
    assert store.cached_prefix(other) == 2 * HOT
    assert store.copy_prefix(b, other, 0) == 2 * HOT and b.length == 2 * HOT
    assert np.array_equal(b.data[:, :, :, : 2 * HOT], rows[:, :, :, : 2 * HOT])
    c = store.create("c", capacity=512)
    assert store.copy_prefix(c, prompt[: 3 * HOT], 0) == 2 * HOT  # all of it would leave nothing to feed
    d = store.create("d", capacity=512)
    assert store.copy_prefix(d, tokens(40, seed=9), 0) == 0  # nothing in common
    assert store.hot.status()["hits"] == 2 and store.hot.status()["copied_tokens"] == 4 * HOT
    # a changed token early on changes every later block's key
    changed = list(prompt)
    changed[3] = (changed[3] + 1) % 100
    assert store.cached_prefix(changed) == 0


def test_short_prefixes_past_a_prefix_file_and_their_memory_bound(tmp_path):
    from weaved.kv.hot_prefixes import BLOCK as HOT

    bpt = CFG.kv_bytes_per_token
    store = KVStore(tmp_path, CFG, cap_bytes=16 * 5 * HOT * bpt)  # short prefixes get a sixteenth: 5 blocks
    prompt = tokens(BLOCK + 2 * HOT + 3, seed=5)
    a = store.create("a", capacity=1024)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=6)
    assert store.publish_prefix(a, prompt) == BLOCK  # the 128-position block: a prefix file
    assert store.keep_prefix(a, prompt) == 2  # only what follows it is kept short
    b = store.create("b", capacity=1024)
    shared = store.share_prefix(b, prompt)
    assert shared == BLOCK and store.copy_prefix(b, prompt, shared) == BLOCK + 2 * HOT
    assert np.array_equal(b.data[:, :, :, : BLOCK + 2 * HOT], rows[:, :, :, : BLOCK + 2 * HOT])
    for i in range(4):  # more short prompts than fit: the least recently used blocks go
        p = tokens(HOT + 1, seed=20 + i)
        kv = store.create(f"s{i}", capacity=64, memory_only=True)
        store.reserve(kv, len(p))
        fill(kv, 0, len(p), seed=i)
        store.keep_prefix(kv, p)
    assert len(store.hot) == 5 and store.tiers()["short_prefixes"]["blocks"] == 5
    assert KVStore(tmp_path / "off", CFG, share=False).keep_prefix(a, prompt) == 0


def test_resident_kv_counts_a_shared_prefix_once(tmp_path):
    """Ten sessions mapping one prefix file: RAM holds its pages once, and so does the measure."""
    store = KVStore(tmp_path, CFG)
    prompt = tokens(2 * BLOCK + 8)
    a = store.create("a", capacity=1024)
    store.reserve(a, len(prompt))
    fill(a, 0, len(prompt), seed=4)
    store.publish_prefix(a, prompt)
    one = store.tiers()["ram_bytes"]
    others = []
    for i in range(10):
        kv = store.create(f"s{i}", capacity=1024)
        assert store.share_prefix(kv, prompt) == 2 * BLOCK
        np.asarray(kv.data[:, :, :, : 2 * BLOCK]).sum()  # read through every mapping: each maps the pages
        others.append(kv)
    prefix_bytes = 2 * BLOCK * CFG.kv_bytes_per_token
    assert store.tiers()["ram_bytes"] < one + prefix_bytes  # not ten more copies


def test_the_cap_counts_a_sessions_own_rows_not_the_prefix_it_maps(tmp_path):
    """A fork of a long conversation maps the conversation's blocks from a prefix file (counted once, with
    the prefixes): its reservation needs room only for the rows it adds."""
    bpt = CFG.kv_bytes_per_token
    store = KVStore(tmp_path, CFG, cap_bytes=6 * BLOCK * bpt, chunk=BLOCK)
    prompt = tokens(4 * BLOCK + 1)
    a = store.create("a", capacity=8 * BLOCK)
    store.reserve(a, 4 * BLOCK)
    fill(a, 0, 4 * BLOCK, seed=5)
    store.publish_prefix(a, prompt[:-1])  # a maps its 4 blocks from the prefix file now
    b = store.create("b", capacity=8 * BLOCK)
    assert store.share_prefix(b, prompt) == 4 * BLOCK
    store.reserve(b, 5 * BLOCK)  # the prefix's 4 blocks + 1 of b's own: within the 6-block cap
    with pytest.raises(KVCapExceeded):
        store.reserve(b, 7 * BLOCK)  # 3 of its own: 7 blocks in all


@pytest.mark.parametrize("keep, pages", [(10, 1), (BLOCK + 5, 1), (2 * BLOCK - 1, 1), (BLOCK + 5, 2)])
def test_a_rewrite_inside_a_shared_prefix_keeps_mapping_its_full_blocks_below_the_cut(tmp_path, monkeypatch,
                                                                                      keep, pages):
    """``unshare`` is called once the session's journal names only the positions before ``keep`` (a
    rewind, a history rewrite): the session goes on mapping the prefix's full blocks below ``keep`` and
    copies only the rows past them - and a stop then reopens it at ``keep`` with every row it names."""
    store = KVStore(tmp_path, CFG)
    prompt = tokens(2 * BLOCK + 10)
    a = store.create("a", capacity=1024)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=1)
    store.publish_prefix(a, prompt)
    b = store.create("b", capacity=1024)
    assert store.share_prefix(b, prompt) == 2 * BLOCK
    store.reserve(b, len(prompt))
    fill(b, 2 * BLOCK, len(prompt), seed=2)
    row = CFG.head_dim * 2
    page = max(mmap.PAGESIZE, pages * BLOCK * row)  # (pages=2: a block's run is half a page, as 64K pages)
    monkeypatch.setattr(store_prefixes.mmap, "PAGESIZE", page)
    store.unshare(b, keep)
    full = (keep // BLOCK) * BLOCK
    while full and (full * row) % page:  # the blocks kept mapped are whole pages of every run
        full -= BLOCK
    assert (b.shared.positions if b.shared is not None else 0) == full
    b.truncate(keep)
    fill(b, keep, keep + 3, seed=3)  # (the rewrite: its own rows, the prefix file untouched)
    assert np.array_equal(np.asarray(a.data[:, :, :, : 2 * BLOCK]), rows[:, :, :, : 2 * BLOCK])
    del store
    b2 = KVStore(tmp_path, CFG).open("b", keep)
    assert np.array_equal(b2.data[:, :, :, :keep], rows[:, :, :, :keep])
    assert (b2.shared.positions if b2.shared is not None else 0) == full


def test_a_prefix_found_for_a_session_cannot_be_evicted_before_it_is_mapped(tmp_path, monkeypatch):
    """Another thread's publication evicts unused prefixes: one just found for a new session is its
    session's already, so the session maps it (before, it could be gone between the lookup and the map)."""
    store = KVStore(tmp_path, CFG)
    prompt = tokens(BLOCK + 10)
    a = store.create("a", capacity=512)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=1)
    store.publish_prefix(a, prompt, adopt=False)
    get = store.prefixes.get

    def evicting_get(key):  # the race, made certain: an eviction of everything unused lands here
        store.prefixes.evict(free=1 << 40)
        return get(key)

    monkeypatch.setattr(store.prefixes, "get", evicting_get)
    b = store.create("b", capacity=512)
    assert store.share_prefix(b, prompt) == BLOCK
    assert np.array_equal(b.data[:, :, :, :BLOCK], rows[:, :, :, :BLOCK])
    assert store.prefixes.status()["in_use"] == 1


def test_a_durable_store_syncs_the_rows_then_the_sidecar_that_names_them(tmp_path, monkeypatch):
    """Under ``durability = "fsync"`` a session's sidecar (which names its shared prefix) reaches the disk
    after the rows and before the call returns - the journal, written next, may name those rows."""
    import os

    import weaved.kv.store_prefixes as store_prefixes

    store = KVStore(tmp_path, CFG, durable=True)
    prompt = tokens(BLOCK + 10)
    a = store.create("a", capacity=512)
    store.reserve(a, len(prompt))
    fill(a, 0, len(prompt), seed=1)
    store.publish_prefix(a, prompt, adopt=False)
    b = store.create("b", capacity=512)
    synced: list[str] = []
    fdatasync, fsync = os.fdatasync, os.fsync
    monkeypatch.setattr(store_prefixes.os, "fdatasync", lambda fd: synced.append("rows") or fdatasync(fd))
    monkeypatch.setattr(store_prefixes.os, "fsync", lambda fd: synced.append("meta") or fsync(fd))
    assert store.share_prefix(b, prompt) == BLOCK
    assert synced == ["rows", "meta", "meta"]  # the rows, the sidecar, the directory's entry for it
