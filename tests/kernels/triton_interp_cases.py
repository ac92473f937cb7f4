"""triton_q4 through Triton's interpreter: exact integer block sums, the torch path's arithmetic, and
the torch backend running on it.

Not collected by default: ``test_triton_interp`` runs this file in a fresh interpreter with
TRITON_INTERPRET=1, which Triton reads when it is imported (its own ``tl`` functions are decorated
then), so it must be set before anything in the process imports triton.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from weaved.kernels import quants
from weaved.kernels import torch_q4 as tq

from tests.kernels.triton_interp_shim import require_interpreter

require_interpreter()


@pytest.fixture(scope="module")
def tt():
    from weaved.kernels import triton_q4

    return triton_q4


def _unit_scale_weight(rng, qtype: int, n_out: int, nb: int) -> tuple[np.ndarray, tq.DeviceWeight]:
    """Random quants with every block scale 1.0: the product is then the sum of the integer block
    dots, exact in float32 (below 2**24) - the int32 sums themselves."""
    bsz = tq.BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (n_out, nb, bsz), dtype=np.uint8)
    raw[:, :, :2] = np.array([1.0], np.float16).view(np.uint8)
    if qtype == tq.Q4_0:
        wq = np.concatenate([raw[:, :, 2:] & 15, raw[:, :, 2:] >> 4], axis=2).astype(np.int64) - 8
    else:
        wq = raw[:, :, 2:].view(np.int8).astype(np.int64)
    w = tq.DeviceWeight.upload(raw.reshape(n_out, nb * bsz), qtype, n_out, nb * 32, "cpu")
    return wq.reshape(n_out, nb * 32), w


@pytest.mark.parametrize("qtype", [tq.Q4_0, tq.Q8_0])
@pytest.mark.parametrize("shape", [(1, 70, 4), (17, 130, 2), (40, 64, 5), (64, 65, 3), (3, 40, 24)])  # (M, N, blocks)
def test_integer_block_sums_are_exact(tt, qtype, shape):
    M, N, nb = shape
    rng = np.random.default_rng(M * N)
    wq, w = _unit_scale_weight(rng, qtype, N, nb)
    xq = rng.integers(-127, 128, (M, nb, 32), dtype=np.int8)
    a = tq.Q8Act(torch.from_numpy(xq), torch.ones((M, nb)))
    want = xq.reshape(M, -1).astype(np.int64) @ wq.T  # [M, N]
    got = tt.linear_q(w, a).numpy()
    assert np.abs(want).max() < 2**24 and np.array_equal(got.astype(np.int64), want)
    assert np.array_equal(got, tq.linear_q(w, a).numpy())


@pytest.mark.parametrize("qtype", [tq.Q4_0, tq.Q8_0])
@pytest.mark.parametrize("shape", [(1, 70, 96), (17, 130, 64), (40, 64, 160), (5, 33, 32), (2, 48, 768),
                                   (20, 40, 2048)])  # (M, N, K): 2,048 loads 16 blocks at a time
def test_same_arithmetic_as_the_torch_path(tt, qtype, shape):
    M, N, K = shape
    rng = np.random.default_rng(K + N)
    raw = (quants.quantize_q4_0 if qtype == tq.Q4_0 else quants.quantize_q8_0)(
        rng.standard_normal((N, K)).astype(np.float32))
    w = tq.DeviceWeight.upload(raw, qtype, N, K, "cpu")
    a = tq.quantize_act(torch.from_numpy((rng.standard_normal((M, K)) * 2).astype(np.float32)))
    got = tt.linear_q(w, a)
    # with the interpreter's fma rounding once (triton_interp_shim), as a GPU's: the torch path's bits,
    # which are the CPU kernels'
    assert torch.equal(got, tq.linear_q(w, a))
    for i in (0, M - 1):  # batch invariant: a row alone
        assert torch.equal(tt.linear_q(w, tq.Q8Act(a.q[i:i + 1], a.d[i:i + 1])), got[i:i + 1])


def test_argument_checks(tt):
    rng = np.random.default_rng(0)
    raw = quants.quantize_q4_0(rng.standard_normal((8, 64)).astype(np.float32))
    w = tq.DeviceWeight.upload(raw, tq.Q4_0, 8, 64, "cpu")
    with pytest.raises(ValueError, match="do not match"):
        tt.linear_q(w, tq.quantize_act(torch.zeros((2, 96))))
    f32 = tq.DeviceWeight.upload(np.zeros((8, 64), np.float32), tq.F32, 8, 64, "cpu")
    with pytest.raises(ValueError, match="Q4_0 or Q8_0"):
        tt.linear_q(f32, tq.quantize_act(torch.zeros((2, 64))))
    assert tt.linear_q(w, tq.quantize_act(torch.zeros((0, 64)))).shape == (0, 8)


@pytest.fixture(scope="module")
def tiny_gemma3_w8(tmp_path_factory) -> Path:
    """``tiny_gemma3`` with a window of 8 positions: the interpreter runs every program of the attention's
    grid in Python, so the windows bite within a third of the tokens the session's model needs."""
    from tests.tiny_models import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "gemma3-w8.gguf", "gemma3", n_layers=7, head_dim=32,
                           rope_base=1e6, window=8, output_norm_scale=4.0)


@pytest.mark.parametrize(("model", "n", "cut"), [("tiny_qwen2", 28, 22), ("tiny_gemma3_w8", 12, 9),
                                                 ("tiny_qwen3moe", 28, 22)])
def test_torch_backend_on_the_triton_path(tt, model, n, cut, request, monkeypatch):
    """The backend with every op on Triton (products, row-wise ops, paged attention): the torch path's
    logits bit for bit (with the interpreter's fma rounding once, as a GPU's), and batch invariant
    (``n`` tokens, then the first ``cut`` of them and the rest beside another sequence).  Gemma 3's
    sliding windows bite from position 8 on, on both sides of the cut, and layer 5 attends globally;
    qwen3moe routes to experts (Triton's router)."""
    from tests.oracles import mean_kl, top1_agreement
    from weaved.backends.base import Logits, SeqChunk
    from weaved.backends.torch import TorchBackend

    path = request.getfixturevalue(model)
    tokens = (np.arange(n, dtype=np.int32) * 37 + 5) % 400
    ref = TorchBackend.from_file(path, threads=1)
    monkeypatch.setenv("WEAVE_TORCH_KERNELS", "triton")
    be = TorchBackend.from_file(path, threads=1)
    assert (ref.kernels, be.kernels, be._paged_kernel, be._ops.path) == ("torch", "triton", True, "triton")
    assert be._ops.route.__module__ == "weaved.kernels.triton_router"
    want = ref.forward([SeqChunk(ref.new_kv(64), tokens, Logits.ALL)])[0]
    got = be.forward([SeqChunk(be.new_kv(64), tokens, Logits.ALL)])[0]
    assert np.array_equal(want, got), (mean_kl(want, got), top1_agreement(want, got))
    kv = be.new_kv(64)
    be.forward([SeqChunk(kv, tokens[:cut], Logits.NONE)])
    rows = be.forward([SeqChunk(be.new_kv(8), tokens[:2]), SeqChunk(kv, tokens[cut:], Logits.ALL)])[1]
    assert np.array_equal(rows, got[cut:])


@pytest.mark.parametrize("qtype", [tq.Q4_0, tq.Q8_0])
def test_pair_dots_are_elements_of_the_product_and_refine_every_row_in_one_launch(tt, qtype):
    from weaved.kernels.torch_products import Products

    rng = np.random.default_rng(qtype)
    N, K, T = 300, 96, 5
    raw = (quants.quantize_q4_0 if qtype == tq.Q4_0 else quants.quantize_q8_0)(
        rng.standard_normal((N, K)).astype(np.float32))
    w = tq.DeviceWeight.upload(raw, qtype, N, K, "cpu")
    a = tq.quantize_act(torch.from_numpy(rng.standard_normal((T, K)).astype(np.float32)))
    full = tt.linear_q(w, a)
    rows = torch.from_numpy(rng.integers(0, T, 77))
    cols = torch.from_numpy(rng.integers(0, N, 77))
    assert torch.equal(tt.pair_dots(w, a, rows, cols), full[rows, cols])
    assert tt.pair_dots(w, a, rows[:0], cols[:0]).shape == (0,)
    x = torch.from_numpy((rng.standard_normal((T, K)) * 3).astype(np.float32))
    for margin, top in ((2.0, 40), (0.5, 3), (50.0, 300)):  # a few candidates a row, or all of them
        assert torch.equal(Products("triton").linear_residual(w, x, margin, top),
                           Products("torch").linear_residual(w, x, margin, top))


@pytest.mark.parametrize("qtype", [tq.Q4_0, tq.Q8_0])
def test_grouped_experts_give_each_experts_product_in_one_launch(tt, qtype):
    """Pairs routed to 6 experts (one unused, one with more rows than a tile): each output row is its
    expert's ``linear_q`` of its token's row, bit for bit, and the tiles cover every pair once."""
    from weaved.kernels import triton_moe

    rng = np.random.default_rng(qtype + 1)
    E, N, K, T = 6, 70, 64, 25
    quant = quants.quantize_q4_0 if qtype == tq.Q4_0 else quants.quantize_q8_0
    raws = [quant(rng.standard_normal((N, K)).astype(np.float32)) for _ in range(E)]
    stack = torch.from_numpy(np.stack(raws)).reshape(E, N, K // 32, tq.BLOCK_BYTES[qtype])
    experts = torch.from_numpy(rng.choice([0, 1, 2, 4, 5, 5, 5, 5], size=2 * T))  # expert 3 unused, 5 busy
    a = tq.quantize_act(torch.from_numpy(rng.standard_normal((T, K)).astype(np.float32)))
    order, tile_e, r0, r1, counts = triton_moe.plan(experts, E)
    assert counts.tolist() == [int((experts == e).sum()) for e in range(E)] and counts[5] > triton_moe.BM
    live = tile_e >= 0
    assert sorted(int(r) for a_, b_ in zip(r0[live], r1[live], strict=True) for r in range(a_, b_)) == \
        list(range(2 * T))
    y = triton_moe.grouped_linear(stack, qtype, a, order // 2, tile_e, r0, r1)
    for r, p in enumerate(order.tolist()):
        w = tq.DeviceWeight(qtype, N, K, stack[int(experts[p])])
        assert torch.equal(y[r], tq.linear_q(w, tq.Q8Act(a.q[p // 2:p // 2 + 1], a.d[p // 2:p // 2 + 1]))[0])


def test_the_tile_sweep_times_every_matrix_and_finds_the_bits_unchanged(tiny_llama, monkeypatch):
    """``gpucheck --sweep`` on the Triton path: each of the model's matrices under each tile size, the
    products equal to the default's."""
    from weaved.backends.torch import TorchBackend
    from weaved.gpucheck.sweep import product_sweep

    monkeypatch.setenv("WEAVE_TORCH_KERNELS", "triton")
    be = TorchBackend.from_file(tiny_llama, threads=1)
    from weaved.gpucheck.sweep import matrices

    assert set(matrices(be)) == {"qkv", "out", "gate_up", "down", "output"}
    configs = {1: [(None, None), (16, 4)], 40: [(None, None), (32, 4, 32), (16, 8, 16, 8), (16, 1, 128, 4, 2)]}
    rows = product_sweep(be, rows=(1, 40), reps=1, configs=configs, only={"out", "down"})
    assert [(r["matrix"], r["rows"], r["block_n"], r["block_m"], r["converter"]) for r in rows] == [
        (m, t, bn, bm, cvt) for m in ("out", "down") for t, bn, bm, cvt in
        ((1, None, None, False), (1, 16, None, False), (1, None, None, True), (40, None, None, False),
         (40, 32, 32, False), (40, 16, 16, False), (40, 16, 128, False), (40, None, None, True))]
    # 40 rows in 16- to 128-row tiles, and the sums made floats by the converter: the same bits
    assert all(r["equal"] and r["us"] > 0 for r in rows)
    from weaved.kernels import torch_q4 as tq
    from weaved.kernels import triton_q4

    with pytest.raises(ValueError, match="block_m"):
        triton_q4.linear_q(be.weights.output, tq.quantize_act(torch.zeros((2, be.config.d_model))), block_m=256)
