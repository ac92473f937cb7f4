"""The KV store where a session is deleted while its rows are read, and where a stop (kill -9) falls
between two of its writes: what a restart finds must be what the journal says, never zeros under real
tokens' names."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from tests.kv.test_prefixes import tokens
from tests.kv.test_store import CFG, fill
from weaved.kv import store_prefixes
from weaved.kv.prefixes import BLOCK
from weaved.kv.store import KVStore, KVStoreError


def _deleted_maps(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if name in line and "(deleted)" in line)


def test_a_deleted_session_publishes_nothing(tmp_path):
    """A publication queued before the session's deletion and run after it (the publisher is behind)
    must not store the released rows - zeros - under its tokens' keys."""
    store = KVStore(tmp_path, CFG)
    prompt = tokens(BLOCK + 10)
    a = store.create("a", capacity=512)
    store.reserve(a, len(prompt))
    fill(a, 0, len(prompt), seed=3)
    store.delete("a")
    assert store.publish_prefix(a, prompt) == 0
    assert store.keep_prefix(a, prompt) == 0
    assert store.prefixes.covered(prompt) == 0 and store.cached_prefix(prompt) == 0


def test_rows_read_while_their_session_is_deleted_stay_its_own(tmp_path):
    """A copy reading a session's rows (``pinned``) sees them whole through a deletion; the mapping is
    let go of once the copy ends."""
    store = KVStore(tmp_path, CFG)
    a = store.create("a", capacity=512)
    store.reserve(a, 40)
    rows = fill(a, 0, 40, seed=5)
    with store.pinned(a) as open_:
        assert open_
        store.delete("a")
        assert not (tmp_path / "a.kv").exists()
        assert np.array_equal(a.data[:, :, :, :40], rows)  # not swapped for zeros under the reader
        assert _deleted_maps("a.kv") == 1
    assert store.settle(10)
    assert _deleted_maps("a.kv") == 0
    with store.pinned(a) as open_:
        assert not open_


def test_a_publication_racing_a_deletion_stores_real_rows_or_nothing(tmp_path):
    store = KVStore(tmp_path, CFG)
    prompt = tokens(BLOCK + 10)
    a = store.create("a", capacity=512)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=6)
    started, go = threading.Event(), threading.Event()
    real = store.prefixes.publish

    def slow_publish(data, toks, user=None):
        started.set()
        go.wait(10)
        return real(data, toks, user)

    store.prefixes.publish = slow_publish
    t = threading.Thread(target=lambda: store.publish_prefix(a, prompt, adopt=False))
    t.start()
    assert started.wait(10)
    store.delete("a")  # while the copy runs
    go.set()
    t.join(10)
    assert not t.is_alive()
    b = store.create("b", capacity=512)
    n = store.share_prefix(b, prompt)
    assert n == BLOCK and np.array_equal(b.data[:, :, :, :BLOCK], rows[:, :, :, :BLOCK])


def test_a_remade_file_is_not_taken_for_its_journals_rows(tmp_path):
    """A session's file made again after its loss holds none of the positions its journal names until
    its next turn computes them: a restart before then must find it so, not read zeros as its context."""
    store = KVStore(tmp_path, CFG)
    store.create("a", capacity=512, unfilled=True)
    restart = KVStore(tmp_path, CFG)
    with pytest.raises(KVStoreError, match="never computed"):
        restart.open("a", 30)
    kv = restart.open("a", 0)  # nothing named: nothing to mistake
    restart.filled(kv)
    restart.reserve(kv, 30)
    fill(kv, 0, 30, seed=1)
    assert KVStore(tmp_path, CFG).open("a", 30).length == 30


@pytest.mark.parametrize("committed", [0, 20])
def test_a_prefix_mapped_but_not_committed_is_not_mapped_again(tmp_path, committed):
    """A stop between mapping a stored prefix over a new session (its sidecar names it) and the journal's
    commit of those positions: at the restart the session holds what the journal says - its own rows,
    writable - not the prefix's read-only pages past its length (a write there would kill the daemon)."""
    store = KVStore(tmp_path, CFG)
    prompt = tokens(BLOCK + 10)
    a = store.create("a", capacity=512)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=2)
    assert store.publish_prefix(a, prompt) == BLOCK
    b = store.create("b", capacity=512)
    assert store.share_prefix(b, prompt) == BLOCK
    assert json.loads((tmp_path / "b.json").read_text())["prefix"]["positions"] == BLOCK
    restart = KVStore(tmp_path, CFG)
    kv = restart.open("b", committed)
    assert kv.length == committed and restart._open["b"].shared == 0
    assert "prefix" not in json.loads((tmp_path / "b.json").read_text())
    assert np.array_equal(kv.data[:, :, :, :committed], rows[:, :, :, :committed])
    restart.reserve(kv, BLOCK + 5)
    kv.data[:, :, :, committed:BLOCK + 5] = 1  # its own pages
    assert np.array_equal(restart.open("a", len(prompt)).data[:, :, :, :BLOCK], rows[:, :, :, :BLOCK])


def test_a_stop_while_adopting_a_prefix_keeps_the_rows(tmp_path, monkeypatch):
    """Publishing a session's rows as a prefix maps the prefix over them and frees its own copy: a stop
    after the copy is freed still finds the rows at the restart (the sidecar named the prefix first)."""
    store = KVStore(tmp_path, CFG)
    prompt = tokens(BLOCK + 10)
    a = store.create("a", capacity=512)
    store.reserve(a, len(prompt))
    rows = fill(a, 0, len(prompt), seed=4)
    runs, punched = store.prefixes.runs(), []
    real = store_prefixes.punch_hole

    def punch_then_stop(fd, off, n):
        real(fd, off, n)
        punched.append(off)
        if len(punched) == runs:
            raise SystemExit("stopped")  # the process dies here, every run's own rows freed

    monkeypatch.setattr(store_prefixes, "punch_hole", punch_then_stop)
    with pytest.raises(SystemExit):
        store.publish_prefix(a, prompt)
    restart = KVStore(tmp_path, CFG)
    kv = restart.open("a", len(prompt))
    assert np.array_equal(kv.data[:, :, :, :len(prompt)], rows)
