"""Shared prefixes on the torch backend's paged KV: a prefix's rows are held once per device whoever maps
them, promotion copies only each session's own tail, a shared block is never written (a session that
stops sharing gets its own copy first), and every session computes exactly what it would alone."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from weaved.backends.base import Logits, SeqChunk
from weaved.backends.cpu import CPUBackend
from weaved.backends.torch import TorchBackend
from weaved.backends.torch_paged import BLOCK
from weaved.kv.cache import KVCache
from weaved.kv.prefixes import BLOCK as PBLOCK
from weaved.kv.store import KVStore
from weaved.model.loader import open_model

PROMPT = [int(t) for t in np.random.default_rng(3).integers(5, 250, 2 * PBLOCK + 20)]
SHARED = 2 * PBLOCK


@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def setup(tiny_llama, tmp_path):
    gguf, cfg = open_model(tiny_llama)
    return CPUBackend(gguf, cfg, threads=2), TorchBackend(gguf, cfg, threads=1), KVStore(tmp_path, cfg)


def _feed(be, kv, tokens, logits=Logits.LAST) -> np.ndarray:
    return be.forward([SeqChunk(kv, np.asarray(tokens, np.int32), logits)])[0]


def _twin(kv: KVCache) -> KVCache:
    return KVCache(np.array(kv.data), kv.length)


def _sharers(cpu, store, n: int) -> list[KVCache]:
    """Session "a" prefills PROMPT on the CPU and publishes its prefix; n more map it and prefill their
    own tails."""
    a = store.create("a", capacity=1024)
    store.reserve(a, len(PROMPT))
    _feed(cpu, a, PROMPT)
    assert store.publish_prefix(a, PROMPT) == SHARED and a.shared is not None
    kvs = [a]
    for i in range(n):
        tail = [int(t) for t in np.random.default_rng(10 + i).integers(5, 250, 9 + i)]
        kv = store.create(f"s{i}", capacity=1024)
        assert store.share_prefix(kv, PROMPT[:SHARED] + tail) == SHARED
        store.reserve(kv, SHARED + len(tail))
        _feed(cpu, kv, tail)
        kvs.append(kv)
    return kvs


def _decode_together(be, kvs, tokens) -> list[np.ndarray]:
    out = be.forward([SeqChunk(kv, np.asarray([t], np.int32)) for kv, t in zip(kvs, tokens, strict=True)])
    return [o[-1] for o in out]


def test_promoting_sessions_that_share_a_prefix_copies_it_once(setup):
    cpu, tb, store = setup
    bpt = cpu.config.kv_bytes_per_token
    kvs = _sharers(cpu, store, 3)
    twins = [_twin(kv) for kv in kvs]
    assert tb.adopt(kvs[0]) == kvs[0].length * bpt  # the first brings the prefix with it
    for kv in kvs[1:]:
        assert tb.adopt(kv) == (kv.length - SHARED) * bpt  # the others only their own rows
    own_blocks = sum(-(-(kv.length - SHARED) // BLOCK) for kv in kvs)
    assert tb.device_kv_bytes() == (SHARED // BLOCK + own_blocks) * BLOCK * bpt
    tables = [tb._kv.table(kv) for kv in kvs]
    assert all(t.blocks[:SHARED // BLOCK] == tables[0].blocks[:SHARED // BLOCK] for t in tables)

    toks = [7, 8, 9, 10]
    for _ in range(3):  # decoding together on the device: each as it would on the CPU, bit for bit
        got = _decode_together(tb, kvs, toks)
        ref = [_feed(cpu, tw, [t])[-1] for tw, t in zip(twins, toks, strict=True)]
        for g, r in zip(got, ref, strict=True):
            assert np.array_equal(g, r)
        toks = [int(np.argmax(g)) for g in got]
    for kv, tw in zip(kvs, twins, strict=True):
        assert np.array_equal(kv.data[:, :, :, :kv.length], tw.data[:, :, :, :tw.length])  # written through


def test_a_session_that_stops_sharing_part_of_a_prefix_copies_those_blocks_first(setup):
    cpu, tb, store = setup
    a, b = _sharers(cpu, store, 1)
    ta, tw = _twin(a), _twin(b)
    for kv in (a, b):
        tb.adopt(kv)
    shared = list(tb._kv.table(a).blocks[:SHARED // BLOCK])
    before = tb._kv.pool[:, shared].clone()
    keep = PBLOCK + 5  # b rewrites from inside the prefix (e.g. an edited earlier message)
    store.unshare(b, keep)
    b.truncate(keep)
    tw.truncate(keep)
    assert b.shared is not None and b.shared.positions == PBLOCK  # (the full block below the cut: still shared)
    new = [11, 12, 13, 14]
    assert np.array_equal(_feed(tb, b, new, Logits.ALL), _feed(cpu, tw, new, Logits.ALL))
    per_key = PBLOCK // BLOCK
    assert len(tb._kv.table(b).shared) == 1 and tb._kv.table(b).blocks[:per_key] == shared[:per_key]
    assert not set(tb._kv.table(b).blocks[per_key:]) & set(shared)
    assert torch.equal(tb._kv.pool[:, shared], before)  # the shared blocks are untouched
    assert np.array_equal(_feed(tb, a, [15]), _feed(cpu, ta, [15]))


def test_a_prefix_computed_on_the_device_is_shared_from_its_blocks(setup):
    """The session that prefilled a prompt on the device and then published it lends its own blocks to
    the prefix: a second session promoted later copies only its tail."""
    cpu, tb, store = setup
    bpt = cpu.config.kv_bytes_per_token
    a = store.create("a", capacity=1024)
    store.reserve(a, len(PROMPT))
    _feed(tb, a, PROMPT)
    store.publish_prefix(a, PROMPT)
    own = list(tb._kv.table(a).blocks)
    store.reserve(a, len(PROMPT) + 1)
    _feed(tb, a, [3])  # its next step finds its rows shared: its blocks become the prefix's
    assert tb._kv.table(a).blocks == own and tb._kv.table(a).shared == a.shared.keys
    b = store.create("b", capacity=1024)
    assert store.share_prefix(b, PROMPT[:SHARED] + [4, 5, 6]) == SHARED
    store.reserve(b, SHARED + 3)
    tw = _twin(b)
    _feed(cpu, b, [4, 5])
    _feed(cpu, tw, [4, 5])
    assert tb.adopt(b) == 2 * bpt
    assert tb._kv.table(b).blocks[:SHARED // BLOCK] == own[:SHARED // BLOCK]
    assert np.array_equal(_feed(tb, b, [6]), _feed(cpu, tw, [6]))


def test_unused_prefix_blocks_stay_cached_until_a_session_needs_the_room(tiny_llama, tmp_path):
    gguf, cfg = open_model(tiny_llama)
    cpu = CPUBackend(gguf, cfg, threads=2)
    n_blocks = SHARED // BLOCK + 4
    tb = TorchBackend(gguf, cfg, threads=1, kv_bytes=n_blocks * BLOCK * cfg.kv_bytes_per_token)
    store = KVStore(tmp_path, cfg)
    a, b = _sharers(cpu, store, 1)
    tb.adopt(a)
    tb.adopt(b)
    tb.release(a)
    del b
    gc.collect()  # a dropped cache gives its blocks back
    assert tb._kv.used_blocks() == SHARED // BLOCK == tb._kv.prefix_blocks()  # the prefix, kept as a cache
    c = store.create("c", capacity=1024)
    store.reserve(c, 3 * BLOCK)
    _feed(cpu, c, list(range(20, 20 + 3 * BLOCK)))
    tb.adopt(c)  # needs 3 of the 4 free: no eviction yet
    assert tb._kv.prefix_blocks() == SHARED // BLOCK
    first = tb._kv._prefix[a.shared.keys[0]].blocks
    tb.prepare(c, 3 * BLOCK + 2 * BLOCK)  # two more blocks: the prefix's last block goes, its first stays
    assert list(tb._kv._prefix) == [a.shared.keys[0]] and tb._kv._prefix[a.shared.keys[0]].blocks == first
    assert tb._kv.used_blocks() == 5 + PBLOCK // BLOCK
