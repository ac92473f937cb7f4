"""KVStore: sparse per-session files, chunked reservation, cap, full disk, reopen, tiers."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

import numpy as np
import pytest

from weaved.kv.cache import KVCache
from weaved.kv.errors import DiskFull, KVCapExceeded, KVStoreError
from weaved.kv.store import KVStore
from weaved.model.config import ModelConfig, RopeSpec, RopeStyle

# Small shapes: 2 layers x k|v x 2 kv heads = 8 runs of 128-byte rows, 1 KiB per position.
CFG = ModelConfig(
    arch="llama", name="tiny", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=256,
    vocab_size=100, context_length=4096, rms_eps=1e-5, rope_style=RopeStyle.NORM, rope=RopeSpec(base=10000.0),
)
BPT = CFG.kv_bytes_per_token  # 1024
CHUNK = 256


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def fill(kv: KVCache, start: int, stop: int, seed: int) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal(kv.data[:, :, :, start:stop].shape).astype(np.float16)
    kv.data[:, :, :, start:stop] = rows  # [L, 2, Hkv, stop-start, D]
    kv.length = stop
    return rows


def test_create_is_sparse_and_matches_cache_layout(tmp_path):
    store = KVStore(tmp_path, CFG, chunk=CHUNK)
    kv = store.create("s1", capacity=65536)
    path = tmp_path / "s1.kv"
    assert kv.data.shape == (2, 2, 2, 65536, 64) and kv.data.dtype == np.float16
    assert kv.length == 0 and kv.capacity == 65536
    assert path.stat().st_size == 65536 * BPT  # 64 MiB logical
    assert allocated(path) < 64 * 1024  # ... costing (almost) nothing on disk
    assert (tmp_path / "s1.json").exists()
    assert store.session_ids() == ["s1"]


def test_reserve_grows_in_chunks(tmp_path):
    store = KVStore(tmp_path, CFG, chunk=CHUNK)
    kv = store.create("s1", capacity=4096)
    path = tmp_path / "s1.kv"
    slack = 64 * 1024  # file-system metadata blocks (extent tree)
    store.reserve(kv, 1)
    one_chunk = CHUNK * BPT
    assert one_chunk <= allocated(path) <= one_chunk + slack
    assert store.reserved_bytes() == one_chunk
    before = allocated(path)
    store.reserve(kv, CHUNK)  # still inside the first chunk: nothing to do
    assert allocated(path) == before
    store.reserve(kv, CHUNK + 1)
    assert 2 * one_chunk <= allocated(path) <= 2 * one_chunk + slack
    store.reserve(kv, 4000)  # several chunks at once, clipped to the capacity
    assert store.reserved_bytes() == 4096 * BPT
    with pytest.raises(KVStoreError, match="capacity"):
        store.reserve(kv, 4097)


def test_write_reopen_in_fresh_store_returns_same_bytes(tmp_path):
    store = KVStore(tmp_path, CFG, chunk=CHUNK)
    kv = store.create("sess-a", capacity=1000)
    store.reserve(kv, 300)
    rows = fill(kv, 0, 300, seed=1)
    store.flush(kv)
    del kv, store

    fresh = KVStore(tmp_path, CFG, chunk=CHUNK)
    assert fresh.session_ids() == ["sess-a"]
    kv2 = fresh.open("sess-a", length=300)
    assert kv2.length == 300 and kv2.capacity == 1000
    np.testing.assert_array_equal(kv2.data[:, :, :, :300], rows)
    # The reopened cache keeps growing normally.
    fresh.reserve(kv2, 700)
    more = fill(kv2, 300, 700, seed=2)
    fresh.flush(kv2)
    np.testing.assert_array_equal(kv2.data[:, :, :, 300:700], more)
    with pytest.raises(KVStoreError, match="already open"):
        fresh.open("sess-a", length=300)


def test_open_refuses_other_model_and_bad_requests(tmp_path):
    store = KVStore(tmp_path, CFG)
    store.create("s1", capacity=64)
    with pytest.raises(KVStoreError, match="already exists"):
        store.create("s1", capacity=64)
    other = KVStore(tmp_path, dataclasses.replace(CFG, name="other", rope=RopeSpec(base=500000.0)))
    with pytest.raises(KVStoreError, match="made for model"):
        other.open("s1", length=0)
    fresh = KVStore(tmp_path, CFG)
    with pytest.raises(KVStoreError, match="outside capacity"):
        fresh.open("s1", length=65)
    with pytest.raises(KVStoreError, match="no KV file"):
        fresh.open("missing", length=0)
    with pytest.raises(KVStoreError, match="not an open session"):
        fresh.reserve(KVCache.allocate(CFG, 8), 1)


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", "a.b", "x" * 65, "sp ace", "..", "é"])
def test_invalid_ids_refused(tmp_path, bad):
    store = KVStore(tmp_path, CFG)
    for call in (lambda: store.create(bad, 8), lambda: store.open(bad, 0), lambda: store.delete(bad)):
        with pytest.raises(KVStoreError, match="invalid session id"):
            call()
    assert list(tmp_path.iterdir()) == []


def test_cap_exceeded_names_cap_and_session_and_leaves_others_alone(tmp_path):
    cap = 2 * CHUNK * BPT
    store = KVStore(tmp_path, CFG, cap_bytes=cap, chunk=CHUNK)
    a = store.create("a", capacity=2048)
    b = store.create("b", capacity=2048)
    store.reserve(a, 100)
    rows = fill(a, 0, 100, seed=3)
    store.reserve(b, CHUNK)
    assert store.reserved_bytes() == cap
    with pytest.raises(KVCapExceeded, match=r"session b: the KV cap \([\d.]+ [KM]iB\) is full") as e:
        store.reserve(b, CHUNK + 1)
    # only other kept sessions hold the room: waiting does not help, deleting does
    assert not e.value.retryable and "DELETE /v1/sessions/ID" in e.value.message
    assert store.reserved_bytes() == cap  # nothing changed
    store.reserve(a, CHUNK)  # inside a's reservation: still fine
    np.testing.assert_array_equal(a.data[:, :, :, :100], rows)
    store.delete("b")  # frees b's reservation
    store.reserve(a, 2 * CHUNK)
    assert store.reserved_bytes() == cap


def test_cap_held_by_requests_in_flight_is_worth_a_retry(tmp_path):
    """Room held by sessions that end with their request (memory only) comes back by itself: the
    refusal says to retry; room held by kept sessions does not."""
    store = KVStore(tmp_path, CFG, cap_bytes=2 * CHUNK * BPT, chunk=CHUNK)
    kept = store.create("kept", capacity=1024)
    store.reserve(kept, CHUNK)
    passing = store.create("tmp-1", capacity=1024, memory_only=True)
    store.reserve(passing, CHUNK)
    new = store.create("new", capacity=1024)
    with pytest.raises(KVCapExceeded, match="requests in flight hold") as e:
        store.reserve(new, 10)
    assert e.value.retryable
    with pytest.raises(KVCapExceeded) as e:  # more than the passing request frees
        store.reserve(new, CHUNK + 10)
    assert not e.value.retryable
    store.delete("tmp-1")
    store.reserve(new, 10)


def test_rows_taken_back_give_their_room_back(tmp_path):
    """Positions reserved past a rewind's point go back to the cap (in whole chunks) and their blocks to the
    disk; the rows kept are untouched, and growing again allocates before writing."""
    from weaved.kv.tiers import allocated_bytes

    store = KVStore(tmp_path, CFG, cap_bytes=4 * CHUNK * BPT, chunk=CHUNK)
    a = store.create("a", capacity=2048)
    store.reserve(a, 3 * CHUNK)
    rows = fill(a, 0, 3 * CHUNK, seed=7)
    on_disk = allocated_bytes(tmp_path / "a.kv")
    a.truncate(10)
    store.release_past(a, 10)
    assert store.reserved_bytes() == CHUNK * BPT
    assert allocated_bytes(tmp_path / "a.kv") <= on_disk - 2 * CHUNK * BPT
    np.testing.assert_array_equal(a.data[:, :, :, :10], rows[:, :, :, :10])
    store.reserve(a, 2 * CHUNK)  # room again, allocated before it is written
    fill(a, 10, 2 * CHUNK, seed=8)
    mem = store.create("m", capacity=2048, memory_only=True)  # a session in memory: its accounting too
    store.reserve(mem, 2 * CHUNK)
    fill(mem, 0, 2 * CHUNK, seed=9)
    store.release_past(mem, CHUNK)
    assert store.reserved_bytes() == 3 * CHUNK * BPT


def test_cap_takes_exact_positions_when_a_whole_chunk_does_not_fit(tmp_path):
    store = KVStore(tmp_path, CFG, cap_bytes=300 * BPT, chunk=CHUNK)
    a, b = store.create("a", 1024), store.create("b", 1024)
    store.reserve(a, 10)  # a whole chunk: 256
    store.reserve(b, 10)  # 256 more would break the cap; 10 fit
    assert store.reserved_bytes() == (CHUNK + 10) * BPT
    store.reserve(b, 44)
    with pytest.raises(KVCapExceeded):
        store.reserve(b, 45)


def test_cap_counts_files_left_by_an_earlier_run(tmp_path):
    first = KVStore(tmp_path, CFG, chunk=CHUNK)
    kv = first.create("old", 1024)
    first.reserve(kv, 512)
    fill(kv, 0, 512, seed=4)
    del kv, first
    store = KVStore(tmp_path, CFG, cap_bytes=600 * BPT, chunk=CHUNK)
    assert store.reserved_bytes() >= 512 * BPT  # counted by allocated blocks before it is opened
    new = store.create("new", 1024)
    with pytest.raises(KVCapExceeded):
        store.reserve(new, 100)
    old = store.open("old", length=300)  # opened: still counted by the blocks it holds on disk (two chunks),
    assert store.reserved_bytes() == 512 * BPT  # which its next steps write into without allocating again
    with pytest.raises(KVCapExceeded):
        store.reserve(new, 100)
    store.reserve(old, 512)  # within what it holds: nothing more counted
    assert store.reserved_bytes() == 512 * BPT
    store.delete("old")
    store.reserve(new, 100)


def test_full_disk_is_a_clean_error(tmp_path, monkeypatch):
    store = KVStore(tmp_path, CFG, chunk=CHUNK)
    kv = store.create("s1", capacity=4096)
    store.reserve(kv, 10)
    fill(kv, 0, 10, seed=5)
    path = tmp_path / "s1.kv"
    before_disk, before_reserved = allocated(path), store.reserved_bytes()

    real = os.posix_fallocate
    calls = []

    def fallocate_until_full(fd, offset, length):
        calls.append(offset)
        if len(calls) > 3:  # a few runs succeed, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate_until_full)
    with pytest.raises(DiskFull, match="session s1.*No space left"):
        store.reserve(kv, 1000)
    assert store.reserved_bytes() == before_reserved
    assert allocated(path) == before_disk  # the runs allocated before the failure were given back
    monkeypatch.setattr(os, "posix_fallocate", real)
    store.reserve(kv, 1000)  # the next turn, with space again, proceeds
    fill(kv, 10, 1000, seed=6)
    assert store.reserved_bytes() == 1024 * BPT


def test_delete_removes_files(tmp_path):
    store = KVStore(tmp_path, CFG, chunk=CHUNK)
    kv = store.create("gone", 512)
    store.reserve(kv, 512)
    store.delete("gone")
    assert list(tmp_path.iterdir()) == []
    assert store.session_ids() == [] and store.reserved_bytes() == 0
    with pytest.raises(KVStoreError):
        store.reserve(kv, 1)
    store.delete("gone")  # idempotent
    store.create("gone", 16)  # the id can be reused


def held_by_process(path: Path) -> list[str]:
    """What in this process still holds ``path`` (unlinked or not): mappings and open descriptors."""
    held = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(path) in line]
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(path)):
                held.append(f"fd {fd}")
        except OSError:  # closed between listdir and readlink
            pass
    return held


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_delete_lets_go_of_the_file_while_its_cache_is_still_held(tmp_path):
    store = KVStore(tmp_path, CFG, chunk=CHUNK)
    kv = store.create("held", 1024)
    store.reserve(kv, 1024)
    fill(kv, 0, 1024, seed=3)
    path = tmp_path / "held.kv"
    assert held_by_process(path)  # mapped while the session lives
    before_fds = len(os.listdir("/proc/self/fd"))
    store.delete("held")  # an engine's step still holds kv (kept alive here)
    assert held_by_process(path) == []  # neither mapped (the disk blocks go now) nor open
    assert len(os.listdir("/proc/self/fd")) <= before_fds
    kv.data[:, :, :, :4] = 1.0  # a step in flight may still write: memory, no crash, no file
    assert float(kv.data[0, 0, 0, 0, 0]) == 1.0
    for i in range(20):  # deleting many sessions leaves nothing behind
        k = store.create(f"s{i}", 256)
        store.reserve(k, 256)
        store.delete(f"s{i}")
    assert not any("(deleted)" in line and str(tmp_path) in line
                   for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_a_delete_that_does_not_wait_lets_go_of_the_file_on_the_release_thread(tmp_path):
    store = KVStore(tmp_path, CFG, chunk=CHUNK)
    paths = []
    for i in range(8):
        kv = store.create(f"e{i}", 1024)
        store.reserve(kv, 300)
        fill(kv, 0, 300, seed=i)
        paths.append(tmp_path / f"e{i}.kv")
        store.delete(f"e{i}", wait=False)
        # the names and the reservation go at once: the id can be reused, nothing counts against the cap
        assert not paths[-1].exists() and store.reserved_bytes() == 0
        kv.data[:, :, :, :2] = 1.0  # the caller's cache stays usable whenever the release lands
    assert store.settle(timeout=10.0)
    assert [held_by_process(p) for p in paths] == [[]] * 8
    assert store.session_ids() == []


def test_tiers_numbers(tmp_path):
    store = KVStore(tmp_path, CFG, chunk=CHUNK)
    kv = store.create("a", capacity=8192)
    store.create("b", capacity=8192)
    store.reserve(kv, 1024)
    fill(kv, 0, 1024, seed=7)
    store.flush(kv)
    t = store.tiers()
    assert t["sessions"] == 2
    assert t["reserved_bytes"] == 1024 * BPT and t["cap_bytes"] is None
    assert 1024 * BPT <= t["file_bytes"] <= 1024 * BPT + 128 * 1024
    assert t["ram_measured"] is True
    # Just-written pages are in the page cache; nothing beyond the allocated blocks can be.
    assert 0 < t["ram_bytes"] <= t["file_bytes"]
    del kv
    fresh = KVStore(tmp_path, CFG).tiers()  # files not mapped by the store are measured too
    assert fresh["sessions"] == 2 and fresh["file_bytes"] == t["file_bytes"]
    assert 0 <= fresh["ram_bytes"] <= fresh["file_bytes"]


def test_rewrite_after_truncate_persists(tmp_path):
    store = KVStore(tmp_path, CFG, chunk=CHUNK)
    kv = store.create("s", capacity=512)
    store.reserve(kv, 100)
    fill(kv, 0, 100, seed=8)
    store.flush(kv)
    kv.truncate(40)
    store.flush(kv)  # nothing to write
    store.reserve(kv, 90)
    rows = fill(kv, 40, 90, seed=9)
    store.flush(kv)
    del kv, store
    kv2 = KVStore(tmp_path, CFG).open("s", length=90)
    np.testing.assert_array_equal(kv2.data[:, :, :, 40:90], rows)


def test_a_memory_only_session_has_no_file_and_counts_against_the_cap(tmp_path):
    store = KVStore(tmp_path, CFG, cap_bytes=1000 * BPT, chunk=CHUNK)
    kv = store.create("tmp-1", 1024, memory_only=True)
    assert kv.data.shape == (2, 2, 2, 1024, 64) and not (tmp_path / "tmp-1.kv").exists()
    store.reserve(kv, 300)
    rows = fill(kv, 0, 300, seed=4)
    assert store.reserved_bytes() == 512 * BPT  # whole chunks, as for a file
    with pytest.raises(KVCapExceeded):
        store.reserve(kv, 1001)
    store.flush(kv)  # durability has nothing to do for it
    assert np.array_equal(kv.data[:, :, :, :300], rows)
    assert store.tiers()["ram_bytes"] >= 300 * BPT
    with pytest.raises(KVStoreError, match="already exists"):
        store.create("tmp-1", 16)
    store.delete("tmp-1")
    assert store.reserved_bytes() == 0 and store.tiers()["sessions"] == 0
    kv.data[:, :, :, :2] = 1.0  # a step still in flight may write: fresh memory, no crash
