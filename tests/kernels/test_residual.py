"""Two-level Q8_0 activations: near-float accuracy, batch invariance, errors."""

from __future__ import annotations

import numpy as np
import pytest
from weaved.kernels.ggml import GGMLType
from weaved.kernels.matmul import linear, pack_weight
from weaved.kernels.quants import dequantize_q4_0, dequantize_q8_0, quantize_q4_0, quantize_q8_0
from weaved.kernels.residual import linear_residual, quantize_two_level

CASES = [(GGMLType.Q8_0, quantize_q8_0, dequantize_q8_0), (GGMLType.Q4_0, quantize_q4_0, dequantize_q4_0)]


@pytest.mark.parametrize("qt,quant,dequant", CASES)
def test_far_closer_to_float_than_one_level(qt, quant, dequant):
    rng = np.random.default_rng(3)
    raw = quant(rng.standard_normal((300, 128)).astype(np.float32))
    w = pack_weight(raw, qt, 300, 128)
    x = (rng.standard_normal((5, 128)) * 4).astype(np.float32)
    ref = x.astype(np.float64) @ dequant(raw).astype(np.float64).T
    err1 = np.abs(linear(w, x) - ref).max()
    err2 = np.abs(linear_residual(w, x) - ref).max()
    assert err2 < err1 / 50
    np.testing.assert_allclose(linear_residual(w, x), ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_two_level_reconstructs_x():
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    qa = quantize_two_level(x)
    deq = (qa.q.astype(np.float64) * qa.d[:, :, None]).transpose(1, 0, 2).reshape(6, 64)
    assert np.abs(deq[:3] + deq[3:] - x).max() < np.abs(x).max() / 127 / 100


def test_batch_invariant():
    rng = np.random.default_rng(1)
    w = pack_weight(quantize_q8_0(rng.standard_normal((4100, 64)).astype(np.float32)), GGMLType.Q8_0, 4100, 64)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    batched = linear_residual(w, x)
    for i in range(9):
        assert np.array_equal(batched[i], linear_residual(w, np.ascontiguousarray(x[i : i + 1]))[0])


def test_errors():
    w = pack_weight(quantize_q8_0(np.ones((32, 64), np.float32)), GGMLType.Q8_0, 32, 64)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        linear_residual(w, np.ones((2, 32), np.float32))
    assert linear_residual(w, np.ones((0, 64), np.float32)).shape == (0, 32)
