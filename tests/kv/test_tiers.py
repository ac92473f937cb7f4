"""Measuring a session's resident KV: only the rows it reserved are asked about, run by run, and the answer
is the page cache's (the same as asking about the whole mapping when nothing else is resident)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from tests.kv.test_store import CFG
from weaved.kv.store import KVStore
from weaved.kv.tiers import resident_bytes, runs_resident_bytes

ROW = CFG.head_dim * 2
RUNS = CFG.n_layers * 2 * CFG.n_kv_heads


@pytest.mark.skipif(resident_bytes(np.zeros(1)) is None, reason="no mincore here")
def test_runs_resident_bytes_counts_the_pages_of_the_asked_rows_in_every_run(tmp_path):
    store = KVStore(tmp_path, CFG)
    kv = store.create("a", capacity=1024)
    store.reserve(kv, 1024)
    per_page = mmap.PAGESIZE // ROW  # positions a page holds
    kv.data[:, :, :, :3 * per_page] = 1  # [L, 2, H, 3 pages of rows, D]: three pages a run
    assert runs_resident_bytes(kv.data, 0, 1024) == resident_bytes(kv.data) == 3 * RUNS * mmap.PAGESIZE
    assert runs_resident_bytes(kv.data, per_page, 2 * per_page) == RUNS * mmap.PAGESIZE
    assert runs_resident_bytes(kv.data, 3 * per_page, 1024) == 0
    assert runs_resident_bytes(kv.data, 5, 5) == 0
    # a row written past what the store counts for the session is not asked about
    kv.data[:, :, :, 1000] = 1
    assert runs_resident_bytes(kv.data, 0, 3 * per_page) == 3 * RUNS * mmap.PAGESIZE
    assert store.tiers()["ram_bytes"] >= 3 * RUNS * mmap.PAGESIZE
