"""Attention kernels vs float64 references: ragged causal batches, GQA, lse, batch invariance,
partial attention and the merge of shards, KV stores, input validation."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from weaved.kernels import attention as A
from weaved.kernels.threads import run_on_kernel_thread

N_LAYERS = 2
LAYER = 1


def make_kvs(rng, lengths: list[int], n_kv: int, head_dim: int) -> list[np.ndarray]:
    """One float16 kv array per sequence, positions 0..length-1 of every layer filled at random."""
    kvs = []
    for n in lengths:
        cap = n + 3
        kv = np.zeros((N_LAYERS, 2, n_kv, cap, head_dim), np.float16)
        kv[:, :, :, :n] = rng.standard_normal((N_LAYERS, 2, n_kv, n, head_dim)).astype(np.float16)
        kvs.append(kv)
    return kvs


def batch(seqs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(seq_starts, pos0) of sequences given as (first position, number of new rows)."""
    starts = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int64)
    return starts, np.array([p for p, _ in seqs], np.int64)


def run_attend(q, kvs, seqs, scale, window=0):
    seq_starts, pos0 = batch(seqs)
    out = np.empty_like(q)
    lse = np.empty(q.shape[:2], np.float32)
    A.attend(q, A.kv_list(kvs), LAYER, seq_starts, pos0, scale, out, lse, window)
    return out, lse


# ragged batches: prefill chunks crossing block (64) and chunk (512) boundaries, single decode rows
BATCHES = [
    [(0, 1)],
    [(0, 7)],
    [(0, 70), (5, 1), (300, 1)],
    [(5, 0), (0, 3), (9, 0)],  # sequences without rows this step
    [(250, 20), (0, 1), (511, 2), (63, 3), (17, 1), (1020, 6)],
]


# GQA ratios 1, 3, 4 (and 5, 8: more heads than one register tile); head_dim 24 takes the plain path
SHAPES = [(4, 4, 64), (6, 2, 64), (8, 2, 32), (9, 3, 64), (10, 2, 64), (8, 1, 128), (4, 1, 24)]


@pytest.mark.parametrize("n_heads,n_kv,head_dim", SHAPES)
@pytest.mark.parametrize("seqs", BATCHES)
def test_attend_matches_float64_reference(n_heads, n_kv, head_dim, seqs):
    rng = np.random.default_rng(len(seqs) * 100 + n_heads * 10 + head_dim)
    kvs = make_kvs(rng, [p + n for p, n in seqs], n_kv, head_dim)
    T = sum(n for _, n in seqs)
    q = rng.standard_normal((T, n_heads, head_dim)).astype(np.float32)
    scale = 1.0 / np.sqrt(head_dim)
    out, lse = run_attend(q, kvs, seqs, scale)
    ref_out, ref_lse = A.attend_ref(q, kvs, LAYER, *batch(seqs), scale)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("window", [1, 5, 64, 100, 512, 700])
def test_sliding_window_matches_float64_reference(window):
    """A windowed row at position p attends keys p - window + 1 .. p: rows before, at and past the
    window's first fill, crossing block and chunk boundaries of the window."""
    rng = np.random.default_rng(window)
    seqs = [(0, 9), (90, 20), (600, 3), (1030, 1), (3, 1)]
    kvs = make_kvs(rng, [p + n for p, n in seqs], 2, 64)
    q = rng.standard_normal((sum(n for _, n in seqs), 6, 64)).astype(np.float32)
    out, lse = run_attend(q, kvs, seqs, 0.125, window)
    ref_out, ref_lse = A.attend_ref(q, kvs, LAYER, *batch(seqs), 0.125, window)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)
    full, _ = run_attend(q, kvs, seqs, 0.125)
    assert np.array_equal(out[:min(window, 9)], full[:min(window, 9)])  # fewer keys than the window: no change
    if window < 90:
        assert not np.allclose(out[9:], full[9:])  # the window hides keys


def test_windowed_rows_are_bit_identical_alone_and_in_a_batch():
    rng = np.random.default_rng(9)
    seqs = [(40, 30), (700, 2), (2, 5)]
    kvs = make_kvs(rng, [p + n for p, n in seqs], 1, 64)
    q = rng.standard_normal((37, 4, 64)).astype(np.float32)
    out, lse = run_attend(q, kvs, seqs, 0.0625, 48)
    starts, _ = batch(seqs)
    for s, (p, n) in enumerate(seqs):
        for i in range(n):
            t = starts[s] + i
            o1, l1 = run_attend(q[t:t + 1].copy(), [kvs[s]], [(p + i, 1)], 0.0625, 48)
            assert np.array_equal(o1[0], out[t]) and np.array_equal(l1[0], lse[t])


def test_lse_is_log_sum_exp_of_scores():
    rng = np.random.default_rng(1)
    kvs = make_kvs(rng, [40], 2, 64)
    q = (rng.standard_normal((1, 4, 64)) * 3).astype(np.float32)
    _, lse = run_attend(q, kvs, [(39, 1)], 0.5)
    k = kvs[0][LAYER, 0].astype(np.float64)[:, :40]  # [2, 40, 64]
    for h in range(4):
        scores = 0.5 * k[h // 2] @ q[0, h].astype(np.float64)
        assert lse[0, h] == pytest.approx(np.log(np.sum(np.exp(scores))), rel=1e-6)


def test_rows_are_bit_identical_across_batch_compositions(monkeypatch):
    """A row's out and lse do not depend on the other rows of the batch, on how the work is cut into
    per-thread runs, or on the thread count."""
    rng = np.random.default_rng(2)
    seqs = [(250, 20), (0, 1), (700, 3), (63, 3), (17, 1)]
    kvs = make_kvs(rng, [p + n for p, n in seqs], 3, 64)
    T = sum(n for _, n in seqs)
    q = rng.standard_normal((T, 9, 64)).astype(np.float32)
    out, lse = run_attend(q, kvs, seqs, 0.125)
    starts, _ = batch(seqs)
    for s, (p, n) in enumerate(seqs):  # every row alone, as one decode step
        for i in range(n):
            t = starts[s] + i
            o1, l1 = run_attend(q[t:t + 1].copy(), [kvs[s]], [(p + i, 1)], 0.125)
            assert np.array_equal(o1[0], out[t]) and np.array_equal(l1[0], lse[t])
    # the batch in another order, cut into 7 runs, on one thread
    order = [3, 0, 4, 2, 1]
    q2 = np.concatenate([q[starts[s]:starts[s + 1]] for s in order])
    monkeypatch.setattr(A, "_SLICES", 7)
    # (numba's thread count is its calling thread's: the kernels' regions start on the kernel thread)
    prev = run_on_kernel_thread(numba.get_num_threads)
    run_on_kernel_thread(lambda: numba.set_num_threads(1))
    try:
        o2, l2 = run_attend(q2, [kvs[s] for s in order], [seqs[s] for s in order], 0.125)
    finally:
        run_on_kernel_thread(lambda: numba.set_num_threads(prev))
    assert np.array_equal(o2, np.concatenate([out[starts[s]:starts[s + 1]] for s in order]))
    assert np.array_equal(l2, np.concatenate([lse[starts[s]:starts[s + 1]] for s in order]))


@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(8, 8, 64), (16, 8, 128), (12, 3, 64), (16, 2, 256)])
def test_prompt_rows_sharing_a_tile_equal_each_row_alone(n_heads, n_kv, head_dim):
    """A prompt's consecutive rows read each K/V block once for the whole tile (one to sixteen rows,
    by the GQA ratio); each row's bits are still those of the row attended alone, across a chunk
    boundary (512) and with the tile's rows ending in different blocks."""
    rng = np.random.default_rng(5)
    seqs = [(470, 61), (0, 1), (30, 37)]
    kvs = make_kvs(rng, [p + n for p, n in seqs], n_kv, head_dim)
    T = sum(n for _, n in seqs)
    q = rng.standard_normal((T, n_heads, head_dim)).astype(np.float32)
    out, lse = run_attend(q, kvs, seqs, 0.1)
    starts, _ = batch(seqs)
    for s, (p, n) in enumerate(seqs):
        for i in range(n):
            t = starts[s] + i
            o1, l1 = run_attend(q[t:t + 1].copy(), [kvs[s]], [(p + i, 1)], 0.1)
            assert np.array_equal(o1[0], out[t]) and np.array_equal(l1[0], lse[t]), (s, i)
    # a shard's rows (all the same keys) are tiles too
    k, v = kvs[0][LAYER, 0, :, :530], kvs[0][LAYER, 1, :, :530]
    o_all, l_all = A.attend_partial(q[:20], k, v, 0.1)
    for t in (0, 7, 19):
        o1, l1 = A.attend_partial(q[t:t + 1].copy(), k, v, 0.1)
        assert np.array_equal(o1[0], o_all[t]) and np.array_equal(l1[0], l_all[t])


def test_rows_taken_in_groups_are_unchanged(monkeypatch):
    """Batches too large for the scratch are processed in groups of rows: same bits."""
    rng = np.random.default_rng(3)
    seqs = [(0, 40), (600, 2), (100, 30)]
    kvs = make_kvs(rng, [p + n for p, n in seqs], 2, 32)
    q = rng.standard_normal((72, 4, 32)).astype(np.float32)
    out, lse = run_attend(q, kvs, seqs, 0.2)
    monkeypatch.setattr(A, "_SCRATCH_FLOATS", 4 * (32 + 2) * 3)  # about 3 chunks per group
    o2, l2 = run_attend(q, kvs, seqs, 0.2)
    assert np.array_equal(out, o2) and np.array_equal(lse, l2)


def test_kv_store_writes_float16_rows_in_place():
    rng = np.random.default_rng(4)
    kvs = [np.zeros((N_LAYERS, 2, 2, 10, 32), np.float16) for _ in range(2)]
    k = (rng.standard_normal((5, 2, 32)) * 100).astype(np.float32)
    v = rng.standard_normal((5, 2, 32)).astype(np.float32)
    seq_starts, pos0 = batch([(3, 2), (7, 3)])
    A.kv_store(A.kv_list(kvs), LAYER, seq_starts, pos0, k, v)
    expect = [np.zeros_like(kvs[0]), np.zeros_like(kvs[1])]
    expect[0][LAYER, 0, :, 3:5] = k[0:2].transpose(1, 0, 2)
    expect[0][LAYER, 1, :, 3:5] = v[0:2].transpose(1, 0, 2)
    expect[1][LAYER, 0, :, 7:10] = k[2:5].transpose(1, 0, 2)
    expect[1][LAYER, 1, :, 7:10] = v[2:5].transpose(1, 0, 2)
    for got, want in zip(kvs, expect, strict=True):  # numpy's float16 rounding, bit for bit
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_kv_store_then_attend_through_a_memory_map(tmp_path):
    rng = np.random.default_rng(5)
    shape = (N_LAYERS, 2, 2, 8, 16)
    kv = np.lib.format.open_memmap(tmp_path / "kv.npy", mode="w+", dtype=np.float16, shape=shape)
    k = rng.standard_normal((8, 2, 16)).astype(np.float32)
    A.kv_store([kv], LAYER, *batch([(0, 8)]), k, k)
    assert np.array_equal(kv[LAYER, 0], k.astype(np.float16).transpose(1, 0, 2))
    q = rng.standard_normal((8, 4, 16)).astype(np.float32)
    out, lse = run_attend(q, [kv], [(0, 8)], 0.25)
    ref_out, ref_lse = A.attend_ref(q, [np.asarray(kv)], LAYER, *batch([(0, 8)]), 0.25)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-6)


@pytest.mark.parametrize("n_heads,n_kv,head_dim,length", [(4, 4, 64, 300), (6, 2, 64, 5), (8, 2, 48, 1000)])
def test_attend_partial_matches_reference(n_heads, n_kv, head_dim, length):
    rng = np.random.default_rng(6)
    kv = make_kvs(rng, [length], n_kv, head_dim)[0]
    q = rng.standard_normal((3, n_heads, head_dim)).astype(np.float32)
    k, v = kv[LAYER, 0, :, :length], kv[LAYER, 1, :, :length]  # strided views of the kv array
    out, lse = A.attend_partial(q, k, v, 0.3)
    ref_out, ref_lse = A.attend_partial_ref(q, k, v, 0.3)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("split", [1, 64, 200, 399])
def test_merged_shards_equal_attention_over_all_keys(split):
    rng = np.random.default_rng(7)
    kv = make_kvs(rng, [400], 3, 64)[0]
    q = (rng.standard_normal((2, 9, 64)) * 2).astype(np.float32)
    k, v = kv[LAYER, 0, :, :400], kv[LAYER, 1, :, :400]
    oa, la = A.attend_partial(q, k[:, :split], v[:, :split], 0.125)
    ob, lb = A.attend_partial(q, k[:, split:], v[:, split:], 0.125)
    out, lse = A.merge_partials(oa, la, ob, lb)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    ref_out, ref_lse = A.attend_partial_ref(q, k, v, 0.125)
    np.testing.assert_allclose(out, ref_out, atol=3e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)
    full_out, full_lse = A.attend_partial(q, k, v, 0.125)
    np.testing.assert_allclose(out, full_out, atol=3e-6)
    np.testing.assert_allclose(lse, full_lse, atol=3e-6)


def test_empty_shard():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    empty = np.zeros((2, 0, 16), np.float16)
    out_e, lse_e = A.attend_partial(q, empty, empty, 0.25)
    assert np.all(out_e == 0) and np.all(lse_e == -np.inf)
    kv = make_kvs(rng, [5], 2, 16)[0]
    out, lse = A.attend_partial(q, kv[LAYER, 0, :, :5], kv[LAYER, 1, :, :5], 0.25)
    out_e[0, 0, 0] = np.nan  # an empty part's output is never read
    for m_out, m_lse in (A.merge_partials(out_e, lse_e, out, lse), A.merge_partials(out, lse, out_e, lse_e)):
        assert np.array_equal(m_out, out) and np.array_equal(m_lse, lse)
    both_out, both_lse = A.merge_partials(out_e, lse_e, out_e, lse_e)
    assert not np.any(np.isnan(both_out)) and np.all(both_out == 0) and np.all(both_lse == -np.inf)


def test_merge_is_the_online_softmax_rule():
    rng = np.random.default_rng(9)
    oa, ob = (rng.standard_normal((3, 2, 8)).astype(np.float32) for _ in range(2))
    la, lb = (rng.standard_normal((3, 2)).astype(np.float32) * 5 for _ in range(2))
    out, lse = A.merge_partials(oa, la, ob, lb)
    m = np.maximum(la, lb)
    wa, wb = np.exp(la - m), np.exp(lb - m)
    want = (wa[..., None] * oa + wb[..., None] * ob) / (wa + wb)[..., None]
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lse, m + np.log(wa + wb), rtol=1e-6)


def test_errors_name_the_problem():
    rng = np.random.default_rng(10)
    kvs = make_kvs(rng, [4], 2, 16)
    kl = A.kv_list(kvs)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = np.empty_like(q), np.empty((2, 4), np.float32)
    starts, pos0 = batch([(2, 2)])
    with pytest.raises(ValueError, match="q must be"):
        A.attend(q.astype(np.float64), kl, LAYER, starts, pos0, 1.0, out, lse)
    with pytest.raises(ValueError, match="lse must be"):
        A.attend(q, kl, LAYER, starts, pos0, 1.0, out, lse[:1])
    with pytest.raises(ValueError, match="capacity"):
        A.attend(q, kl, LAYER, *batch([(6, 2)]), 1.0, out, lse)
    with pytest.raises(ValueError, match="rise from 0"):
        A.attend(q, kl, LAYER, np.array([0, 3], np.int64), pos0, 1.0, out, lse)
    with pytest.raises(ValueError, match="layer out of range"):
        A.attend(q, kl, 2, starts, pos0, 1.0, out, lse)
    with pytest.raises(ValueError, match="multiple of"):
        A.attend(rng.standard_normal((2, 3, 16)).astype(np.float32), kl, LAYER, starts, pos0, 1.0,
                 np.empty((2, 3, 16), np.float32), np.empty((2, 3), np.float32))
    with pytest.raises(ValueError, match="pos0 must be"):
        A.attend(q, kl, LAYER, starts, pos0.astype(np.int32), 1.0, out, lse)
    with pytest.raises(ValueError, match="one array per sequence"):
        A.attend(q, A.kv_list(kvs * 2), LAYER, starts, pos0, 1.0, out, lse)
    with pytest.raises(ValueError, match="float16"):
        A.kv_list([np.zeros((2, 2, 2, 4, 16), np.float32)])
    k = np.ascontiguousarray(q[:, :2])
    with pytest.raises(ValueError, match="v must be"):
        A.kv_store(kl, LAYER, starts, pos0, k, k.astype(np.float16))
    with pytest.raises(ValueError, match="k must be float16"):
        A.attend_partial(q, kvs[0][LAYER, 0].astype(np.float32), kvs[0][LAYER, 1], 1.0)
    with pytest.raises(ValueError, match="partial shapes differ"):
        A.merge_partials(out, lse, out[:1], lse[:1])


def test_the_sixteen_lane_exponential_gives_the_scalar_ones_bits():
    from numba import njit
    from weaved.kernels._exp_ir import exp_shift16
    from weaved.kernels._rowwise import exp_f32

    @njit
    def lanes(x, m):
        y = x.copy()
        exp_shift16(y, y.shape[0] - y.shape[0] % 16, m)
        return y

    @njit
    def scalar(x, m):
        y = x.copy()
        for i in range(y.shape[0]):
            y[i] = exp_f32(y[i] - m)
        return y

    rng = np.random.default_rng(7)
    edges = [-87.33654, -87.3365, -87.34, 88.37626, 88.3763, 88.4, 0.0, -0.0, np.inf, -np.inf, 1e-30, -1e-30,
             0.5, -0.5, 0.34657359, -0.34657359]
    x = np.concatenate([rng.standard_normal(4096) * 30, np.linspace(-100, 100, 4096), edges * 16])
    x = x[: len(x) - len(x) % 16].astype(np.float32)
    for m in (0.0, 3.5, -2.25):
        got, want = lanes(x, np.float32(m)), scalar(x, np.float32(m))
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), x[~same][:5]
