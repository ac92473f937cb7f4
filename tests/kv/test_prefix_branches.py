"""A branch is stored once: conversations that share a long start (a system prompt and tools) and then
diverge each keep a file of their own blocks only, naming the file that holds the shared ones; sessions
map the chain and read the rows their publishers computed; a file with branches is kept while they are;
a restart, a clear, the cap and a session without mappings left all see the chain."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.kv.test_prefix_growth import conversation, prefix_disk
from tests.kv.test_prefixes import tokens
from tests.kv.test_store import BPT, CFG, allocated, fill
from weaved.kv import prefixes as prefix_module
from weaved.kv.prefixes import BLOCK, BRANCH_MIN_BLOCKS, MAX_CHAIN
from weaved.kv.store import KVStore

SHARED = BRANCH_MIN_BLOCKS * BLOCK  # the shortest start worth a branch


def diverging(n: int, seed: int, shared: list[int]) -> list[list[int]]:
    """``n`` prompts starting with ``shared``, then two blocks of their own each."""
    return [shared + tokens(2 * BLOCK + 7, seed=seed + i) for i in range(n)]


def stored(tmp_path, seed: int, n: int = 2) -> tuple[KVStore, list[list[int]], list[np.ndarray]]:
    """A store holding ``n`` conversations (sessions "a", "b", ...) that share a start of ``SHARED`` tokens
    and then diverge: the first's file, and a branch of it for each other; (store, prompts, their rows)."""
    store = KVStore(tmp_path, CFG)
    prompts = diverging(n, 10 * seed, tokens(SHARED, seed=seed))
    rows = [conversation(store, "abcdefgh"[i], p, seed=seed + i)[1] for i, p in enumerate(prompts)]
    return store, prompts, rows


def late_reads(store: KVStore, prompt: list[int], rows: np.ndarray, name: str = "late") -> None:
    """A new session maps the stored full blocks of ``prompt``: the rows ``rows`` holds there."""
    kv = store.create(name, capacity=2048, memory_only=True)
    n = len(prompt) // BLOCK * BLOCK
    assert store.share_prefix(kv, prompt + [0]) == n
    assert np.array_equal(kv.data[:, :, :, :n], rows[:, :, :, :n])


def test_diverging_conversations_store_the_shared_start_once(tmp_path):
    store = KVStore(tmp_path, CFG)
    shared = tokens(SHARED, seed=1)
    prompts = diverging(3, 10, shared)
    rows = [conversation(store, f"s{i}", p, seed=i + 1)[1] for i, p in enumerate(prompts)]
    st = store.prefixes.status()
    assert st["files"] == 3 and st["branched"] == 2 and st["branches"] == 2
    # the shared blocks on disk once: the root's six, each branch's own two (one file per prompt: 18)
    assert prefix_disk(store) < 11 * BLOCK * BPT
    assert st["bytes"] == 10 * BLOCK * BPT
    for i, p in enumerate(prompts):  # a new request of each conversation maps its chain: its rows
        kv = store.create(f"late{i}", capacity=2048, memory_only=True)
        n = len(p) // BLOCK * BLOCK
        assert store.share_prefix(kv, p + [5]) == n
        assert np.array_equal(kv.data[:, :, :, :SHARED], rows[0][:, :, :, :SHARED])
        assert np.array_equal(kv.data[:, :, :, SHARED:n], rows[i][:, :, :, SHARED:n])
    branch = next(p for p in store.prefixes._by_key.values() if p.parent is not None)
    assert branch.base == BRANCH_MIN_BLOCKS and allocated(branch.path) < 3 * BLOCK * BPT
    meta = json.loads(branch.path.with_suffix(".json").read_text())
    assert meta["parent"] == branch.parent and meta["base"] == BRANCH_MIN_BLOCKS


def test_a_branch_grows_in_place_and_branches_again(tmp_path):
    store, (a, b), (_, b_rows) = stored(tmp_path, 2)
    longer = b + tokens(BLOCK, seed=30)
    _, longer_rows = conversation(store, "b2", longer, seed=4)  # the branch's file grows
    st = store.prefixes.status()
    assert st["files"] == 2 and st["extended"] == 1
    deeper = longer[: 5 * BLOCK] + tokens(4 * BLOCK, seed=31)  # a branch of the branch, inside its own part
    _, deeper_rows = conversation(store, "c", deeper, seed=5)
    st = store.prefixes.status()
    assert st["files"] == 3 and st["branches"] == 2
    leaf = store.prefixes.longest(deeper, len(deeper) - 1)[0]
    chain = [(p.key, start, stop) for p, start, stop in store.prefixes.segments(leaf.key, 9 * BLOCK)]
    assert [c[1:] for c in chain] == [(0, SHARED), (SHARED, 5 * BLOCK), (5 * BLOCK, 9 * BLOCK)]
    kv = store.create("late", capacity=2048)  # a session with a file of its own maps all three
    assert store.share_prefix(kv, deeper + [1]) == 9 * BLOCK
    assert np.array_equal(kv.data[:, :, :, : 5 * BLOCK], longer_rows[:, :, :, : 5 * BLOCK])
    assert np.array_equal(kv.data[:, :, :, 5 * BLOCK: 9 * BLOCK], deeper_rows[:, :, :, 5 * BLOCK: 9 * BLOCK])
    assert np.array_equal(longer_rows[:, :, :, : len(b) // BLOCK * BLOCK], b_rows[:, :, :, : len(b) // BLOCK * BLOCK])


def test_a_conversation_diverging_inside_a_shared_start_branches_from_the_file_holding_it(tmp_path):
    """A conversation that leaves the root later than an earlier branch did branches from the root, not
    from that branch: every file of a chain holds some of its rows."""
    store = KVStore(tmp_path, CFG)
    shared = tokens(SHARED + 2 * BLOCK, seed=6)
    conversation(store, "a", shared + tokens(BLOCK, seed=60), seed=6)
    conversation(store, "b", shared[:SHARED] + tokens(3 * BLOCK, seed=61), seed=7)  # branch of the root at 4
    c = shared[: SHARED + BLOCK] + tokens(2 * BLOCK, seed=62)
    conversation(store, "c", c, seed=8)
    leaf = store.prefixes.longest(c, len(c) - 1)[0]
    root = store.prefixes.get(leaf.parent)
    assert leaf.base == BRANCH_MIN_BLOCKS + 1 and root.parent is None


def test_a_short_shared_start_or_a_deep_chain_starts_a_whole_file(tmp_path):
    store = KVStore(tmp_path, CFG)
    short = tokens((BRANCH_MIN_BLOCKS - 1) * BLOCK, seed=8)
    for i, p in enumerate(diverging(2, 40, short)):
        conversation(store, f"s{i}", p, seed=i)
    assert store.prefixes.status()["branched"] == 0
    store = KVStore(tmp_path / "deep", CFG)
    talk = tokens((MAX_CHAIN + 2) * 5 * BLOCK, seed=9)
    for depth in range(MAX_CHAIN + 1):  # each conversation branches from the one before, a block from its end
        n = SHARED + depth * 2 * BLOCK
        conversation(store, f"d{depth}", talk[:n] + tokens(2 * BLOCK, seed=50 + depth), seed=depth)
    files = store.prefixes._by_key.values()
    assert max(store.prefixes._chain(p) for p in files) == MAX_CHAIN
    assert sum(1 for p in files if p.parent is None) == 2  # the one past the deepest chain: whole again


def test_a_file_with_branches_is_kept_until_they_go(tmp_path):
    """Even over the prefixes' cap: its rows are the only copy of the branches' start."""
    store = KVStore(tmp_path, CFG, cap_bytes=12 * BLOCK * BPT)
    shared = tokens(SHARED, seed=10)
    a, b = diverging(2, 70, shared)
    conversation(store, "a", a, seed=10)
    conversation(store, "b", b, seed=11)
    store.delete("a")  # the root is mapped by nobody, but the branch that "b" maps needs it
    assert store.prefixes.evict(free=10**12) == 0
    assert store.prefixes.status()["files"] == 2
    root = next(p for p in store.prefixes._by_key.values() if p.parent is None)
    assert root.own == 6 * BLOCK
    late = store.create("late", capacity=2048, memory_only=True)
    assert store.share_prefix(late, b + [0]) == len(b) // BLOCK * BLOCK  # the chain still maps
    store.delete("late")
    store.delete("b")  # over the prefixes' cap (a quarter of the store's): the branch goes, then the root
    assert store.prefixes.status()["files"] == 0 and not list(store.prefixes.dir.glob("*.kv"))


def test_clear_keeps_the_files_a_mapped_branch_needs(tmp_path):
    store, (a, b, c), (_, _, c_rows) = stored(tmp_path, 12, 3)
    store.delete("a")
    store.delete("b")  # "c" maps its branch, which needs the root
    out = store.clear_prefixes()
    assert out["files"] == 1 and out["kept_files"] == 2
    late_reads(store, c, c_rows)


def test_a_restart_maps_chains_and_drops_branches_whose_parent_is_gone(tmp_path):
    store = KVStore(tmp_path, CFG)
    shared = tokens(SHARED, seed=15)
    a, b = diverging(2, 90, shared)
    conversation(store, "a", a, seed=15)
    kv = store.create("s", capacity=2048)  # a session with a file: reopened, it maps the chain again
    store.share_prefix(kv, b + [0])
    store.reserve(kv, len(b))
    rows = np.array(kv.data[:, :, :, : len(b)])
    rows[:, :, :, SHARED:] = fill(kv, SHARED, len(b), seed=16)
    store.publish_prefix(kv, b)
    assert store._open["s"].shared == len(b) // BLOCK * BLOCK
    del store, kv
    store = KVStore(tmp_path, CFG)
    assert store.prefixes.status()["branches"] == 1
    kv = store.open("s", len(b))
    assert np.array_equal(kv.data[:, :, :, : len(b)], rows)
    del kv
    store.delete("s")
    root = next(p for p in store.prefixes._by_key.values() if p.parent is None)
    del store
    root.path.with_suffix(".json").unlink()  # the root's sidecar lost: nothing can map the branch either
    store = KVStore(tmp_path, CFG)
    assert store.prefixes.status()["files"] == 0 and not list(store.prefixes.dir.glob("*.kv"))


def test_a_session_without_mappings_left_copies_the_chain(tmp_path, monkeypatch):
    store, (a, b), (a_rows, b_rows) = stored(tmp_path, 17)
    kv = store.create("c", capacity=2048)
    monkeypatch.setattr(kv_mapping_of(store, "c"), "claim_maps_upto", lambda n: False)
    n = len(b) // BLOCK * BLOCK
    assert store.share_prefix(kv, b + [0]) == n
    assert store.prefixes.status()["copied"] == 1 and store._open["c"].shared == 0
    assert np.array_equal(kv.data[:, :, :, :SHARED], a_rows[:, :, :, :SHARED])
    assert np.array_equal(kv.data[:, :, :, SHARED:n], b_rows[:, :, :, SHARED:n])


def test_a_rewrite_inside_the_shared_start_keeps_mapping_the_root(tmp_path):
    store, (a, b), (a_rows, _) = stored(tmp_path, 19)
    kv = store.create("c", capacity=2048)
    assert store.share_prefix(kv, b + [0]) == len(b) // BLOCK * BLOCK
    store.take_back(kv, 2 * BLOCK + 5)  # a rewind into the root's part
    assert store._open["c"].shared == 2 * BLOCK and kv.length == 2 * BLOCK + 5
    assert np.array_equal(kv.data[:, :, :, : 2 * BLOCK + 5], a_rows[:, :, :, : 2 * BLOCK + 5])
    store.reserve(kv, 3 * BLOCK)
    fill(kv, 2 * BLOCK + 5, 3 * BLOCK, seed=21)  # its own rows again: writable, and the files untouched
    late = store.create("late", capacity=2048, memory_only=True)
    assert store.share_prefix(late, a + [0]) == len(a) // BLOCK * BLOCK
    assert np.array_equal(late.data[:, :, :, :SHARED], a_rows[:, :, :, :SHARED])


def test_the_branch_threshold_is_the_modules(tmp_path, monkeypatch):
    """A shorter threshold branches a one-block shared start (the constant is what decides)."""
    monkeypatch.setattr(prefix_module, "BRANCH_MIN_BLOCKS", 1)
    store = KVStore(tmp_path, CFG)
    one = tokens(BLOCK, seed=22)
    for i, p in enumerate(diverging(2, 120, one)):
        conversation(store, f"s{i}", p, seed=i)
    assert store.prefixes.status()["branched"] == 1


def kv_mapping_of(store: KVStore, sid: str):
    return store._open[sid].mm


def test_a_publication_of_stored_blocks_seen_through_a_partial_index_changes_nothing(tmp_path, monkeypatch):
    """Lookups read the index off the lock: a publication of blocks a file already holds, which saw fewer
    of them held (an eviction rebuilding the index meanwhile), must not make that file a branch of
    itself (a chain walk that never ends) nor write it again."""
    store = KVStore(tmp_path, CFG)
    talk = tokens(SHARED + 4 * BLOCK, seed=23)
    _, rows = conversation(store, "a", talk, seed=23)
    (before,) = store.prefixes._by_key.values()
    monkeypatch.setattr(store.prefixes, "covered", lambda toks: SHARED + BLOCK)  # what the partial index said
    kv = store.create("b", capacity=2048, memory_only=True)
    store.reserve(kv, len(talk))
    fill(kv, 0, len(talk), seed=24)
    assert store.prefixes.publish(kv.data, talk) is None
    (after,) = store.prefixes._by_key.values()
    assert after is before and after.parent is None
    monkeypatch.undo()
    late_reads(store, talk, rows)


def test_a_chain_that_does_not_go_forward_or_a_bad_parent_is_removed_at_start(tmp_path):
    store, (a, b), _ = stored(tmp_path, 25)
    branch = next(p for p in store.prefixes._by_key.values() if p.parent is not None)
    meta = branch.path.with_suffix(".json")
    good = json.loads(meta.read_text())
    assert "keys" not in good  # (a version that knows no branches cannot read it: it removes it, never maps it)
    del store
    for bad in ({"parent": good["key"]}, {"parent": ["x"]}, {"parent": {}}, {"base": 0}):
        meta.write_text(json.dumps(good | bad))
        again = KVStore(tmp_path, CFG)  # no hang, no crash: the branch goes, the root stays
        assert again.prefixes.status()["files"] == 1 and not meta.exists() and not branch.path.exists()
        del again
        store = KVStore(tmp_path, CFG)
        conversation(store, f"b{len(bad)}{id(bad)}", b, seed=26)  # the branch made again for the next try
        assert store.prefixes.status()["branches"] == 1
        del store


def test_a_branch_of_a_file_unreadable_at_start_is_kept_for_a_later_start(tmp_path, monkeypatch):
    import pathlib

    store, (a, b), (_, b_rows) = stored(tmp_path, 27)
    root = next(p for p in store.prefixes._by_key.values() if p.parent is None)
    del store
    real = pathlib.Path.read_text

    def flaky(self, *args, **kwargs):
        if self == root.path.with_suffix(".json"):
            raise OSError(5, "Input/output error")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", flaky)
    store = KVStore(tmp_path, CFG)
    assert store.prefixes.status()["files"] == 0  # neither can be mapped now
    assert len(list(store.prefixes.dir.glob("*.kv"))) == 2  # nor is either removed
    del store
    monkeypatch.undo()
    late_reads(KVStore(tmp_path, CFG), b, b_rows)


def test_a_chain_file_that_cannot_be_opened_leaves_no_descriptor(tmp_path):
    from weaved.kv.errors import KVStoreError

    store, (a, b), _ = stored(tmp_path, 29)
    store.delete("a")
    store.delete("b")
    branch = next(p for p in store.prefixes._by_key.values() if p.parent is not None)
    os.rename(branch.path, branch.path.with_suffix(".gone"))  # the leaf of the chain: opened last
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(5):
        kv = store.create(f"c{i}", capacity=2048)
        with pytest.raises((KVStoreError, OSError)):
            store.share_prefix(kv, b + [0])
        store.delete(f"c{i}")
    assert len(os.listdir("/proc/self/fd")) == fds


def test_the_publisher_is_the_files_user_until_it_maps_it_or_declines(tmp_path):
    store = KVStore(tmp_path, CFG)
    talk = tokens(2 * BLOCK + 3, seed=31)
    kv = store.create("a", capacity=2048)
    store.reserve(kv, len(talk))
    fill(kv, 0, len(talk), seed=31)
    assert store.publish_prefix(kv, talk, adopt=False) == 2 * BLOCK
    (p,) = store.prefixes._by_key.values()
    assert p.users == set()  # declined: let go
    more = talk + tokens(2 * BLOCK, seed=32)
    store.reserve(kv, len(more))
    fill(kv, len(talk), len(more), seed=33)
    assert store.publish_prefix(kv, more) == 4 * BLOCK  # grown, and mapped by its publisher
    assert p.users == {"a"} and store._open["a"].prefix == p.key


@pytest.mark.parametrize("memory_only", [True, False])
def test_an_alias_refused_part_way_leaves_the_sessions_rows(tmp_path, monkeypatch, memory_only):
    """A publisher maps its new file over its own rows run by run: if the kernel refuses part-way, the runs
    already mapped get their own pages back holding the same rows - what the aliases replaced was private
    memory, or blocks an earlier adoption punched out of its file."""
    store, (a, b), _ = stored(tmp_path, 31)
    kv = store.create("s", capacity=2048, memory_only=memory_only)
    assert store.share_prefix(kv, b[: 5 * BLOCK] + [0]) == 5 * BLOCK  # the root's four, the branch's fifth
    store.reserve(kv, 8 * BLOCK)
    rows = np.array(kv.data[:, :, :, : 8 * BLOCK])
    rows[:, :, :, 5 * BLOCK:] = fill(kv, 5 * BLOCK, 8 * BLOCK, seed=32)
    mm, calls = store._open["s"].mm, []
    real = mm.alias

    def refuse_the_seventh(*args, **kwargs):
        calls.append(args)
        if len(calls) == 7:
            raise OSError(12, "Cannot allocate memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(mm, "alias", refuse_the_seventh)
    disk = 0 if memory_only else allocated(tmp_path / "s.kv")
    with pytest.raises(OSError):
        store.publish_prefix(kv, b[: 5 * BLOCK] + tokens(3 * BLOCK, seed=33))
    monkeypatch.undo()
    assert np.array_equal(kv.data[:, :, :, : 8 * BLOCK], rows)
    if not memory_only:  # disk for the three runs taken back alone (the others still map the chain)
        assert allocated(tmp_path / "s.kv") - disk <= 3 * 8 * BLOCK * CFG.head_dim * 2
    assert mm.claimed >= 3 * store.prefixes.runs()  # the runs past the refusal still map the chain's two files


def test_another_models_branch_goes_before_the_file_it_branches_from(tmp_path):
    """Other models' files go first, oldest first - but never a file that one of them branches from while
    that branch stays (the branch's rows mean nothing without it)."""
    store, _, _ = stored(tmp_path, 34)
    root = next(p for p in store.prefixes._by_key.values() if p.parent is None)
    for meta in store.prefixes.dir.glob("*.json"):  # as if another model had written them
        meta.write_text(json.dumps(json.loads(meta.read_text()) | {"fingerprint": "another-model"}))
    store.delete("a")
    store.delete("b")
    del store
    os.utime(root.path, (1e9, 1e9))  # the root the oldest by far: first in line, but for its branch
    store = KVStore(tmp_path, CFG)
    assert store.prefixes.status()["other_models"]["files"] == 2
    assert store.prefixes.evict(free=1) > 0  # one file's worth: the branch, though the root is older
    assert [f[1] for f in store.prefixes._foreign] == [root.path]
