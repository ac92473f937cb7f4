"""torch_q4: Q8_0 activations and Q4_0/Q8_0/F16/F32 products in torch ops, held to the CPU kernels'
bits (the recipe is the same, op for op), batch invariance, and argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from weaved.kernels import matmul, quants
from weaved.kernels import torch_products as tp
from weaved.kernels import torch_q4 as tq
from weaved.kernels.ggml import GGMLType
from weaved.kernels.residual import linear_residual

QUANT = {tq.Q4_0: quants.quantize_q4_0, tq.Q8_0: quants.quantize_q8_0}


def _acts(rng: np.random.Generator, T: int, K: int, scale: float = 3.0) -> np.ndarray:
    x = (rng.standard_normal((T, K)) * scale).astype(np.float32)
    if T > 1:
        x[1, :32] = 0.0  # an all-zero block: scale 0, quants 0
        x[1, 32:64] *= 1e4  # a block far larger than the rest of its row
    return x


def _weight(rng: np.random.Generator, qtype: int, n_out: int, n_in: int) -> tuple[np.ndarray, tq.DeviceWeight]:
    if qtype in QUANT:
        raw = QUANT[qtype](rng.standard_normal((n_out, n_in)).astype(np.float32))
    else:
        raw = rng.standard_normal((n_out, n_in)).astype(np.float16 if qtype == tq.F16 else np.float32)
    return raw, tq.DeviceWeight.upload(raw, qtype, n_out, n_in, "cpu")


def test_quantize_act_is_the_cpu_recipe_bit_for_bit():
    rng = np.random.default_rng(0)
    x = _acts(rng, 9, 256)
    x[2, :32] = np.arange(32) - 15.5  # amax 16.5: many products land near .5 steps
    x[3, :32] = 0.0
    x[3, 0] = 127.0  # idd = 1: x = 2.5, -3.5 ... are exact halves, rounded to even
    x[3, 1:5] = [2.5, -3.5, 0.5, -0.5]
    a = tq.quantize_act(torch.from_numpy(x))
    ref = quants.quantize_activations(x)
    assert a.q.dtype == torch.int8 and a.q.shape == (9, 8, 32) and a.d.shape == (9, 8)
    assert np.array_equal(a.q.numpy(), ref.q.transpose(1, 0, 2))
    assert np.array_equal(a.d.numpy(), ref.d.T)
    q_ref, d_ref = quants.quantize_activations_ref(x)
    assert np.array_equal(a.q.numpy().reshape(9, 256), q_ref) and np.array_equal(a.d.numpy(), d_ref)
    assert a.q[3, 0, 1:5].tolist() == [2, -4, 0, 0]


@pytest.mark.parametrize("qtype", [tq.Q4_0, tq.Q8_0])
def test_block_sums_are_exact_on_both_paths(qtype, monkeypatch):
    rng = np.random.default_rng(1)
    raw, w = _weight(rng, qtype, 77, 160)
    wq = (quants.dequantize_q4_0_ref if qtype == tq.Q4_0 else quants.dequantize_q8_0_ref)(raw)
    scales = np.asarray(raw).reshape(77, 5, -1)[:, :, :2].copy().view(np.float16).astype(np.float32)
    wint = np.rint(wq.reshape(77, 5, 32) / np.where(scales == 0, 1, scales)).astype(np.int64)  # the quants
    for T in (1, 3, 6):
        a = tq.quantize_act(torch.from_numpy(_acts(rng, T, 160)))
        want = np.einsum("nbj,tbj->btn", wint, a.q.numpy().astype(np.int64)).astype(np.float32)
        for rows in (4, 0):  # torch._int_mm for a few rows, float32 bmm for more
            monkeypatch.setattr(tq, "INT_MM_MAX_ROWS", rows)
            got = tq.block_sums(w, a.q)
            assert np.array_equal(got.numpy(), want), (T, rows)


@pytest.mark.parametrize("qtype", [tq.Q4_0, tq.Q8_0])
@pytest.mark.parametrize("shape", [(1, 300, 576), (3, 70, 96), (7, 1, 32), (40, 257, 128)])
def test_linear_q_is_the_cpu_kernels_bits(qtype, shape):
    T, n_out, n_in = shape
    rng = np.random.default_rng(2)
    raw, w = _weight(rng, qtype, n_out, n_in)
    x = _acts(rng, T, n_in)
    ours = tp.Products("torch").linear(w, torch.from_numpy(x)).numpy()
    cpu = matmul.linear(matmul.pack_weight(raw, GGMLType(qtype), n_out, n_in), x)
    assert np.array_equal(ours, cpu)


def test_linear_q_slabs_and_paths_agree(monkeypatch):
    rng = np.random.default_rng(3)
    _, w = _weight(rng, tq.Q4_0, 500, 64)
    a = tq.quantize_act(torch.from_numpy(_acts(rng, 6, 64)))
    whole = tq.linear_q(w, a)
    monkeypatch.setattr(tq, "SLAB_ELEMS", 1000)  # many slabs of weight rows
    monkeypatch.setattr(tq, "BULK_ELEMS", 0)  # the block-at-a-time accumulation
    assert torch.equal(tq.linear_q(w, a), whole)


def test_unfused_accumulation_differs_only_in_rounding():
    rng = np.random.default_rng(4)
    _, w = _weight(rng, tq.Q4_0, 200, 512)
    a = tq.quantize_act(torch.from_numpy(_acts(rng, 4, 512)))
    fused, plain = tq.linear_q(w, a), tq.linear_q(w, a, fused=False)
    scale = fused.abs().amax(dim=1, keepdim=True)
    assert not torch.equal(fused, plain)  # 16 blocks: some sums round differently
    assert ((fused - plain).abs() <= 1e-6 * scale).all()


@pytest.mark.parametrize("qtype", [tq.Q4_0, tq.Q8_0, tq.F16, tq.F32])
def test_rows_do_not_depend_on_the_batch(qtype):
    rng = np.random.default_rng(5)
    _, w = _weight(rng, qtype, 130, 96)
    x = torch.from_numpy(_acts(rng, 11, 96))
    prod = tp.Products("torch")
    batched = prod.linear(w, x)
    for i in (0, 1, 5, 10):
        assert torch.equal(prod.linear(w, x[i:i + 1].clone()), batched[i:i + 1])
    assert torch.equal(prod.linear(w, x[3:9].clone()), batched[3:9])


@pytest.mark.parametrize("qtype", [tq.F16, tq.F32])
def test_float_weights_are_the_cpu_kernels_bits(qtype):
    rng = np.random.default_rng(6)
    raw, w = _weight(rng, qtype, 45, 64)
    x = _acts(rng, 5, 64)
    cpu = matmul.linear(matmul.pack_weight(raw, GGMLType(qtype), 45, 64), x)
    assert np.array_equal(tq.linear_float(w, torch.from_numpy(x)).numpy(), cpu)


@pytest.mark.parametrize("qtype", [tq.Q4_0, tq.Q8_0])
@pytest.mark.parametrize("margin,top", [(12.0, 128), (3.0, 128), (40.0, 8)])
@pytest.mark.parametrize("n_out", [1000, 1001])
def test_residual_logits_are_the_cpu_kernels_bits(qtype, margin, top, n_out):
    """The refined set (a function of each row's values) and every logit's bits match the CPU's."""
    rng = np.random.default_rng(7)
    raw, w = _weight(rng, qtype, n_out, 128)
    x = _acts(rng, 5, 128)
    x[1] *= 0.05  # a flat row: many logits within the margin, the cap decides
    ours = tp.Products("torch").linear_residual(w, torch.from_numpy(x), margin, top).numpy()
    counts = np.empty(5, np.int64)
    cpu = linear_residual(matmul.pack_weight(raw, GGMLType(qtype), n_out, 128), x, margin, top, counts)
    assert np.array_equal(ours, cpu)
    assert counts.min() >= 1 and (top > 8 or counts.max() == 8)
    a1, a2 = tq.quantize_two_level(torch.from_numpy(x))
    assert a1.q.shape == a2.q.shape == (5, 4, 32)


@pytest.mark.parametrize("qtype", [tq.Q4_0, tq.Q8_0, tq.F16, tq.F32])
def test_embed_rows_dequantize_like_gguf(qtype):
    rng = np.random.default_rng(8)
    raw, w = _weight(rng, qtype, 50, 64)
    ids = np.array([0, 7, 7, 49])
    got = tq.embed_rows(w, torch.from_numpy(ids)).numpy()
    assert np.array_equal(got, matmul.embed_rows(raw, GGMLType(qtype), ids))


def test_weights_stay_in_their_file_encoding():
    rng = np.random.default_rng(9)
    raw, w = _weight(rng, tq.Q4_0, 10, 64)
    assert w.data.dtype == torch.uint8 and w.data.shape == (10, 2, 18)
    assert np.array_equal(w.data.numpy().reshape(10, 36), raw) and w.nbytes == raw.nbytes
    assert np.array_equal(tq.weight_scales(w.data).numpy(),
                          raw.reshape(10, 2, 18)[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32))


def test_argument_checks():
    rng = np.random.default_rng(10)
    raw, w = _weight(rng, tq.Q4_0, 10, 64)
    with pytest.raises(ValueError, match="needs uint8"):
        tq.DeviceWeight.upload(raw[:, :30], tq.Q4_0, 10, 64, "cpu")
    with pytest.raises(ValueError, match="unsupported GGML type"):
        tq.DeviceWeight.upload(raw, 3, 10, 64, "cpu")
    with pytest.raises(ValueError, match="float32"):
        tq.quantize_act(torch.zeros((2, 64), dtype=torch.float64))
    with pytest.raises(ValueError, match="multiple of 32"):
        tq.quantize_act(torch.zeros((2, 40)))
    with pytest.raises(ValueError, match="do not match"):
        tq.linear_q(w, tq.quantize_act(torch.zeros((2, 96))))
    with pytest.raises(ValueError, match="Q4_0 or Q8_0"):
        tq.linear_q(tq.DeviceWeight.upload(np.zeros((2, 64), np.float32), tq.F32, 2, 64, "cpu"),
                    tq.quantize_act(torch.zeros((1, 64))))
    with pytest.raises(ValueError, match="kernel path"):
        tp.Products("cuda")


def test_kernel_path_choice(monkeypatch):
    monkeypatch.delenv("WEAVE_TORCH_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert tp.kernel_path("cpu") == "torch"
    monkeypatch.setenv("WEAVE_TORCH_KERNELS", "torch")
    assert tp.kernel_path("cuda") == "torch"
    monkeypatch.setenv("WEAVE_TORCH_KERNELS", "triton")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        tp.kernel_path("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tp.kernel_path("cpu") == "triton"
    monkeypatch.setenv("WEAVE_TORCH_KERNELS", "fast")
    with pytest.raises(ValueError, match="WEAVE_TORCH_KERNELS"):
        tp.kernel_path("cpu")
