"""Two-level Q8_0 activations on the logits: near-float accuracy, the refinement rule, batch
invariance, errors."""

from __future__ import annotations

import numpy as np
import pytest
from weaved.kernels.ggml import GGMLType
from weaved.kernels.matmul import linear, linear_q, pack_weight
from weaved.kernels.quants import Q8Activations, dequantize_q4_0, dequantize_q8_0, quantize_q4_0, quantize_q8_0
from weaved.kernels.residual import linear_residual, quantize_two_level

CASES = [(GGMLType.Q8_0, quantize_q8_0, dequantize_q8_0), (GGMLType.Q4_0, quantize_q4_0, dequantize_q4_0)]
ALL = dict(margin=float("inf"), top=1 << 30)  # refine every logit


def _weight(qt, quant, n_out, n_in, seed):
    raw = quant(np.random.default_rng(seed).standard_normal((n_out, n_in)).astype(np.float32))
    return raw, pack_weight(raw, qt, n_out, n_in)


def _both_levels(w, x):
    """The full two-level product as one gemm over 2T columns (the definition)."""
    a1, a2 = quantize_two_level(x)
    both = Q8Activations(*(np.concatenate([u, v], axis=1) for u, v in ((a1.q, a2.q), (a1.d, a2.d), (a1.s, a2.s))))
    y = linear_q(w, both)
    T = x.shape[0]
    return linear_q(w, a1), y[:T] + y[T:]


@pytest.mark.parametrize("qt,quant,dequant", CASES)
def test_far_closer_to_float_than_one_level(qt, quant, dequant):
    raw, w = _weight(qt, quant, 300, 128, 3)
    x = (np.random.default_rng(4).standard_normal((5, 128)) * 4).astype(np.float32)
    ref = x.astype(np.float64) @ dequant(raw).astype(np.float64).T
    err1 = np.abs(linear(w, x) - ref).max()
    err2 = np.abs(linear_residual(w, x, **ALL) - ref).max()
    assert err2 < err1 / 50
    np.testing.assert_allclose(linear_residual(w, x, **ALL), ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_two_level_reconstructs_x():
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    a, b = quantize_two_level(x)
    deq = [(q.q.astype(np.float64) * q.d[:, :, None]).transpose(1, 0, 2).reshape(3, 64) for q in (a, b)]
    assert np.abs(deq[0] + deq[1] - x).max() < np.abs(x).max() / 127 / 100


@pytest.mark.parametrize("qt,quant,dequant", CASES)
@pytest.mark.parametrize("margin,top", [(12.0, 128), (2.0, 128), (40.0, 16), (float("inf"), 1 << 30)])
@pytest.mark.parametrize("n_out", [1000, 1001])  # vocabularies need not be a multiple of the vector width
def test_refines_exactly_the_rule(qt, quant, dequant, margin, top, n_out):
    raw, w = _weight(qt, quant, n_out, 96, 5)
    spread = np.array([[1], [3], [6], [0.1], [2], [8]])  # row 3 is flat: the cap decides
    x = (np.random.default_rng(6).standard_normal((6, 96)) * spread).astype(np.float32)
    one, two = _both_levels(w, x)
    counts = np.empty(6, np.int64)
    got = linear_residual(w, x, margin, top, counts)
    for t in range(6):
        lo = np.float32(one[t].max() - np.float32(margin))
        kth = np.sort(one[t])[::-1][min(top, n_out) - 1]
        sel = one[t] >= max(lo, kth)
        assert counts[t] == sel.sum() <= max(top, 1)  # no ties in random data
        assert np.array_equal(got[t][sel], two[t][sel])  # refined: the full product's bits
        assert np.array_equal(got[t][~sel], one[t][~sel])  # the rest: one level
    assert (counts >= 1).all() and (counts <= min(top, n_out)).all()


def test_ties_at_the_cap_are_all_refined():
    """A flat row: every logit equal, so the k-th largest ties with all of them."""
    raw = np.zeros((300, 34), np.uint8)
    raw[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw[:, 2:] = 3
    w = pack_weight(raw, GGMLType.Q8_0, 300, 32)
    counts = np.empty(1, np.int64)
    linear_residual(w, np.full((1, 32), 0.7, np.float32), 12.0, 8, counts)
    assert counts[0] == 300


def test_batch_invariant_and_padded_rows():
    rng = np.random.default_rng(1)
    raw = quantize_q8_0(rng.standard_normal((4096, 64)).astype(np.float32))  # 16 KiB rows: padded
    w = pack_weight(raw, GGMLType.Q8_0, 4096, 64)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    batched = linear_residual(w, x)
    assert batched.shape == (9, 4096)
    for i in range(9):
        assert np.array_equal(batched[i], linear_residual(w, np.ascontiguousarray(x[i : i + 1]))[0])


def test_errors():
    raw = quantize_q8_0(np.ones((32, 64), np.float32))
    w = pack_weight(raw, GGMLType.Q8_0, 32, 64)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        linear_residual(w, np.ones((2, 32), np.float32))
    with pytest.raises(ValueError, match="counts"):
        linear_residual(w, np.ones((2, 64), np.float32), counts=np.empty(3, np.int64))
    assert linear_residual(w, np.ones((0, 64), np.float32)).shape == (0, 32)
    f16 = pack_weight(np.ones((32, 64), np.float16), GGMLType.F16, 32, 64)
    with pytest.raises(ValueError, match="Q4_0 or Q8_0"):
        linear_residual(f16, np.ones((2, 64), np.float32))


@pytest.mark.parametrize("qt,quant", [(GGMLType.Q4_0, quantize_q4_0), (GGMLType.Q8_0, quantize_q8_0)])
def test_packed_rows_are_the_gguf_rows(qt, quant):
    """A tied embedding is looked up in the output matrix's packed copy: its rows are the GGUF bytes."""
    from weaved.kernels.matmul import packed_rows

    raw, w = _weight(qt, quant, 77, 96, 9)  # a last tile of 13 rows
    ids = np.array([0, 31, 32, 63, 76, 5, 5], np.int64)
    assert np.array_equal(packed_rows(w, ids), raw[ids])
    assert packed_rows(w, np.array([], np.int64)).shape == (0, raw.shape[1])
    with pytest.raises(ValueError, match="rows in"):
        packed_rows(w, np.array([77]))

