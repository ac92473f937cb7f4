"""Row-wise kernels vs numpy references: exp, RMSNorm, RoPE, SwiGLU, softmax, residual add."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit
from weaved.kernels import elementwise as E

BIG_T = 300  # rows enough to take the parallel drivers (>= 2**16 elements at these widths)


@njit(cache=True)
def _exp_all(x, y):
    for i in range(x.shape[0]):
        y[i] = E.exp_f32(x[i])


def test_exp_f32_within_one_ulp_and_edge_values():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-87.3, 88.3, 200_000), rng.standard_normal(50_000)]).astype(np.float32)
    y = np.empty_like(x)
    _exp_all(x, y)
    exact = np.exp(x.astype(np.float64))
    ulps = np.abs(y - exact) / np.spacing(exact.astype(np.float32))
    assert ulps.max() <= 1.0
    edge = np.array([0.0, -np.inf, -100.0, -87.5, 89.0, np.inf], np.float32)
    y = np.empty_like(edge)
    _exp_all(edge, y)
    assert list(y) == [1.0, 0.0, 0.0, 0.0, np.inf, np.inf]


def test_rmsnorm_matches_reference_and_ggml_recipe():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 576)) * 3).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    y = E.rmsnorm(x, w, 1e-5)
    np.testing.assert_allclose(y, E.rmsnorm_ref(x, w, 1e-5), rtol=2e-6, atol=1e-6)
    # ggml: float32 squares summed in float64, mean rounded to float32, scale = 1 / sqrtf(mean + eps)
    mean = ((x * x).astype(np.float64).sum(axis=1) / 576).astype(np.float32)
    scale = np.float32(1) / np.sqrt(mean + np.float32(1e-5))
    assert np.array_equal(y, (x * scale[:, None]) * w)
    out = np.empty_like(x)
    assert E.rmsnorm(x, w, 1e-5, out=out) is out and np.array_equal(out, y)
    x2 = x.copy()
    E.rmsnorm(x2, w, 1e-5, out=x2)  # in place
    assert np.array_equal(x2, y)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 128, 576, 2051])
def test_the_sum_of_squares_is_sixteen_float64_lanes_added_in_order(n):
    """rms_norm's sum: float32 squares into float64 lane i % 16 in index order, then the lanes in order;
    a length off a multiple of 16 leaves its last lanes with one add fewer (bit for bit)."""
    from numba import njit
    from weaved.kernels._llvm import sumsq_f64

    call = njit(lambda v: sumsq_f64(v))
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-7.0, 7.0, n))).astype(np.float32)  # squares over 40 octaves
    lanes = np.zeros(16, np.float64)
    for i in range(n):
        lanes[i % 16] += np.float64(x[i] * x[i])
    want = 0.0
    for v in lanes:
        want += v
    assert call(x) == want
    assert call(np.zeros(n, np.float32)) == 0.0 and np.isinf(call(np.full(n, 3e38, np.float32)))


def test_rmsnorm_heads_normalises_every_head():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 4, 32)).astype(np.float32)
    w = rng.standard_normal(32).astype(np.float32)
    ref = E.rmsnorm_ref(x, w, 1e-6)
    assert E.rmsnorm_heads(x, w, 1e-6) is x
    np.testing.assert_allclose(x, ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", ["rmsnorm", "rope", "swiglu", "geglu"])
def test_rows_are_bit_identical_alone_and_in_a_large_batch(kernel):
    """The serial (small batch) and parallel (large batch) drivers give the same bits per row."""
    rng = np.random.default_rng(3)
    if kernel == "rmsnorm":
        x = rng.standard_normal((BIG_T, 576)).astype(np.float32)
        w = rng.standard_normal(576).astype(np.float32)
        big, one = E.rmsnorm(x, w, 1e-5), E.rmsnorm(x[7:8], w, 1e-5)
    elif kernel == "rope":
        x = rng.standard_normal((BIG_T, 9, 64)).astype(np.float32)
        pos = rng.integers(0, 5000, BIG_T)
        big = E.rope(x.copy(), pos, E.plain_rope(64, 64, 10000.0, 1.0, "neox"))
        one = E.rope(x[7:8].copy(), pos[7:8], E.plain_rope(64, 64, 10000.0, 1.0, "neox"))
    else:
        x = rng.standard_normal((BIG_T, 2 * 1536)).astype(np.float32)
        act = E.swiglu if kernel == "swiglu" else E.geglu
        big, one = act(x), act(x[7:8])
    assert np.array_equal(big[7:8], one)


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_matches_float64_reference(style):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 2, 7, 31, 100], np.int64)
    y = E.rope(x.copy(), pos, E.plain_rope(64, 64, 10000.0, 1.0, style))
    # the float32 angles (ggml's recipe) drift by ~1e-7 per pair and position from the exact ones
    np.testing.assert_allclose(y, E.rope_ref64(x, pos, 64, 10000.0, style), atol=5e-5)


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_follows_the_float32_recipe_at_long_positions(style):
    """Far positions carry ggml's float32 angle error (theta *= theta_scale per pair): we match that
    recipe to about an ulp, and the exact rotation to the recipe's own angle error."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 2, 128)).astype(np.float32)
    pos = np.array([1000, 4095, 20000, 131000], np.int64)
    y = E.rope(x.copy(), pos, E.plain_rope(128, 128, 1e6, 1.0, style))
    np.testing.assert_allclose(y, E.rope_ref(x, pos, E.plain_rope(128, 128, 1e6, 1.0, style)), atol=3e-6)
    np.testing.assert_allclose(y, E.rope_ref64(x, pos, 128, 1e6, style), atol=5e-2)


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_position_zero_is_identity_and_rotation_preserves_norms(style):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 4, 64)).astype(np.float32)
    assert np.array_equal(E.rope(x.copy(), np.zeros(3, np.int64), E.plain_rope(64, 64, 10000.0, 1.0, style)), x)
    pos = np.array([3, 50, 9000], np.int64)
    y = E.rope(x.copy(), pos, E.plain_rope(64, 64, 10000.0, 1.0, style))
    pairs = {"neox": (np.arange(32), np.arange(32, 64)), "norm": (np.arange(0, 64, 2), np.arange(1, 64, 2))}
    i0, i1 = pairs[style]
    norm_x, norm_y = np.hypot(x[..., i0], x[..., i1]), np.hypot(y[..., i0], y[..., i1])
    np.testing.assert_allclose(norm_y, norm_x, rtol=1e-6)
    # rotating back by -pos (exact math) recovers the input, up to the float32 angle drift
    back = E.rope_ref64(y[:2], -pos[:2], 64, 10000.0, style)
    np.testing.assert_allclose(back, x[:2], atol=5e-5)


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_partial_rotation_and_scaling(style):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 2, 64)).astype(np.float32)
    pos = np.array([0, 3, 17, 60, 250], np.int64)
    y = E.rope(x.copy(), pos, E.plain_rope(32, 64, 10000.0, 4.0, style))
    assert np.array_equal(y[..., 32:], x[..., 32:])  # dims past n_rot untouched
    np.testing.assert_allclose(y, E.rope_ref64(x, pos, 32, 10000.0, style, freq_scale=1 / 4.0), atol=5e-5)
    # linear scaling: position p with scale s is position p / s without it
    same = E.rope_ref64(x, pos // 1, 32, 10000.0, style)
    quarter = E.rope_ref64(x, pos * 4, 32, 10000.0, style, freq_scale=1 / 4.0)
    np.testing.assert_allclose(quarter, same, atol=1e-12)


LLAMA3_FF = (1.0,) * 8 + (1.65, 3.29, 9.67) + (32.0,) * 5  # Llama 3's factors for 16 pairs


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_frequency_factors_divide_the_angles(style):
    """Llama 3's rope_freqs: pair i's angle is divided by its factor, as ggml does (a factor of 1
    changes no bit)."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, 3, 32)).astype(np.float32)
    pos = np.array([0, 7, 300, 4000, 60000], np.int64)
    params = E.rope_params(32, 32, 500000.0, 1.0, style, LLAMA3_FF)
    y = E.rope(x.copy(), pos, params)
    np.testing.assert_allclose(y, E.rope_ref(x, pos, params), atol=3e-6)
    np.testing.assert_allclose(y, E.rope_ref64(x, pos, 32, 500000.0, style, freq_factors=LLAMA3_FF), atol=2e-3)
    ones = E.rope_params(32, 32, 500000.0, 1.0, style, (1.0,) * 16)
    assert np.array_equal(E.rope(x.copy(), pos, ones), E.rope(x.copy(), pos, E.plain_rope(32, 32, 500000.0, 1.0,
                                                                                           style)))
    assert not np.allclose(y, E.rope(x.copy(), pos, ones))


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_yarn_mixes_angles_and_scales_magnitude(style):
    """YaRN (factor 4 over 32,768 positions): pairs below the fast correction dimension keep their
    angle, pairs above the slow one are interpolated, the ramp mixes between; cos/sin carry
    1 + 0.1 ln 4."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 2, 64)).astype(np.float32)
    pos = np.array([1, 100, 5000, 100000], np.int64)
    params = E.rope_params(64, 64, 1e6, 0.25, style, ext_factor=1.0, orig_ctx=32768)
    n_rot, _, _, _, _, ext, c0, c1, mscale = params
    # 64 ln(32768 / (32 * 2 pi)) / (2 ln 1e6) = 11.8 -> 11; with beta 1: 19.8 -> 20
    assert (c0, c1) == (np.float32(11.0), np.float32(20.0)) and ext == 1.0
    assert mscale == np.float32(1.0) + np.float32(0.1) * np.log(np.float32(4.0))
    y = E.rope(x.copy(), pos, params)
    np.testing.assert_allclose(y, E.rope_ref(x, pos, params), atol=3e-6)
    exact = E.rope_ref64(x, pos, 64, 1e6, style, freq_scale=0.25, ext_factor=1.0, corr=(11.0, 20.0),
                         mscale=float(mscale))
    np.testing.assert_allclose(y, exact, atol=2e-2)
    norms = np.linalg.norm(y.reshape(4, -1), axis=1) / np.linalg.norm(x.reshape(4, -1), axis=1)
    np.testing.assert_allclose(norms, float(mscale), rtol=1e-5)


def test_geglu_follows_ggml_table_and_matches_reference():
    rng = np.random.default_rng(10)
    gu = (rng.standard_normal((6, 2 * 300)) * 4).astype(np.float32)
    gu[0, :6] = [-12.0, -10.0, -9.99, 9.99, 10.0, 30.0]
    y = E.geglu(gu)
    g, u = gu[:, :300], gu[:, 300:]
    # away from the edges: the float16 table is within its rounding of the exact GELU
    np.testing.assert_allclose(y, E.geglu_ref(gu), rtol=2e-3, atol=2e-3)
    assert y[0, 0] == 0 and y[0, 1] == 0 and y[0, 4] == np.float32(10.0) * u[0, 4] and y[0, 5] == g[0, 5] * u[0, 5]
    # inside: the table's float16 value at the gate rounded to float16
    h = g[1, 10].astype(np.float16).astype(np.float32)
    want = np.float16(E.gelu_ref(np.float64(h)))
    assert abs(y[1, 10] / u[1, 10] - np.float32(want)) <= abs(np.float32(want)) * 1e-3 + 1e-6
    assert np.array_equal(E.geglu(gu[2:3]), y[2:3])  # a row alone: the same bits


def test_swiglu_matches_reference():
    rng = np.random.default_rng(8)
    gu = (rng.standard_normal((4, 2 * 96)) * 6).astype(np.float32)
    gu[0, :3] = [-200.0, 200.0, 0.0]  # exp overflow / underflow inside silu
    y = E.swiglu(gu)
    ref = E.swiglu_ref(gu)
    np.testing.assert_allclose(y, ref, rtol=3e-6, atol=1e-6)
    out = np.empty((4, 96), np.float32)
    assert E.swiglu(gu, out=out) is out and np.array_equal(out, y)


def test_softmax_rows():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((3, 49152)) * 8).astype(np.float32)
    x[1, 5] = 1e4  # one dominant logit: no overflow
    y = E.softmax(x)
    np.testing.assert_allclose(y, E.softmax_ref(x), rtol=3e-6, atol=1e-12)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-6)
    assert y[1, 5] == 1.0
    v = x[0, :37].copy()
    np.testing.assert_allclose(E.softmax(v), E.softmax_ref(v), rtol=3e-6)


def test_add_in_place():
    x = np.ones((2, 3), np.float32)
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert E.add_(x, y) is x
    assert np.array_equal(x, 1 + y)


def test_errors_name_the_problem():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="x must be a C-contiguous float32"):
        E.rmsnorm(x.astype(np.float64), np.ones(8, np.float32), 1e-5)
    with pytest.raises(ValueError, match="weight length"):
        E.rmsnorm(x, np.ones(7, np.float32), 1e-5)
    with pytest.raises(ValueError, match="x must be a C-contiguous float32"):
        E.rmsnorm(np.zeros((8, 2), np.float32).T, np.ones(8, np.float32), 1e-5)
    q = np.zeros((2, 2, 8), np.float32)
    with pytest.raises(ValueError, match="style"):
        E.plain_rope(8, 8, 10000.0, 1.0, "gptj")
    with pytest.raises(ValueError, match="n_rot"):
        E.plain_rope(7, 8, 10000.0, 1.0, "norm")
    with pytest.raises(ValueError, match="frequency factors"):
        E.rope_params(8, 8, 10000.0, 1.0, "norm", (1.0, 2.0))
    with pytest.raises(ValueError, match="original context"):
        E.rope_params(8, 8, 10000.0, 0.25, "neox", ext_factor=1.0)
    with pytest.raises(ValueError, match="positions must be int64"):
        E.rope(q, np.zeros(2, np.int32), E.plain_rope(8, 8, 10000.0, 1.0, "norm"))
    with pytest.raises(ValueError, match="exceeds the head size"):
        E.rope(q, np.zeros(2, np.int64), E.plain_rope(16, 16, 10000.0, 1.0, "norm"))
    with pytest.raises(ValueError, match="even"):
        E.swiglu(np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="out shape"):
        E.swiglu(np.zeros((2, 6), np.float32), out=np.zeros((2, 6), np.float32))
    with pytest.raises(ValueError, match="shapes differ"):
        E.add_(x, np.zeros((2, 7), np.float32))
    with pytest.raises(ValueError, match="empty row"):
        E.softmax(np.zeros((2, 0), np.float32))
