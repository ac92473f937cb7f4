"""torch_rowwise: fixed-order sums, exp, sqrt, RMSNorm, RoPE and SwiGLU in torch ops, held to the CPU
kernels' bits, and independent of the other rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit
from weaved.kernels import elementwise as ke
from weaved.kernels import torch_rowwise as tr
from weaved.kernels._rowwise import exp_f32 as exp_f32_cpu


@njit(cache=True)
def _exp_cpu(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = exp_f32_cpu(x[i])
    return out


def test_exp_is_the_cpu_polynomial():
    x = np.concatenate([np.linspace(-100, 100, 200001), [-np.inf, np.inf, -87.33654, 88.37626, 0.0, -0.0]])
    x = x.astype(np.float32)
    got = tr.exp_f32(torch.from_numpy(x)).numpy()
    assert np.array_equal(got, _exp_cpu(x))
    assert got[-6] == 0.0 and got[-5] == np.inf and got[-2] == 1.0


def test_sqrt_is_correctly_rounded():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.random(100000) * 10.0 ** rng.integers(-30, 30, 100000), [0.0, 1.0, 2.0, 4.0]])
    x = x.astype(np.float32)
    assert np.array_equal(tr.sqrt_f32(torch.from_numpy(x)).numpy(), np.sqrt(x))  # IEEE sqrtss
    assert tr.sqrt_f32(torch.tensor([np.float32(0.011978714)])).item() == np.sqrt(np.float32(0.011978714))


def test_tree_sum_order_and_padding():
    x = torch.tensor([1.0, 2.0**-24, 0.0, 2.0**-24, 0.0, 0.0], dtype=torch.float32)
    # a halving tree: (x0 + x2) + (x1 + x3) - the two tiny terms meet before they meet the 1
    # (added in order, each would vanish against it)
    assert tr.tree_sum(x[:4]).item() == 1.0 + 2.0**-23
    assert torch.equal(tr.tree_sum(x), tr.tree_sum(x[:4]))  # trailing zeros change nothing
    rng = np.random.default_rng(1)
    y = torch.from_numpy(rng.standard_normal((3, 37, 5)).astype(np.float32))
    s = tr.tree_sum(y, 1)
    assert s.shape == (3, 5)
    for i in range(3):  # a row's sum depends only on the row
        assert torch.equal(tr.tree_sum(y[i:i + 1].clone(), 1), s[i:i + 1])
    padded = torch.cat([y, torch.zeros(3, 27, 5)], dim=1)  # to 64: the same tree
    assert torch.equal(tr.tree_sum(padded, 1), s)
    assert tr.tree_sum(torch.zeros((2, 0))).shape == (2,)


def test_rmsnorm_is_the_cpu_kernels_bits():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((33, 576)) * 3).astype(np.float32)
    x[5] *= 1e3
    w = rng.standard_normal(576).astype(np.float32)
    got = tr.rmsnorm(torch.from_numpy(x), torch.from_numpy(w), 1e-5).numpy()
    assert np.array_equal(got, ke.rmsnorm(x, w, 1e-5))
    heads = x[:, :512].reshape(33, 8, 64).copy()
    got_h = tr.rmsnorm(torch.from_numpy(heads), torch.from_numpy(w[:64].copy()), 1e-6).numpy()
    assert np.array_equal(got_h, ke.rmsnorm_heads(heads.copy(), w[:64].copy(), 1e-6))
    with pytest.raises(ValueError, match="weight length"):
        tr.rmsnorm(torch.from_numpy(x), torch.from_numpy(w[:10].copy()), 1e-5)


def test_swiglu_is_the_cpu_kernels_bits():
    g = (np.random.default_rng(3).standard_normal((7, 2 * 300)) * 6).astype(np.float32)
    assert np.array_equal(tr.swiglu(torch.from_numpy(g)).numpy(), ke.swiglu(g))
    with pytest.raises(ValueError, match="even"):
        tr.swiglu(torch.zeros((2, 5)))


@pytest.mark.parametrize("style", ["norm", "neox"])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope_is_the_cpu_kernels_bits(style, n_rot):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 4, 64)).astype(np.float32)
    pos = np.array([0, 1, 255, 256, 1000, 4097], np.int64)  # across the table's blocks
    params = ke.plain_rope(n_rot, 64, 10000.0, 2.0, style)
    table = tr.RopeTable(params, "cpu")
    c, s = table.lookup(torch.from_numpy(pos))
    assert table.cos.shape[0] == 17 * tr.RopeTable.BLOCK
    got = tr.rope(torch.from_numpy(x), c, s, style == "neox").numpy()
    assert np.array_equal(got, ke.rope(x.copy(), pos, params))
    assert np.array_equal(got[..., n_rot:], x[..., n_rot:])  # dims past n_rot stay
    c2, s2 = tr.RopeTable(params, "cpu").lookup(torch.from_numpy(pos[3:4].copy()))
    assert torch.equal(c2, c[3:4]) and torch.equal(s2, s[3:4])  # the same values however grown


def test_geglu_is_the_cpu_kernels_bits():
    g = (np.random.default_rng(5).standard_normal((7, 2 * 300)) * 6).astype(np.float32)
    g[0, :4] = [-10.0, 10.0, -30.0, 1e-8]
    got = tr.geglu(torch.from_numpy(g), tr.gelu_table("cpu")).numpy()
    assert np.array_equal(got, ke.geglu(g))


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_table_with_factors_and_yarn_is_the_cpu_kernels_bits(style):
    x = np.random.default_rng(6).standard_normal((5, 2, 64)).astype(np.float32)
    pos = np.array([0, 3, 300, 9000, 70000], np.int64)
    for params in (ke.rope_params(64, 64, 500000.0, 1.0, style, tuple(np.linspace(1, 32, 32).tolist())),
                   ke.rope_params(64, 64, 1e6, 0.25, style, ext_factor=1.0, orig_ctx=32768)):
        c, s = tr.RopeTable(params, "cpu").lookup(torch.from_numpy(pos))
        got = tr.rope(torch.from_numpy(x), c, s, style == "neox").numpy()
        assert np.array_equal(got, ke.rope(x.copy(), pos, params))


def test_rope_table_checks():
    c, s = tr.RopeTable(ke.plain_rope(64, 64, 10000.0, 1.0, "norm"), "cpu").lookup(torch.tensor([3]))
    with pytest.raises(ValueError, match="cos/sin"):
        tr.rope(torch.zeros((2, 4, 64)), c, s, False)


def test_rope_table_grows_by_doubling_and_takes_a_known_need():
    params = ke.plain_rope(64, 64, 10000.0, 1.0, "neox")
    table = tr.RopeTable(params, "cpu")
    table.ensure(300)
    assert table.cos.shape[0] == 2 * tr.RopeTable.BLOCK
    before = table.cos.clone()
    table.ensure(2 * tr.RopeTable.BLOCK + 1)  # one position more: twice the blocks, not three
    assert table.cos.shape[0] == 4 * tr.RopeTable.BLOCK and torch.equal(table.cos[:512], before)
    pos = torch.tensor([7, 3000])
    c, _ = table.lookup(pos, need=3001)  # told the highest position: no look at the device's values
    assert table.cos.shape[0] == 12 * tr.RopeTable.BLOCK
    assert torch.equal(c, tr.RopeTable(params, "cpu").lookup(pos)[0])
