"""Float-activation products on Q4_0 / Q8_0 weights: accuracy, batch invariance, errors."""

from __future__ import annotations

import numpy as np
import pytest
from weaved.kernels.ggml import GGMLType
from weaved.kernels.linear_f32act import linear_f32act, pack_weight_f32act
from weaved.kernels.quants import dequantize_q4_0, dequantize_q8_0, quantize_q4_0, quantize_q8_0

CASES = [(GGMLType.Q8_0, quantize_q8_0, dequantize_q8_0), (GGMLType.Q4_0, quantize_q4_0, dequantize_q4_0)]


@pytest.mark.parametrize("qt,quant,dequant", CASES)
@pytest.mark.parametrize("n_out", [32, 77, 1000])
def test_matches_float64_of_dequantized_weights(qt, quant, dequant, n_out):
    rng = np.random.default_rng(n_out)
    raw = quant(rng.standard_normal((n_out, 96)).astype(np.float32))
    w = pack_weight_f32act(raw, qt, n_out, 96)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    ref = x.astype(np.float64) @ dequant(raw).astype(np.float64).T
    y = linear_f32act(w, x)
    assert y.shape == (5, n_out)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qt,quant,_", CASES)
def test_batch_invariant(qt, quant, _):
    rng = np.random.default_rng(1)
    n_out = 4100  # large enough for the parallel path
    w = pack_weight_f32act(quant(rng.standard_normal((n_out, 64)).astype(np.float32)), qt, n_out, 64)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    alone = [linear_f32act(w, np.ascontiguousarray(x[i : i + 1]))[0] for i in range(9)]
    batched = linear_f32act(w, x)
    for i in range(9):
        assert np.array_equal(batched[i], alone[i])


def test_errors():
    raw = quantize_q8_0(np.ones((32, 64), np.float32))
    with pytest.raises(ValueError, match="Q4_0 or Q8_0"):
        pack_weight_f32act(np.ones((32, 64), np.float32), GGMLType.F32, 32, 64)
    with pytest.raises(ValueError, match="needs uint8"):
        pack_weight_f32act(raw[:, :10], GGMLType.Q8_0, 32, 64)
    w = pack_weight_f32act(raw, GGMLType.Q8_0, 32, 64)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        linear_f32act(w, np.ones((2, 32), np.float32))
