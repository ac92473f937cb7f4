"""torch_attention: the CPU attention kernel's bits in torch ops, and a row's result independent of the
rows and keys around it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from weaved.kernels import attention as ka
from weaved.kernels import torch_attention as tat

# (n_heads, n_kv_heads, head_dim, keys, query rows): GQA, several chunks, plain (head_dim % 16) path
SHAPES = [(9, 3, 64, 40, 5), (4, 2, 16, 700, 3), (4, 4, 32, 1100, 70), (2, 1, 24, 70, 70), (9, 3, 64, 1, 1)]


def _case(shape, seed=0):
    H, Hkv, D, L, n = shape
    rng = np.random.default_rng(seed)
    kv = np.zeros((1, 2, Hkv, L + 3, D), np.float16)  # a layer's cache, 3 positions to spare
    kv[0, :, :, :L] = (rng.standard_normal((2, Hkv, L, D)) * 2).astype(np.float16)
    q = (rng.standard_normal((n, H, D)) * 1.5).astype(np.float32)
    return q, kv, L - n


def test_constants_are_the_cpu_kernels():
    assert (tat.CHUNK, tat.BLOCK) == (ka.CHUNK, ka.BLOCK)


@pytest.mark.parametrize("shape", SHAPES)
def test_attend_is_the_cpu_kernels_bits(shape):
    q, kv, pos0 = _case(shape)
    n, L = q.shape[0], pos0 + q.shape[0]
    out = np.empty_like(q)
    lse = np.empty(q.shape[:2], np.float32)
    ka.attend(q, ka.kv_list([kv]), 0, np.array([0, n]), np.array([pos0]), 0.125, out, lse)
    k, v = torch.from_numpy(kv[0, 0]), torch.from_numpy(kv[0, 1])
    o_t, lse_t = tat.attend(torch.from_numpy(q), k[:, :L], v[:, :L], pos0, 0.125)
    assert np.array_equal(o_t.numpy(), out)
    assert np.array_equal(lse_t.numpy(), lse)


@pytest.mark.parametrize("shape", SHAPES[1:4])
def test_a_row_alone_gets_its_batch_result(shape, monkeypatch):
    q, kv, pos0 = _case(shape, seed=1)
    n = q.shape[0]
    k, v = torch.from_numpy(kv[0, 0]), torch.from_numpy(kv[0, 1])
    qt = torch.from_numpy(q)
    o, lse = tat.attend(qt, k[:, :pos0 + n], v[:, :pos0 + n], pos0, 0.3)
    for i in sorted({0, 1, n // 2, n - 1}):  # alone, over exactly its own keys
        oi, li = tat.attend(qt[i:i + 1].clone(), k[:, :pos0 + i + 1], v[:, :pos0 + i + 1], pos0 + i, 0.3)
        assert torch.equal(oi[0], o[i]) and torch.equal(li[0], lse[i])
    monkeypatch.setattr(tat, "GROUP_ELEMS", 1)  # one row per group
    monkeypatch.setattr(tat, "PRODUCTS_ELEMS", 0)  # the per-key products path
    o1, lse1 = tat.attend(qt, k[:, :pos0 + n], v[:, :pos0 + n], pos0, 0.3)
    assert torch.equal(o1, o) and torch.equal(lse1, lse)


def test_argument_checks():
    q = torch.zeros((2, 4, 16))
    k = torch.zeros((2, 5, 16), dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        tat.attend(q, k.float(), k, 0, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        tat.attend(torch.zeros((2, 3, 16)), k, k, 0, 1.0)
    with pytest.raises(ValueError, match="need keys"):
        tat.attend(q, k, k, 4, 1.0)
