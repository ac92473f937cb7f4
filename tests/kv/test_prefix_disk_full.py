"""A prefix file on a disk with no room: the blocks are allocated before a row is written through the
mapping (a store into a page the disk cannot back is a SIGBUS, which kills the daemon), so a full disk is
an error that leaves nothing behind; a fork then copies its rows; a publication a crash cut is swept."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from tests.kv.test_prefixes import tokens
from tests.kv.test_store import CFG, fill
from weaved.kv.prefixes import BLOCK, PrefixStore
from weaved.kv.store import DiskFull, KVStore


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
