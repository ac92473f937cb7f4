"""Single-process pieces of federation: the layer runner, shard layout, partial attention and merge,
the pipeline's split and plan, and one-node rings and pipelines against the CPU backend."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from weaved.kernels import attention as ka

from weaved.backends.base import Logits, SeqChunk
from weaved.backends.cpu import CPUBackend
from weaved.federation.comm import GroupSpec, PeerGroup, host_store
from weaved.federation.handoff import Handoff
from weaved.federation.layers import LayerRunner
from weaved.federation.partial import ShardBatch, merge
from weaved.federation.pipeline import PipelineMember, plan_microbatches, split_layers
from weaved.federation.qring import RingChunk, RingMember
from weaved.federation.ring_rows import StepRows
from weaved.federation.shards import ShardTable, join_shards, shard_length, split_kv

PROMPTS = [[1, 504, 3458, 282, 4649, 314, 253], [1, 19556, 905, 30], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3moe"])
def backend(request):
    return CPUBackend.from_file(request.getfixturevalue(request.param), threads=2)


def _solo(name: str) -> PeerGroup:
    """A group of one (no peers): the ring and pipeline code paths without transfers."""
    return PeerGroup.form(GroupSpec(name, 0, 1, timeout_s=5.0), host_store())


def test_runner_reproduces_cpu_backend_bit_for_bit(backend):
    runner = LayerRunner(backend)
    ref_kv = [backend.new_kv(64) for _ in PROMPTS]
    got_kv = [backend.new_kv(64) for _ in PROMPTS]
    ids = [np.array(p, np.int32) for p in PROMPTS]
    ref = backend.forward([SeqChunk(k, p, Logits.ALL) for k, p in zip(ref_kv, ids, strict=True)])
    got = runner.forward(got_kv, [np.array(p, np.int32) for p in PROMPTS], [Logits.ALL] * len(PROMPTS))
    for _ in range(3):  # then decode steps, batched
        toks = [np.array([int(np.argmax(r[-1]))], np.int32) for r in ref]
        ref = backend.forward([SeqChunk(k, t) for k, t in zip(ref_kv, toks, strict=True)])
        got = runner.forward(got_kv, toks)
        assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True))
    for a, b in zip(ref_kv, got_kv, strict=True):
        assert a.length == b.length and np.array_equal(a.data, b.data)


def test_runner_ranges_chain_to_the_whole_model(tiny_llama_deep):
    be = CPUBackend.from_file(tiny_llama_deep, threads=2)
    ids = np.array(PROMPTS[2], np.int32)
    kv = be.new_kv(32)
    (ref,) = be.forward([SeqChunk(kv, ids)])
    x = LayerRunner(be, 0, 2).embed(ids)
    seq_starts, pos0 = np.array([0, len(ids)], np.int64), np.zeros(1, np.int64)
    parts = []
    for a, b in [(0, 2), (2, 3), (3, 5)]:
        r = LayerRunner(be, a, b)
        part = r.new_kv(32)
        r.run(x, ka.kv_list([part.data]), seq_starts, pos0)
        parts.append(part.data[:, :, :, : len(ids)])
    assert np.array_equal(r.logits(x[-1:]), ref)
    assert np.array_equal(np.concatenate(parts), kv.data[:, :, :, : len(ids)])
    with pytest.raises(ValueError, match="bad layer range"):
        LayerRunner(be, 3, 3)


@pytest.mark.parametrize("length,n", [(0, 3), (1, 3), (7, 2), (10, 3), (11, 4)])
def test_shard_layout_round_trip(length, n):
    rng = np.random.default_rng(length)
    data = rng.standard_normal((2, 2, 2, 16, 4)).astype(np.float16)
    shards = split_kv(data, length, n)
    assert [s.shape[3] for s in shards] == [shard_length(length, r, n) for r in range(n)]
    assert sum(s.shape[3] for s in shards) == length
    assert max(s.shape[3] for s in shards) - min(s.shape[3] for s in shards) <= 1  # balanced
    out = np.zeros_like(data)
    join_shards(shards, length, out)
    assert np.array_equal(out[:, :, :, :length], data[:, :, :, :length])
    # shard_length agrees with counting, for ints and arrays
    lens = np.arange(20)
    for r in range(n):
        assert list(shard_length(lens, r, n)) == [sum(1 for p in range(m) if p % n == r) for m in lens]


def test_shard_batch_is_attend_partial_row_by_row():
    """One batched call over sessions' shards gives each row exactly ka.attend_partial's result."""
    rng = np.random.default_rng(1)
    L, Hkv, D, G = 2, 2, 16, 3
    shards = [rng.standard_normal((L, 2, Hkv, cap, D)).astype(np.float16) for cap in (40, 9, 700)]
    row_seq = np.array([0, 0, 1, 2, 2, 1])
    n_keys = np.array([40, 17, 0, 700, 513, 9])
    q = rng.standard_normal((len(row_seq), G * Hkv, D)).astype(np.float32)
    batch = ShardBatch(shards, row_seq, n_keys)
    for layer, (h0, h1) in itertools.product(range(L), [(0, 2), (1, 2)]):
        qg = np.ascontiguousarray(q[:, h0 * G : h1 * G])
        out, lse = batch.attend(qg, layer, h0, h1, 0.25)
        for t, (s, m) in enumerate(zip(row_seq, n_keys, strict=True)):
            kv = shards[s][layer, :, h0:h1, :m]
            o, l_ = ka.attend_partial(qg[t : t + 1], kv[0], kv[1], 0.25)
            assert np.array_equal(out[t : t + 1], o) and np.array_equal(lse[t : t + 1], l_)
    assert np.isneginf(batch.attend(q, 0, 0, 2, 0.25)[1][2]).all()  # a row with no keys: lse -inf


def test_merge_over_round_robin_shards_is_full_attention():
    """Attention merged over N round-robin shards equals attention over the whole KV (float64 truth)."""
    rng = np.random.default_rng(2)
    L, Hkv, D, H, T = 1, 2, 32, 6, 1100  # > 2 kernel chunks of keys
    data = rng.standard_normal((L, 2, Hkv, T, D)).astype(np.float16)
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    ref_out, ref_lse = ka.attend_partial_ref(q, data[0, 0], data[0, 1], 0.2)
    full_out, full_lse = ka.attend_partial(q, data[0, 0], data[0, 1], 0.2)
    for n in (1, 2, 3, 5):
        out, lse = np.zeros((1, H, D), np.float32), np.full((1, H), -np.inf, np.float32)
        for r, s in enumerate(split_kv(data, T, n)):
            o, l_ = ShardBatch([s], np.zeros(1), np.array([shard_length(T, r, n)])).attend(q, 0, 0, Hkv, 0.2)
            out, lse = merge(out, lse, o, l_)
        assert np.abs(out - ref_out).max() < 2e-6 and np.abs(lse - ref_lse).max() < 2e-5
        assert np.abs(out - full_out).max() < 2e-6
        if n == 1:  # one shard: the merge with the empty accumulator passes the partial through exactly
            assert np.array_equal(out, full_out) and np.array_equal(lse, full_lse)


def test_step_rows_own_the_positions_of_their_rank():
    cfg = type("C", (), {"n_layers": 1, "n_kv_heads": 1, "head_dim": 4})()
    n = 3
    tables = [ShardTable(cfg, r, n, lambda sid, cap: _kv(cap)) for r in range(n)]
    for t in tables:
        t.open(7, 30)
        t.open(8, 30)
    # session 7: 5 tokens at positions 0..4; session 8: 1 token at 0
    owned = {}
    for t in tables:
        rows = StepRows(t, np.array([7, 8]), np.array([0, 0]), np.array([5, 1]))
        owned[t.rank] = [(s, r.tolist(), l0, l1) for s, r, l0, l1 in rows.owned]
        rows.commit()
    assert owned == {0: [(0, [0, 3], 0, 2), (1, [5], 0, 1)], 1: [(0, [1, 4], 0, 2)], 2: [(0, [2], 0, 1)]}
    assert [t.kv[7].length for t in tables] == [2, 2, 1] and all(t.lengths[7] == 5 for t in tables)


def _kv(cap):
    from weaved.kv.cache import KVCache

    return KVCache(np.zeros((1, 2, 1, cap, 4), np.float16))


def test_split_layers_is_proportional():
    assert split_layers(30, [1, 1, 1]) == [(0, 10), (10, 20), (20, 30)]
    assert split_layers(30, [3, 1]) == [(0, 23), (23, 30)]  # 22.5 : 7.5, the tie to the first
    assert split_layers(5, [100, 1, 1]) == [(0, 3), (3, 4), (4, 5)]  # at least one layer each
    assert split_layers(2, [1.0]) == [(0, 2)]
    for bad in ([], [1, 0], [1] * 6):
        with pytest.raises(ValueError):
            split_layers(5, bad)


def test_plan_microbatches_cuts_across_prompts():
    plan = plan_microbatches([5, 2, 6], 4)
    assert plan == [[(0, 0, 4)], [(0, 4, 5), (1, 0, 2), (2, 0, 1)], [(2, 1, 5)], [(2, 5, 6)]]
    assert all(sum(e - s for _, s, e in mb) <= 4 for mb in plan)


def test_one_node_ring_is_the_cpu_backend(backend):
    """A ring of one: merged shard attention over the whole KV is the backend's attention, bit for bit,
    for decode rows, multi-token turns and ragged batches."""
    ring = RingMember(_solo("ring-solo"), backend.config, LayerRunner(backend))
    refs = []
    for s, p in enumerate(PROMPTS):
        kv = backend.new_kv(64)
        backend.forward([SeqChunk(kv, np.array(p, np.int32))])
        refs.append(backend.new_kv(64))
        backend.forward([SeqChunk(refs[-1], np.array(p, np.int32))])
        ring.open_session(s, 64, kv=kv)
    steps = [[(0, [3]), (1, [4]), (2, [5])], [(1, [6, 7, 8]), (2, [9])], [(0, [10]), (2, [11, 12])]]
    for step in steps:
        kinds = [Logits.ALL if len(t) > 1 else Logits.LAST for _, t in step]
        toks = [(s, np.array(t, np.int32), k) for (s, t), k in zip(step, kinds, strict=True)]
        got = ring.step([RingChunk(s, t, k) for s, t, k in toks])
        ref = backend.forward([SeqChunk(refs[s], t, k) for s, t, k in toks])
        assert all(np.array_equal(a, b) for a, b in zip(got, ref, strict=True))
    for s, kv in ring.shards.kv.items():
        assert kv.length == refs[s].length and np.array_equal(kv.data[:, :, :, : kv.length],
                                                              refs[s].data[:, :, :, : kv.length])
    with pytest.raises(ValueError, match="do not fit"):
        ring.step([RingChunk(0, np.arange(100, dtype=np.int32))])
    with pytest.raises(KeyError):
        ring.step([RingChunk(9, np.array([1], np.int32))])
    ring.stop()


def test_one_node_pipeline_is_the_cpu_backend(backend):
    made = []  # the hand-off's caches come from the factory, by session id (file-backed in a daemon)

    def factory(sid, capacity):
        made.append((sid, capacity))
        return backend.new_kv(capacity)

    pm = PipelineMember(_solo("pipe-solo"), backend, kv_factory=factory)
    prompts = [np.array(p, np.int32) for p in PROMPTS]
    L = backend.config.n_layers
    res = pm.prefill([1, 2, 3], prompts, ranges=[(0, L)], capacities=[32] * 3, mb_tokens=3)
    assert made == [(1, 32), (2, 32), (3, 32)]
    refs = [backend.new_kv(32) for _ in prompts]
    ref = backend.forward([SeqChunk(k, p) for k, p in zip(refs, prompts, strict=True)])
    assert all(np.array_equal(a, b) for a, b in zip(res.logits, ref, strict=True))
    for sid, r in zip([1, 2, 3], refs, strict=True):
        assert res.kv[sid].length == r.length and np.array_equal(res.kv[sid].data, r.data)
    kept = pm.prefill([4], prompts[:1], ranges=[(0, L)], capacities=[40], handoff=Handoff.KEEP)
    m = len(PROMPTS[0])
    assert kept.kv[4].capacity == 40 and np.array_equal(kept.kv[4].data[:, :, :, :m], refs[0].data[:, :, :, :m])
    with pytest.raises(ValueError, match="ranges"):
        pm.prefill([1], prompts[:1], ranges=[(0, 1)])
    pm.stop()


def test_a_peer_lost_mid_gather_leaves_the_cache_empty_for_the_local_prefill():
    """The gather hand-off writes this stage's own layers and the length before the other stages' blocks
    arrive: a peer lost then must leave the cache as empty as it came, or the engine's own prefill would
    start past positions that hold only some layers."""
    import itertools
    import threading
    from types import SimpleNamespace

    import numpy as np

    from weaved.federation.comm import PeerLost
    from weaved.federation.ring_backend import RingBackend
    from weaved.kv.cache import KVCache

    kv = KVCache(np.zeros((2, 2, 1, 64, 4), np.float16))

    def prefill(sids, prompts, *, ranges, capacities, handoff):
        kv.data[:1, :, :, :10] = 1  # its own layers, then the others' never come
        kv.length = 10
        raise PeerLost("g", 1, "gather", "its process is gone")

    home = SimpleNamespace(pipe=SimpleNamespace(prefill=prefill), targets={}, group=SimpleNamespace(name="g"))
    rb = object.__new__(RingBackend)  # (only what pipeline_gather touches)
    lost: list = []
    rb._lock, rb._ring, rb._stages = threading.Lock(), lambda: home, lambda h: [(0, 1), (1, 2)]
    rb.pipeline_min_tokens, rb._rids, rb._lost = 1, itertools.count(1), lost.append
    assert rb.pipeline_gather(kv, list(range(10))) is False
    assert kv.length == 0 and len(lost) == 1 and home.targets == {}


def test_a_pipelines_waits_allow_for_the_work_before_them(backend):
    """A stage's wait on its predecessors, and rank 0's on the drain, grow with the micro-batch: the
    allowance scales with tokens and stages, from this node's measured rate once it has one."""
    from weaved.backends.base import BackendStats
    from weaved.federation.node_report import MEASURED_AFTER
    from weaved.federation.pipeline import UNMEASURED_RATE, compute_allowance_s, stage_seconds_per_token

    L = backend.config.n_layers
    saved = backend.stats
    try:
        backend.stats = BackendStats()
        assert stage_seconds_per_token(backend, L) == 1 / UNMEASURED_RATE  # slow until measured
        backend.stats = BackendStats(prefill_tokens=MEASURED_AFTER, tokens=MEASURED_AFTER, seconds=MEASURED_AFTER / 400)
        spt = stage_seconds_per_token(backend, L // 2)
        assert spt == pytest.approx((L // 2) / (L * 400))
    finally:
        backend.stats = saved
    assert compute_allowance_s(2, 1000, spt) == pytest.approx(2 * compute_allowance_s(1, 1000, spt))
    assert compute_allowance_s(1, 2000, spt) == pytest.approx(2 * compute_allowance_s(1, 1000, spt))
    assert compute_allowance_s(1, 1000, spt) > 1000 * spt  # a margin over the estimate
