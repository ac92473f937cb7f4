"""linear / linear_q: accuracy, batch invariance (bit-identical rows), both kernel paths, errors."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as GQT
from weaved.kernels import matmul as M
from weaved.kernels import quants as Q
from weaved.kernels import threads
from weaved.kernels.ggml import GGMLType

PATHS = ["portable", pytest.param("vnni", marks=pytest.mark.skipif(not M.vnni_supported(),
                                                                    reason="no AVX-512 VNNI kernels on this CPU"))]
QTYPES = [pytest.param(GGMLType.Q4_0, id="Q4_0"), pytest.param(GGMLType.Q8_0, id="Q8_0")]
QUANTIZE = {GGMLType.Q4_0: Q.quantize_q4_0, GGMLType.Q8_0: Q.quantize_q8_0}
DEQUANTIZE = {GGMLType.Q4_0: Q.dequantize_q4_0, GGMLType.Q8_0: Q.dequantize_q8_0}


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest):
    M.set_kernel_path(request.param)
    yield request.param
    M.set_kernel_path(None)


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch):
    """Restores the thread count afterwards; meanwhile every product with > 1 thread is split
    between threads, however small."""
    monkeypatch.setattr(M, "PAR_MIN_US", 0.0)
    old = threads.get_threads()
    yield
    threads.set_threads(old)


def weights(qtype: GGMLType, n_out: int, n_in: int, seed: int = 0) -> tuple[np.ndarray, M.PackedWeight]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n_out, n_in)) * rng.uniform(0.01, 0.1, (n_out, 1))).astype(np.float32)
    if qtype in QUANTIZE:
        raw = QUANTIZE[qtype](w)
    else:
        raw = w.astype(np.float16) if qtype == GGMLType.F16 else w
    return raw, M.pack_weight(raw, qtype, n_out, n_in)


def activations(T: int, n_in: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, n_in)) * rng.uniform(0.1, 3.0, (T, 1))).astype(np.float32)


def dequant_x(x: np.ndarray) -> np.ndarray:
    q, d = Q.quantize_activations_ref(x)
    T, K = x.shape
    return (q.reshape(T, K // 32, 32) * d[:, :, None].astype(np.float64)).reshape(T, K)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n_out,n_in", [(100, 96), (64, 576), (40, 1536)])
def test_linear_matches_float64_reference(path: str, qtype: GGMLType, n_out: int, n_in: int) -> None:
    raw, w = weights(qtype, n_out, n_in)
    x = activations(19, n_in)
    y = M.linear(w, x)
    assert y.dtype == np.float32 and y.shape == (19, n_out)
    wd = DEQUANTIZE[qtype](raw).astype(np.float64)
    ref = dequant_x(x) @ wd.T  # what the integer recipe computes, in exact arithmetic
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    ref_f = x.astype(np.float64) @ wd.T  # unquantized activations: the Q8_0 error of x remains
    assert np.linalg.norm(y - ref_f) <= 2e-2 * np.linalg.norm(ref_f)


@pytest.mark.parametrize("qtype", QTYPES)
def test_batch_invariance(path: str, qtype: GGMLType, two_threads) -> None:
    """Row t of the result is bit-identical for every T and thread count (n_out = 100: padded tile)."""
    _, w = weights(qtype, 100, 576, seed=2)
    x = activations(100, 576, seed=3)
    threads.set_threads(1)
    alone = np.stack([M.linear(w, np.ascontiguousarray(x[t:t + 1]))[0] for t in range(100)])
    for n_threads in (1, 2):
        threads.set_threads(n_threads)
        for T in (1, 3, 16, 17, 64, 100):  # 100 > 64: two column passes
            for start in sorted({0, 100 - T, (100 - T) // 2}):
                y = M.linear(w, np.ascontiguousarray(x[start:start + T]))
                assert np.array_equal(y, alone[start:start + T]), (n_threads, T, start)
    # other rows in the batch do not matter either
    x2 = x.copy()
    x2[1:] = activations(99, 576, seed=4)
    assert np.array_equal(M.linear(w, x2)[0], alone[0])


@pytest.mark.skipif(not M.vnni_supported(), reason="no AVX-512 VNNI kernels on this CPU")
@pytest.mark.parametrize("qtype", QTYPES)
def test_paths_give_identical_bits(qtype: GGMLType) -> None:
    _, w = weights(qtype, 70, 288, seed=5)
    x = activations(66, 288, seed=6)
    try:
        M.set_kernel_path("portable")
        a = M.linear(w, x)
        M.set_kernel_path("vnni")
        b = M.linear(w, x)
    finally:
        M.set_kernel_path(None)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("qtype", QTYPES)
def test_linear_q_and_out(path: str, qtype: GGMLType) -> None:
    _, w = weights(qtype, 33, 64)
    x = activations(5, 64)
    y = M.linear(w, x)
    qx = Q.quantize_activations(x)
    out = np.full((5, 33), np.nan, np.float32)
    assert M.linear_q(w, qx, out=out) is out
    assert np.array_equal(out, y)
    wide = np.full((5, 33 + 7), np.nan, np.float32)  # a row-padded output: the padding is left alone
    assert M.linear(w, x, out=wide) is wide
    assert np.array_equal(wide[:, :33], y) and np.isnan(wide[:, 33:]).all()
    assert M.padded_out(5, 1024).shape == (5, 1024 + M.ROW_PAD) and M.padded_out(5, 1000).shape == (5, 1000)
    assert M.linear(w, np.zeros((0, 64), np.float32)).shape == (0, 33)


@pytest.mark.parametrize("qtype", QTYPES)
def test_concat_rows_fuses_matrices(qtype: GGMLType) -> None:
    """A fused matrix gives exactly the outputs of its parts (each row's arithmetic is its own)."""
    raws = [weights(qtype, n, 64, seed=s)[0] for n, s in ((24, 7), (8, 8), (40, 9))]
    fused = M.pack_weight(M.concat_rows(raws), qtype, 72, 64)
    x = activations(9, 64)
    parts = [M.linear(M.pack_weight(r, qtype, r.shape[0], 64), x) for r in raws]
    assert np.array_equal(M.linear(fused, x), np.concatenate(parts, axis=1))
    with pytest.raises(ValueError, match="same dtype and row length"):
        M.concat_rows([raws[0], raws[0][:, :18]])


@pytest.mark.parametrize("qtype", [GGMLType.F32, GGMLType.F16], ids=["F32", "F16"])
def test_float_weights(qtype: GGMLType, two_threads) -> None:
    raw, w = weights(qtype, 45, 70)
    x = activations(20, 70)
    threads.set_threads(1)
    y = M.linear(w, x)
    ref = x.astype(np.float64) @ raw.astype(np.float64).T
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    threads.set_threads(2)
    for T in (1, 7, 20):
        assert np.array_equal(M.linear(w, np.ascontiguousarray(x[:T])), y[:T])
    with pytest.raises(ValueError, match="Q4_0 or Q8_0"):
        M.linear_q(w, Q.quantize_activations(np.zeros((1, 64), np.float32)))


@pytest.mark.parametrize("qtype,gqt", [(GGMLType.Q4_0, GQT.Q4_0), (GGMLType.Q8_0, GQT.Q8_0),
                                       (GGMLType.F16, GQT.F16), (GGMLType.F32, GQT.F32)],
                         ids=["Q4_0", "Q8_0", "F16", "F32"])
def test_embed_rows(qtype: GGMLType, gqt: GQT) -> None:
    raw, _ = weights(qtype, 50, 64)
    ids = np.array([3, 0, 49, 3], np.int64)
    got = M.embed_rows(raw, qtype, ids)
    assert got.dtype == np.float32 and got.shape == (4, 64)
    assert np.array_equal(got, np.asarray(gq.dequantize(raw, gqt), np.float32)[ids])
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 50\)"):
        M.embed_rows(raw, qtype, np.array([50]))


def test_kernel_path_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEAVE_KERNELS", "portable")
    assert M.kernel_path() == "portable"
    monkeypatch.setenv("WEAVE_KERNELS", "auto")
    assert M.kernel_path() == ("vnni" if M.vnni_supported() else "portable")
    monkeypatch.setenv("WEAVE_KERNELS", "fast")
    with pytest.raises(ValueError, match="WEAVE_KERNELS"):
        M.kernel_path()
    with pytest.raises(ValueError, match="kernel path"):
        M.set_kernel_path("avx2")
    feats = threads.cpu_features()
    assert isinstance(feats, frozenset) and all(isinstance(f, str) for f in feats)
    # (numba may also be told to compile for another CPU: NUMBA_CPU_NAME, then VNNI is never used)
    assert M.vnni_supported() <= ({"avx512f", "avx512bw", "avx512_vnni"} <= feats)


def test_threads_api(two_threads) -> None:
    threads.set_threads(1)
    assert threads.get_threads() == 1
    threads.set_threads(10_000)
    assert threads.get_threads() == threads.max_threads()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="thread count"):
            threads.set_threads(bad)


def test_errors() -> None:
    raw, w = weights(GGMLType.Q4_0, 32, 64)
    with pytest.raises(ValueError, match=r"needs uint8 \[32, 36\]"):
        M.pack_weight(raw[:, :18], GGMLType.Q4_0, 32, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        M.pack_weight(raw, GGMLType.Q4_0, 32, 72)
    with pytest.raises(ValueError, match=r"needs float16 \[4, 8\]"):
        M.pack_weight(np.zeros((4, 8), np.float32), GGMLType.F16, 4, 8)
    with pytest.raises(ValueError, match="unsupported GGML type"):
        M.pack_weight(raw, 3, 32, 64)
    bad_x = [np.zeros((2, 64), np.float64), np.zeros((2, 65), np.float32), np.zeros(64, np.float32),
             np.zeros((64, 2), np.float32).T, [[0.0] * 64]]
    for x in bad_x:
        with pytest.raises(ValueError, match=r"linear: x must be a C-contiguous float32 \[T, 64\]"):
            M.linear(w, x)
    with pytest.raises(ValueError, match=r"out must be a writeable C-contiguous float32 \[2, >= 32\]"):
        M.linear(w, np.zeros((2, 64), np.float32), out=np.zeros((2, 31), np.float32))
    with pytest.raises(ValueError, match="n_in = 64"):
        M.linear_q(w, Q.quantize_activations(np.zeros((2, 96), np.float32)))
    with pytest.raises(ValueError, match="1-D integer"):
        M.embed_rows(raw, GGMLType.Q4_0, np.array([0.5]))
