"""triton_fused through Triton's interpreter: each fused kernel gives exactly what the kernels it
replaces give one after another (and so the torch path's bits), on random rows of awkward widths.

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
def kernels():
    from weaved.kernels import triton_fused, triton_rowwise

    return triton_fused, triton_rowwise


def _rows(rng, shape, spread: float = 4.0) -> torch.Tensor:
    mag = 10.0 ** rng.uniform(-spread / 2, spread / 2, shape)
    x = (rng.choice([-1.0, 1.0], shape) * mag).astype(np.float32)
    x.flat[:: max(1, x.size // 5)] = 0.0
    return torch.from_numpy(x)


def _same(a: tq.Q8Act, b: tq.Q8Act) -> bool:
    return torch.equal(a.q, b.q) and torch.equal(a.d, b.d)


@pytest.mark.parametrize("T, D", [(1, 64), (3, 576), (2, 2048), (5, 96)])
@pytest.mark.parametrize("add", [True, False])
def test_add_norm_quant_is_the_three_ops(kernels, T, D, add):
    fused, rw = kernels
    rng = np.random.default_rng(T * D + add)
    x, y = _rows(rng, (T, D)), (_rows(rng, (T, D)) if add else None)
    w = torch.from_numpy(rng.standard_normal(D).astype(np.float32))
    xo, h, a = fused.add_norm_quant(x, y, w, 1e-6)
    want_x = x + y if add else x
    want_h = rw.rmsnorm(want_x, w, 1e-6)
    assert torch.equal(xo, want_x) and torch.equal(h, want_h) and _same(a, rw.quantize_act(want_h))
    assert torch.equal(h, tr.rmsnorm(want_x, w, 1e-6)) and _same(a, tq.quantize_act(want_h))  # the torch path's
    if not add:
        assert xo is x or torch.equal(xo, x)


@pytest.mark.parametrize("T, F", [(1, 64), (3, 1536), (2, 8192), (4, 96)])
@pytest.mark.parametrize("gelu", [False, True])
def test_glu_quant_is_the_two_ops(kernels, T, F, gelu):
    fused, rw = kernels
    rng = np.random.default_rng(T * F + gelu)
    gu = _rows(rng, (T, 2 * F), spread=2.0) * 3
    table = tr.gelu_table("cpu") if gelu else None
    y, a = fused.glu_quant(gu, table)
    want = rw.geglu(gu, table) if gelu else rw.swiglu(gu)
    assert torch.equal(y, want) and _same(a, rw.quantize_act(want))


def test_argument_checks(kernels):
    fused, _ = kernels
    with pytest.raises(ValueError, match="multiple of 32"):
        fused.add_norm_quant(torch.zeros((2, 40)), None, torch.ones(40), 1e-6)
    with pytest.raises(ValueError, match="does not match"):
        fused.add_norm_quant(torch.zeros((2, 64)), torch.zeros((3, 64)), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="multiple of 32"):
        fused.glu_quant(torch.zeros((2, 100)), None)


@pytest.mark.parametrize("H, Hkv, D, n_rot, neox, norm", [
    (4, 2, 64, 64, False, False),  # Llama: interleaved pairs
    (4, 1, 128, 128, True, True),  # Qwen 3: neox pairs, q/k norms
    (2, 2, 256, 256, True, True),  # Gemma 3: head_dim 256
    (3, 1, 64, 32, True, False),  # partial rotary: dims past n_rot copied
])
def test_rope_qkv_is_norm_rope_and_the_float16_stores(kernels, H, Hkv, D, n_rot, neox, norm):
    from weaved.kernels.torch_products import Rowwise

    fused, _ = kernels
    rng = np.random.default_rng(H * D + n_rot)
    T, B, n_blocks = 5, 4, 9
    qkv = _rows(rng, (T, (H + 2 * Hkv) * D), spread=2.0)
    ang = rng.uniform(-3, 3, (T, n_rot // 2))
    cos, sin = (torch.from_numpy(f(ang).astype(np.float32)) for f in (np.cos, np.sin))
    norms = tuple(torch.from_numpy(rng.standard_normal(D).astype(np.float32)) for _ in range(2)) if norm else None
    blk = torch.from_numpy(rng.permutation(n_blocks)[:T].astype(np.int64))  # scattered slots
    off = torch.from_numpy(rng.integers(0, B, T).astype(np.int64))
    rows = Rowwise("triton")
    unfused = Rowwise("triton")
    unfused._fused = None  # the same kernels one after another: rmsnorm, rope, float16 copies, indexed store
    got_kv, want_kv = (torch.zeros((2, Hkv, T, D), dtype=torch.float16) for _ in range(2))
    got_pool, want_pool = (torch.zeros((n_blocks, 2, Hkv, B, D), dtype=torch.float16) for _ in range(2))
    q = rows.rope_qkv(qkv, (H, Hkv, D), cos, sin, neox, norms, 1e-6, got_kv, (got_pool, blk, off))
    want_q = unfused.rope_qkv(qkv, (H, Hkv, D), cos, sin, neox, norms, 1e-6, want_kv, (want_pool, blk, off))
    assert torch.equal(q, want_q) and torch.equal(got_kv, want_kv) and torch.equal(got_pool, want_pool)
    torch_path = Rowwise("torch")
    ref_kv = torch.zeros_like(want_kv)
    assert torch.equal(torch_path.rope_qkv(qkv, (H, Hkv, D), cos, sin, neox, norms, 1e-6, ref_kv), q)
    assert torch.equal(ref_kv, got_kv)  # the torch path's bits
    assert torch.equal(fused.rope_qkv(qkv, (H, Hkv, D), cos, sin, neox, norms, 1e-6, got_kv), q)  # no pool
