"""Shared prefixes under the kernel's cap on a process's memory mappings: a mapped prefix costs a session
one mapping per (layer, k|v, head) run and the cap is ~65k, so the store counts them, and a session the
budget has no room for gets its own copy of the rows - the same bits, nothing recomputed - at its
creation, at a fork and at a restart."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest

from tests.kv.test_prefixes import tokens
from tests.kv.test_store import CFG, fill
from weaved.kv.cache import KVCache
from weaved.kv.map_budget import MapBudget
from weaved.kv.prefixes import BLOCK
from weaved.kv.store import KVStore

RUNS = CFG.n_layers * 2 * CFG.n_kv_heads  # 8: one alias a run, each splitting the session's mapping
ALIASED = 1 + 2 * RUNS  # what a session mapping a prefix counts


def process_maps() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


def published(store: KVStore, n_tokens: int) -> tuple[list[int], np.ndarray, KVCache]:
    prompt = tokens(n_tokens)
    a = store.create("a", capacity=1024)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=1)
    assert store.publish_prefix(a, prompt) == 2 * BLOCK  # the publisher maps it: ALIASED
    return prompt, rows, a


def test_sessions_past_the_budget_copy_the_prefix_and_give_every_mapping_back(tmp_path):
    budget = MapBudget(limit=4 * ALIASED + 2, spare=2)  # room for the publisher and three more aliases
    store = KVStore(tmp_path, CFG, maps=budget)
    prompt, rows, _ = published(store, 2 * BLOCK + 30)
    before = process_maps()
    kvs = []
    for i in range(6):
        kv = store.create(f"s{i}", capacity=1024)
        assert store.share_prefix(kv, prompt) == 2 * BLOCK
        assert np.array_equal(kv.data[:, :, :, :2 * BLOCK], rows[:, :, :, :2 * BLOCK])
        store.reserve(kv, 2 * BLOCK + 4)
        fill(kv, 2 * BLOCK, 2 * BLOCK + 4, seed=10 + i)  # its own rows past the prefix, as a turn writes
        kvs.append(kv)
    st = store.prefixes.status()
    assert st["hits"] == 6 and st["copied"] == 3 and st["in_use"] == 1
    assert budget.used == 4 * ALIASED + 3 and budget.refused == 3
    assert store.tiers()["memory_maps"]["refused"] == 3
    # the count is the kernel's, or a little above it (an alias at a mapping's end splits nothing)
    made = process_maps() - before
    assert 3 * ALIASED + 3 - 6 <= made <= 3 * ALIASED + 3
    # a copied session owns its rows: its file holds them, and it is nobody's user of the prefix file
    copied = json.loads((tmp_path / "s5.json").read_text())
    assert "prefix" not in copied and (tmp_path / "s5.kv").stat().st_blocks * 512 >= 2 * BLOCK * CFG.kv_bytes_per_token
    for i in range(6):
        store.delete(f"s{i}")
    del kvs, kv
    gc.collect()
    assert budget.used == ALIASED  # the publisher's, nothing else left counted
    # with room again, a new session maps the prefix
    kv = store.create("t", capacity=1024)
    store.share_prefix(kv, prompt)
    assert store.prefixes.status()["copied"] == 3 and budget.used == 2 * ALIASED


def test_a_session_taking_its_rows_back_keeps_its_pieces_counted_until_it_goes(tmp_path):
    budget = MapBudget(limit=10 * ALIASED, spare=1)
    store = KVStore(tmp_path, CFG, maps=budget)
    prompt, rows, _ = published(store, 2 * BLOCK + 30)
    kv = store.create("b", capacity=1024)
    store.share_prefix(kv, prompt)
    assert budget.used == 2 * ALIASED
    store.unshare(kv, BLOCK + 3)  # a rewrite inside the prefix: its file's runs remapped, still apart
    assert budget.used == 2 * ALIASED
    assert np.array_equal(kv.data[:, :, :, :BLOCK + 3], rows[:, :, :, :BLOCK + 3])
    store.delete("b")
    assert budget.used == ALIASED + 1  # (its anonymous pages: one mapping, until its arrays go)


def test_a_fork_past_the_budget_copies_its_parents_rows(tmp_path):
    budget = MapBudget(limit=ALIASED + 1, spare=1)  # the publisher's aliases only
    store = KVStore(tmp_path, CFG, maps=budget)
    prompt, rows, a = published(store, 2 * BLOCK + 30)
    child = store.create("child", capacity=1024)
    assert store.fork_prefix(a, child, prompt) == 2 * BLOCK  # from the prefix file's rows
    assert child.length == len(prompt)
    assert np.array_equal(child.data[:, :, :, :len(prompt)], rows)


def test_a_restart_without_room_to_map_a_prefix_copies_it_into_the_session(tmp_path):
    store = KVStore(tmp_path, CFG, maps=MapBudget(limit=100 * ALIASED, spare=1))
    prompt, rows, _ = published(store, 2 * BLOCK + 30)
    kv = store.create("b", capacity=1024)
    store.share_prefix(kv, prompt)
    store.reserve(kv, 2 * BLOCK + 4)
    own = fill(kv, 2 * BLOCK, 2 * BLOCK + 4, seed=7)
    length = kv.length
    del store, kv
    gc.collect()
    budget = MapBudget(limit=ALIASED + 2, spare=1)  # room for one session's aliases: "a" takes it
    store2 = KVStore(tmp_path, CFG, maps=budget)
    a = store2.open("a", len(prompt))
    b = store2.open("b", length)
    assert np.array_equal(b.data[:, :, :, :2 * BLOCK], rows[:, :, :, :2 * BLOCK])
    assert np.array_equal(b.data[:, :, :, 2 * BLOCK:length], own)
    assert store2.prefixes.status()["copied"] == 1 and "prefix" not in json.loads((tmp_path / "b.json").read_text())
    b.data[:, :, :, 0] = 3  # its own pages: writable, and only its
    assert np.array_equal(a.data[:, :, :, 0], rows[:, :, :, 0])


def _publish_unadopted(store: KVStore, prompt: list[int]) -> None:
    """Session "a" computes ``prompt``'s rows and publishes them as a prefix it does not map itself."""
    a = store.create("a", capacity=512)
    store.reserve(a, len(prompt))
    fill(a, 0, len(prompt), seed=1)
    store.publish_prefix(a, prompt, adopt=False)


@pytest.mark.parametrize("memory_only", [False, True])
def test_taking_a_prefix_back_gives_back_only_the_mappings_that_went(tmp_path, memory_only):
    """The budget counts what the process's map holds: a file-backed session's pieces stay apart after
    it takes its own rows back (each run remapped from the file opened anew), a memory-only one's
    merge again."""
    def held() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    store, prompt = KVStore(tmp_path, CFG), tokens(BLOCK + 10)
    _publish_unadopted(store, prompt)
    before, counted = held(), store.maps.status()["used"]
    b = store.create("b", capacity=512, memory_only=memory_only)
    store.share_prefix(b, prompt)
    store.unshare(b, 5)
    assert store.maps.status()["used"] - counted >= held() - before


@pytest.mark.parametrize("memory_only", [False, True])
def test_a_prefix_the_kernel_refuses_to_map_part_way_leaves_the_session_its_own_writable_pages(
        tmp_path, memory_only, monkeypatch):
    """A kernel that refuses one run's alias after others were mapped read-only: those runs are the
    session's own again (a write there would otherwise fault and take the process down), and the
    session, refused the prefix, computes its rows itself."""
    from weaved.kv.mapping import FileMapping

    store, prompt = KVStore(tmp_path, CFG), tokens(BLOCK + 10)
    _publish_unadopted(store, prompt)
    prefix_file = str(store.prefixes.get(store.prefixes.longest(prompt, len(prompt) - 1)[0].key).path)
    b = store.create("b", capacity=512, memory_only=memory_only)
    real, calls = FileMapping.alias, []

    def refuses_the_third(self, *args, **kw):
        calls.append(args)
        if len(calls) == 3:
            raise OSError(12, "Cannot allocate memory")
        return real(self, *args, **kw)

    monkeypatch.setattr(FileMapping, "alias", refuses_the_third)
    with pytest.raises(OSError):
        store.share_prefix(b, prompt)
    monkeypatch.setattr(FileMapping, "alias", real)
    with open("/proc/self/maps") as f:
        lines = [ln for ln in f if ln.rstrip().endswith(prefix_file)]
    assert lines == [], "the session still maps the prefix file"
    assert b.length == 0 and store.prefixes.status()["in_use"] == 0
    store.reserve(b, len(prompt))
    rows = fill(b, 0, len(prompt), seed=2)  # written where the prefix was mapped read-only
    assert np.array_equal(b.data[:, :, :, :len(prompt)], rows)
