"""A prefix file on a disk with no room: the blocks are allocated before a row is written through the
mapping (a store into a page the disk cannot back is a SIGBUS, which kills the daemon), so a full disk is
an error that leaves nothing behind; a fork then copies its rows; a publication a crash cut is swept;
another model's files count against the prefixes' cap."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest

from tests.kv.test_prefixes import tokens
from tests.kv.test_store import CFG, fill
from weaved.kv.errors import DiskFull
from weaved.kv.prefixes import BLOCK, PrefixStore
from weaved.kv.store import KVStore


def _full(fd, offset, length):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_refuses_the_prefix_file_before_writing_it(tmp_path, monkeypatch):
    store = KVStore(tmp_path, CFG)
    prompt = tokens(2 * BLOCK + 10)
    a = store.create("a", capacity=1024)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=1)
    monkeypatch.setattr(os, "posix_fallocate", _full)
    with pytest.raises(DiskFull, match="shared prefix of 256 positions.*No space left"):
        store.publish_prefix(a, prompt)
    left = sorted(p.name for p in store.prefixes.dir.iterdir())
    assert left == []  # no temporary file, no sidecar
    assert store.prefixes.status()["files"] == 0
    assert np.array_equal(a.data[:, :, :, : len(prompt)], rows)  # the session's own rows are untouched
    monkeypatch.undo()
    assert store.publish_prefix(a, prompt) == 2 * BLOCK  # with room again, it is stored


def test_a_fork_without_room_for_a_prefix_file_copies_its_rows(tmp_path, monkeypatch):
    store = KVStore(tmp_path, CFG)
    prompt = tokens(2 * BLOCK + 10)
    a = store.create("a", capacity=1024)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=2)
    child = store.create("child", capacity=1024)
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate",
                        lambda fd, off, n: _full(fd, off, n) if ".kv.tmp" in os.readlink(f"/proc/self/fd/{fd}")
                        else real(fd, off, n))
    assert store.fork_prefix(a, child, prompt) == 0  # nothing shared ...
    assert child.length == len(prompt)
    assert np.array_equal(child.data[:, :, :, : len(prompt)], rows)  # ... every row copied


def test_what_a_crash_or_a_lost_file_left_is_swept_at_start(tmp_path):
    d = tmp_path / "prefixes"
    d.mkdir()
    (d / "0123.kv.tmp").write_bytes(b"\0" * 4096)
    (d / "4567.json").write_text('{"fingerprint": "fp", "key": "4567", "keys": ["4567"]}')  # cut before its file
    (d / "89ab.kv").write_bytes(b"\0" * 4096)  # its sidecar lost
    (d / "cdef.json").write_text('{"fing')  # a sidecar nobody can read, and its file
    (d / "cdef.kv").write_bytes(b"\0" * 4096)
    (d / "other.json").write_text('{"fingerprint": "another model", "key": "other", "keys": ["other"]}')
    (d / "other.kv").write_bytes(b"\0" * 4096)
    PrefixStore(d, CFG, "fp")
    assert sorted(p.name for p in d.iterdir()) == ["other.json", "other.kv"]  # another model's is kept


def test_a_full_disk_takes_back_stored_prefixes_nobody_maps_first(tmp_path, monkeypatch):
    """Stored prefixes are a cache: a session's blocks come before them when the disk has no room."""
    store = KVStore(tmp_path, CFG)
    prompt = tokens(2 * BLOCK + 10)
    a = store.create("a", capacity=1024)
    store.reserve(a, len(prompt))
    fill(a, 0, len(prompt), seed=3)
    store.publish_prefix(a, prompt)
    store.delete("a")  # the prefix file stays, mapped by nobody
    real = os.posix_fallocate

    def full_while_prefixes(fd, off, n):  # the disk has room only once the prefix file is gone
        if list(store.prefixes.dir.glob("*.kv")):
            _full(fd, off, n)
        real(fd, off, n)

    b = store.create("b", capacity=1024)
    monkeypatch.setattr(os, "posix_fallocate", full_while_prefixes)
    store.reserve(b, 300)
    assert store.prefixes.status()["files"] == 0 and b.length == 0
    c = store.create("c", capacity=1024)
    with pytest.raises(DiskFull):  # nothing left to give back: the disk is full
        monkeypatch.setattr(os, "posix_fallocate", _full)
        store.reserve(c, 300)


def test_another_models_prefix_files_count_against_the_cap_and_go_first(tmp_path):
    """A data directory that served another model keeps that model's prefix files for it, but their
    disk counts: in the status, and against the prefixes' cap, where they go before this model's."""
    bpt = CFG.kv_bytes_per_token
    d = tmp_path / "kv" / "prefixes"
    d.mkdir(parents=True)
    for name, age in (("old", 100), ("new", 50)):
        (d / f"{name}.json").write_text(f'{{"fingerprint": "another model", "key": "{name}", "keys": ["{name}"]}}')
        (d / f"{name}.kv").write_bytes(b"\0" * (BLOCK * bpt))
        t = time.time() - age
        os.utime(d / f"{name}.kv", (t, t))
    store = KVStore(tmp_path / "kv", CFG, cap_bytes=4 * 2 * BLOCK * bpt)  # prefixes get 2 blocks' bytes
    st = store.prefixes.status()
    assert st["other_models"] == {"files": 2, "bytes": 2 * BLOCK * bpt} and st["bytes"] == 2 * BLOCK * bpt
    a = store.create("a", capacity=512)
    store.reserve(a, BLOCK)
    fill(a, 0, BLOCK, seed=1)
    assert store.publish_prefix(a, tokens(BLOCK)) == BLOCK
    st = store.prefixes.status()  # one of the other model's files made room: the oldest
    assert st["other_models"] == {"files": 1, "bytes": BLOCK * bpt} and st["files"] == 1
    assert sorted(p.stem for p in d.glob("*.kv") if p.stem in ("old", "new")) == ["new"]
    assert not (d / "old.json").exists()
