"""triton_rowwise through Triton's interpreter: each kernel gives the torch path's bits (the CPU
kernels' recipes) on random rows, odd sizes and edge values.

Not collected by default: ``test_triton_interp`` runs this file in a fresh interpreter with
TRITON_INTERPRET=1 (see ``triton_interp_cases``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from weaved.kernels import torch_q4 as tq
from weaved.kernels import torch_rowwise as tr

from tests.kernels.triton_interp_shim import require_interpreter

require_interpreter()


@pytest.fixture(scope="module")
def tw():
    from weaved.kernels import triton_rowwise

    return triton_rowwise


def _rows(rng, shape, spread: float = 6.0) -> torch.Tensor:
    """float32 values whose magnitudes span ``spread`` decades, signs mixed, a few exact zeros."""
    mag = 10.0 ** rng.uniform(-spread / 2, spread / 2, shape)
    x = (rng.choice([-1.0, 1.0], shape) * mag).astype(np.float32)
    x.flat[:: max(1, x.size // 7)] = 0.0
    return torch.from_numpy(x)


@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (7, 576), (2, 2048), (2, 3, 128)])
def test_rmsnorm_is_the_torch_paths(tw, shape):
    rng = np.random.default_rng(sum(shape))
    x = _rows(rng, shape)
    w = torch.from_numpy(rng.standard_normal(shape[-1]).astype(np.float32))
    for eps in (1e-5, 1e-6):
        assert torch.equal(tw.rmsnorm(x, w, eps), tr.rmsnorm(x, w, eps))
    assert torch.equal(tw.rmsnorm(x[:1], w, 1e-6), tr.rmsnorm(x, w, 1e-6)[:1])  # a row alone: the same


@pytest.mark.parametrize("F", [1, 37, 1536, 2100])
def test_swiglu_and_geglu_are_the_torch_paths(tw, F):
    rng = np.random.default_rng(F)
    gu = torch.from_numpy((rng.standard_normal((3, 2 * F)) * 6).astype(np.float32))
    edges = torch.tensor([-200.0, -88.0, -87.4, -10.0, -1e-30, -0.0, 0.0, 9.99, 10.0, 87.3, 88.5, 200.0])
    n = min(F, edges.numel())
    gu[0, :n] = edges[:n]  # the gate's extremes, the exp's clamps and the GELU table's ends
    assert torch.equal(tw.swiglu(gu), tr.swiglu(gu))
    table = tr.gelu_table("cpu")
    assert torch.equal(tw.geglu(gu, table), tr.geglu(gu, table))


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dims", [(64, 32), (128, 64), (256, 128), (128, 16)])  # (head_dim, n_rot/2)
def test_rope_is_the_torch_paths(tw, neox, dims):
    Dh, half = dims
    rng = np.random.default_rng(Dh + half)
    x = torch.from_numpy(rng.standard_normal((5, 3, Dh)).astype(np.float32))
    ang = rng.uniform(-np.pi, np.pi, (5, half))
    cos, sin = (torch.from_numpy(f(ang).astype(np.float32)) for f in (np.cos, np.sin))
    assert torch.equal(tw.rope(x, cos, sin, neox), tr.rope(x, cos, sin, neox))


@pytest.mark.parametrize("shape", [(1, 32), (5, 96), (70, 576)])
def test_activation_quantization_is_the_torch_paths(tw, shape):
    rng = np.random.default_rng(shape[1])
    x = _rows(rng, shape, spread=4.0)
    x[0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[-1, -32:] = torch.arange(32, dtype=torch.float32) - 15.5  # .5 steps: ties go to even
    got, want = tw.quantize_act(x), tq.quantize_act(x)
    assert torch.equal(got.q, want.q) and torch.equal(got.d, want.d)
    (g1, g2), (w1, w2) = tw.quantize_two_level(x), tq.quantize_two_level(x)
    assert all(torch.equal(a, b) for a, b in ((g1.q, w1.q), (g1.d, w1.d), (g2.q, w2.q), (g2.d, w2.d)))


def test_argument_checks(tw):
    with pytest.raises(ValueError, match="weight length"):
        tw.rmsnorm(torch.zeros((2, 8)), torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="even"):
        tw.swiglu(torch.zeros((2, 5)))
    with pytest.raises(ValueError, match="65536"):
        tw.geglu(torch.zeros((2, 4)), torch.zeros(10))
    with pytest.raises(ValueError, match="cos/sin"):
        tw.rope(torch.zeros((2, 1, 8)), torch.zeros((2, 5)), torch.zeros((2, 5)), True)
    with pytest.raises(ValueError, match="multiple of 32"):
        tw.quantize_act(torch.zeros((2, 40)))
    with pytest.raises(ValueError, match="float32"):
        tw.rmsnorm(torch.zeros((2, 8), dtype=torch.float64), torch.ones(8), 1e-5)
    assert tw.quantize_act(torch.zeros((0, 64))).q.shape == (0, 2, 32)
    assert tw.swiglu(torch.zeros((0, 8))).shape == (0, 4)
