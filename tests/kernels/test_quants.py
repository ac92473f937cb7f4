"""Q4_0 / Q8_0 quantization: bit-exact with gguf.quants, activation quantization vs numpy."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as GQT
from weaved.kernels import quants as Q
from weaved.kernels._f16 import f16_to_f32, f32_to_f16_array
from weaved.kernels.ggml import BLOCK_BYTES, GGMLType, as_ggml_type, row_bytes

QUANT = {
    GGMLType.Q4_0: (Q.quantize_q4_0, Q.quantize_q4_0_ref, Q.dequantize_q4_0, Q.dequantize_q4_0_ref, GQT.Q4_0),
    GGMLType.Q8_0: (Q.quantize_q8_0, Q.quantize_q8_0_ref, Q.dequantize_q8_0, Q.dequantize_q8_0_ref, GQT.Q8_0),
}


def tricky_rows(seed: int = 0) -> np.ndarray:
    """float32 [40, 128]: random rows of many magnitudes plus the edge cases of block quantization."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((40, 128)) * np.exp(rng.uniform(-8, 8, (40, 1)))).astype(np.float32)
    x[0] = 0.0                                   # all-zero blocks (d = 0)
    x[1, :32] = -0.0
    x[2, :32] = 3.0                              # all-equal blocks
    x[2, 32:64] = -1.25
    x[3] *= np.float32(1e6)                      # scales beyond fp16 range -> inf
    x[4] *= np.float32(1e-30)                    # scales below fp16 range -> 0 / subnormal
    x[5] = rng.integers(-16, 17, 128) * np.float32(0.25)  # many exact halves after scaling
    x[6, :32] = np.linspace(-1, 1, 32, dtype=np.float32)
    x[7, :32] = 0.0
    x[7, 5], x[7, 9] = 2.0, -2.0                 # |max| tie: the first one decides the sign of d
    x[8, :32] = 0.0
    x[8, 3], x[8, 4] = -7.0, 7.0
    x[9] = rng.uniform(-65504 * 8, 65504 * 8, 128).astype(np.float32)  # around the fp16 overflow of d
    x[10] *= np.float32(2.0**-14 * 8)            # d near the fp16 subnormal boundary
    return x


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q8_0])
def test_quantize_dequantize_bit_exact_with_gguf(qtype: GGMLType) -> None:
    quant, quant_ref, dequant, dequant_ref, gqt = QUANT[qtype]
    x = tricky_rows()
    with np.errstate(over="ignore", invalid="ignore"):
        want = gq.quantize(x, gqt)
        got = quant(x)
        assert got.dtype == np.uint8 and got.shape == (40, row_bytes(qtype, 128))
        assert np.array_equal(got, want)
        assert np.array_equal(quant_ref(x), want)
        deq_want = gq.dequantize(want, gqt)
        assert np.array_equal(dequant(want), deq_want, equal_nan=True)
        assert np.array_equal(dequant_ref(want), deq_want, equal_nan=True)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q8_0])
def test_dequantize_random_bytes(qtype: GGMLType) -> None:
    """Every byte pattern (all fp16 scales incl. subnormals, inf, NaN) dequantizes like gguf."""
    _, _, dequant, _, gqt = QUANT[qtype]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (2048, BLOCK_BYTES[qtype] * 2), dtype=np.uint8)  # 4096 blocks
    raw.reshape(4096, -1)[:, :2] = np.arange(0, 65536, 16, dtype=np.uint16).view(np.uint8).reshape(4096, 2)
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.array_equal(dequant(raw), gq.dequantize(raw, gqt), equal_nan=True)


def test_quantize_accepts_other_float_dtypes_and_empty() -> None:
    x = tricky_rows()[11:20]
    x64 = x.astype(np.float64)
    assert np.array_equal(Q.quantize_q4_0(x64), Q.quantize_q4_0(x64.astype(np.float32)))
    assert Q.quantize_q8_0(np.zeros((0, 64), np.float32)).shape == (0, 68)
    assert Q.dequantize_q4_0(np.zeros((0, 36), np.uint8)).shape == (0, 64)


@pytest.mark.parametrize("bad", [np.zeros((4, 33), np.float32), np.zeros(64, np.float32),
                                 np.zeros((2, 64), np.int32)])
def test_quantize_rejects_bad_input(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="quantize_q4_0"):
        Q.quantize_q4_0(bad)
    with pytest.raises(ValueError, match="quantize_q8_0"):
        Q.quantize_q8_0(bad)


def test_dequantize_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"uint8 \[N, nb\*18\]"):
        Q.dequantize_q4_0(np.zeros((2, 19), np.uint8))
    with pytest.raises(ValueError, match=r"uint8 \[N, nb\*34\]"):
        Q.dequantize_q8_0(np.zeros((2, 34), np.int8))


def test_f16_conversions_match_numpy() -> None:
    h = np.arange(65536, dtype=np.uint32)
    want = h.astype(np.uint16).view(np.float16).astype(np.float32)
    got = np.array([f16_to_f32(int(v)) for v in h[::7]], np.float32)
    assert np.array_equal(got, want[::7], equal_nan=True)
    rng = np.random.default_rng(2)
    # every exponent that maps to a finite half (plus neighbours), random significands, both signs
    bits = rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x33000000, 0x33000001, 0x387FE000, 0x387FF000, 0x38800000, 0x477FEFFF, 0x477FF000,
                      0x477FFFFF, 0x47800000, 0x7F800000, 0x00000001, 0x38000000, 0x38001000, 0x38003000],
                     np.uint32)
    bits = np.concatenate([bits, edges, edges | 0x80000000, (bits & 0x87FFFFFF) | 0x30000000])
    f = bits.view(np.float32)
    f = f[np.isfinite(f)]
    out = np.empty(f.size, np.uint16)
    f32_to_f16_array(f, out)
    with np.errstate(over="ignore"):
        assert np.array_equal(out, f.astype(np.float16).view(np.uint16))


def test_activation_quantization_matches_reference() -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((37, 96)) * np.exp(rng.uniform(-5, 5, (37, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, :32] = 2.0
    x[2] = rng.integers(-254, 255, 96) * np.float32(0.5)  # exact halves: round half to even
    x[2, 0] = 127.0
    qa = Q.quantize_activations(x)
    q_ref, d_ref = Q.quantize_activations_ref(x)
    assert qa.q.shape == (3, 37, 32) and qa.d.shape == (3, 37) and qa.s.shape == (3, 37)
    assert qa.n_tokens == 37 and qa.n_in == 96
    assert np.array_equal(qa.q.transpose(1, 0, 2).reshape(37, 96), q_ref)
    assert np.array_equal(qa.d.T, d_ref)
    assert np.array_equal(qa.s.T, q_ref.reshape(37, 3, 32).astype(np.int32).sum(-1))
    # rows are quantized independently: one row alone gives the same bytes
    one = Q.quantize_activations(np.ascontiguousarray(x[5:6]))
    assert np.array_equal(one.q[:, 0], qa.q[:, 5]) and np.array_equal(one.d[:, 0], qa.d[:, 5])
    # d = amax/127 exactly, |q| <= 127, and half-way cases round to even
    assert np.abs(q_ref).max() <= 127
    assert d_ref[2, 0] == np.float32(127.0) / np.float32(127)
    halves = x[2, 1:32] * (np.float32(1) / d_ref[2, 0])
    assert np.array_equal(q_ref[2, 1:32], np.rint(halves).astype(np.int8))


def test_activation_quantization_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="float32"):
        Q.quantize_activations(np.zeros((2, 64), np.float64))
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.quantize_activations(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        Q.quantize_activations(np.zeros((64, 4), np.float32).T)
    assert Q.quantize_activations(np.zeros((0, 64), np.float32)).n_tokens == 0


def test_ggml_types() -> None:
    assert [int(t) for t in GGMLType] == [int(GQT.F32), int(GQT.F16), int(GQT.Q4_0), int(GQT.Q8_0)]
    assert as_ggml_type(GQT.Q4_0) is GGMLType.Q4_0
    assert row_bytes(GGMLType.Q4_0, 576) == 324 and row_bytes(GGMLType.Q8_0, 64) == 68
    assert row_bytes(GGMLType.F16, 5) == 10 and row_bytes(GGMLType.F32, 5) == 20
    with pytest.raises(ValueError, match="multiple of 32"):
        row_bytes(GGMLType.Q4_0, 48)
    with pytest.raises(ValueError, match="unsupported GGML type"):
        as_ggml_type(GQT.Q4_1)
