"""A conversation published again further on (a fork after each turn, a longer prompt of the same start)
writes only its new blocks: its prefix file chains on the one holding the blocks before, a session maps
the whole chain, a restart reads it back, and a base is kept while a later prefix reads it."""

from __future__ import annotations

import numpy as np

from tests.kv.test_prefixes import tokens
from tests.kv.test_store import CFG, fill
from weaved.kv.prefixes import BLOCK, chain_keys
from weaved.kv.store import KVStore

BPT = CFG.kv_bytes_per_token


def _grown(tmp_path, store: KVStore):
    """One session whose conversation is published at 2 blocks, then at 4: (its tokens, its rows)."""
    conv = tokens(4 * BLOCK + 9, seed=7)
    a = store.create("a", capacity=1024)
    store.reserve(a, len(conv))
    rows = fill(a, 0, len(conv), seed=3)
    assert store.publish_prefix(a, conv[: 2 * BLOCK + 3]) == 2 * BLOCK
    assert store.publish_prefix(a, conv) == 4 * BLOCK
    return conv, rows


def test_a_later_prefix_writes_only_its_new_blocks_and_maps_whole(tmp_path):
    store = KVStore(tmp_path, CFG)
    conv, rows = _grown(tmp_path, store)
    files = sorted((tmp_path / "prefixes").glob("*.kv"), key=lambda p: p.stat().st_size)
    assert [f.stat().st_size for f in files] == [2 * BLOCK * BPT, 2 * BLOCK * BPT]  # not 2 then 4 blocks
    assert store.prefixes.status()["bytes"] == 4 * BLOCK * BPT
    b = store.create("b", capacity=1024)
    assert store.share_prefix(b, conv) == 4 * BLOCK
    assert np.array_equal(b.data[:, :, :, : 4 * BLOCK], rows[:, :, :, : 4 * BLOCK])
    # a restart: the chain is read back, and the session maps it again
    del store
    store2 = KVStore(tmp_path, CFG)
    b2 = store2.open("b", 4 * BLOCK)
    assert np.array_equal(b2.data[:, :, :, : 4 * BLOCK], rows[:, :, :, : 4 * BLOCK])
    c = store2.create("c", capacity=1024)
    assert store2.share_prefix(c, conv[: 3 * BLOCK] + [1]) == 3 * BLOCK  # part of the later file: its chain too
    assert np.array_equal(c.data[:, :, :, : 3 * BLOCK], rows[:, :, :, : 3 * BLOCK])


def test_forks_at_successive_points_store_each_block_once(tmp_path):
    store = KVStore(tmp_path, CFG)
    conv = tokens(6 * BLOCK, seed=8)
    parent = store.create("p", capacity=2048)
    store.reserve(parent, len(conv))
    rows = fill(parent, 0, len(conv), seed=4)
    for i, n in enumerate((2 * BLOCK + 5, 3 * BLOCK + 5, 4 * BLOCK + 5, 6 * BLOCK)):
        child = store.create(f"c{i}", capacity=2048)
        store.fork_prefix(parent, child, conv[:n])
        assert np.array_equal(child.data[:, :, :, :n], rows[:, :, :, :n])
    assert store.prefixes.status()["bytes"] == 6 * BLOCK * BPT  # every block once


def test_a_base_is_kept_while_a_later_prefix_reads_it(tmp_path):
    store = KVStore(tmp_path, CFG, cap_bytes=4 * 2 * BLOCK * BPT)  # prefixes get a quarter: 2 blocks
    conv, rows = _grown(tmp_path, store)
    store.delete("a")  # nobody maps either file now; they are over the prefixes' cap
    store.prefixes.evict()
    kept = store.prefixes.status()["files"]
    b = store.create("b", capacity=1024)
    if kept:  # whatever stays is readable whole: no file is left without its base
        n = store.share_prefix(b, conv)
        assert np.array_equal(b.data[:, :, :, :n], rows[:, :, :, :n])
    assert store.prefixes.nbytes() <= store.prefixes.cap_bytes


def test_a_prefix_whose_base_is_gone_is_dropped_at_start(tmp_path):
    store = KVStore(tmp_path, CFG)
    conv, _ = _grown(tmp_path, store)
    base = store.prefixes.get(chain_keys(store.fingerprint, conv)[1])  # the file of the first two blocks
    del store
    base.path.unlink()
    store2 = KVStore(tmp_path, CFG)
    assert store2.prefixes.status()["files"] == 0 and not list((tmp_path / "prefixes").glob("*"))
    assert store2.prefixes.covered(conv) == 0
