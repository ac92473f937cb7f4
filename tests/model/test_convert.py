"""Conversion into the shared Q4_0 format: types, metadata, weights, llama.cpp as the oracle, errors."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, LlamaFileType
from gguf.quants import dequantize

from tests.oracles import llama_logits, llama_model, mean_kl
from tests.tiny_models import write_tiny_gguf
from weaved.model.convert import (
    NATIVE_TYPES,
    SUPPORTED_ARCHS,
    _Writer,
    convert_gguf,
    needs_conversion,
    tensor_types,
)
from weaved.model.default import shipped_smollm2_path
from weaved.model.gguf_scan import MetaValue, scan_gguf, tensor_views

EMBEDDINGS = ("token_embd.weight", "output.weight")
PROMPT = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 1812, 2116, 3458, 17, 23, 4563]

# (architecture, layer-matrix type, embedding type, tied)
SOURCES = [
    ("llama", Q.Q4_1, Q.Q8_0, True),
    ("qwen2", Q.Q8_0, Q.Q8_0, False),
    ("qwen3", Q.F16, Q.F16, True),
    ("qwen3moe", Q.F16, Q.F16, True),  # a mixture of experts: a router, 3-D expert stacks
    ("llama", Q.F32, Q.F32, False),
    ("qwen2", Q.Q5_1, Q.Q5_0, False),
]


def _tiny(tmp_path: Path, arch: str, wtype: Q, embd_type: Q, tied: bool, norm_type: Q = Q.F32) -> Path:
    return write_tiny_gguf(
        tmp_path / f"{arch}-{wtype.name}.gguf", arch, wtype=wtype, embd_type=embd_type, tied=tied,
        norm_type=norm_type, head_dim=32 if arch.startswith("qwen3") else None,
        # 16 experts: llama.cpp's quantizer keeps attn_k/attn_v of 8-expert models at 8 bits (Mixtral's rule)
        experts=(16, 4, 32) if arch == "qwen3moe" else None,
    )


def _weights(path: Path) -> dict[str, tuple[Q, np.ndarray]]:
    """Every tensor of a GGUF: its type and its dequantized float32 values."""
    header = scan_gguf(path, want=lambda key: False)
    views = tensor_views(path, header)
    return {t.name: (t.type, dequantize(views[t.name], t.type)) for t in header.tensors}


def _raw(path: Path) -> dict[str, tuple[Q, np.ndarray]]:
    header = scan_gguf(path, want=lambda key: False)
    views = tensor_views(path, header)
    return {t.name: (t.type, np.asarray(views[t.name]).view(np.uint8)) for t in header.tensors}


def check_shared_format(src: Path, dst: Path) -> None:
    """dst is src in the shared format: types by the rule, metadata kept, weights close."""
    src_w, dst_w = _weights(src), _weights(dst)
    assert list(dst_w) == list(src_w)  # same tensors, same order
    for name, (src_type, x) in src_w.items():
        dst_type, y = dst_w[name]
        assert y.shape == x.shape, name
        if x.ndim == 1 or name.endswith("ffn_gate_inp.weight"):  # norms, biases and a router stay float
            assert dst_type == Q.F32, name
            assert np.array_equal(x, y), name  # F16 -> F32 is exact
            continue
        if name in EMBEDDINGS:
            assert dst_type == (Q.Q4_0 if src_type == Q.Q4_0 else Q.Q8_0), name
        else:
            assert dst_type == Q.Q4_0, name
        rel = np.linalg.norm(x - y) / np.linalg.norm(x)
        if src_type == dst_type:
            assert rel == 0, name
        else:  # one more round of 4-bit (or 8-bit) rounding of gaussian weights
            assert rel < (0.12 if dst_type == Q.Q4_0 else 0.01), (name, rel)

    src_meta, dst_meta = scan_gguf(src).metadata, scan_gguf(dst).metadata
    assert dst_meta["general.file_type"].value == LlamaFileType.MOSTLY_Q4_0
    assert dst_meta["general.file_type"].vtype == GGUFValueType.UINT32
    kept = {k: v for k, v in src_meta.items() if k != "general.file_type"}
    assert {k: v for k, v in dst_meta.items() if k in kept} == kept
    assert set(dst_meta) - set(src_meta) <= {"general.file_type", "general.quantization_version"}
    assert not needs_conversion(dst)


@pytest.mark.parametrize(("arch", "wtype", "embd_type", "tied"), SOURCES)
def test_convert_tiny(tmp_path, arch, wtype, embd_type, tied):
    # F16 norms (which llama.cpp's CPU backend cannot run) must come out F32
    src = _tiny(tmp_path, arch, wtype, embd_type, tied, norm_type=Q.F16 if wtype == Q.F16 else Q.F32)
    calls = []
    dst = convert_gguf(src, tmp_path / "out.gguf", progress=lambda i, n, name: calls.append((i, n, name)))
    assert dst == tmp_path / "out.gguf"
    check_shared_format(src, dst)
    names = [t.name for t in scan_gguf(src, want=lambda key: False).tensors]
    assert calls == [(i + 1, len(names), name) for i, name in enumerate(names)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([src.name, "out.gguf"])  # no temp files


def test_q4_0_embedding_stays_q4_0(tmp_path):
    src = write_tiny_gguf(tmp_path / "src.gguf", tied=False, wtype=Q.Q4_0, embd_type=Q.Q4_0)
    assert not needs_conversion(src)
    dst = convert_gguf(src, tmp_path / "dst.gguf")
    check_shared_format(src, dst)
    src_raw, dst_raw = _raw(src), _raw(dst)
    for name, (qtype, data) in src_raw.items():  # already the shared format: every byte kept
        assert dst_raw[name][0] == qtype and np.array_equal(dst_raw[name][1], data), name


def test_needs_conversion(tmp_path):
    for wtype, expected in [(Q.Q4_1, True), (Q.Q5_0, True), (Q.Q4_0, False), (Q.Q8_0, False), (Q.F16, False)]:
        path = write_tiny_gguf(tmp_path / f"{wtype.name}.gguf", n_layers=1, wtype=wtype)
        assert needs_conversion(path) is expected, wtype
    assert needs_conversion(shipped_smollm2_path())
    types = tensor_types(shipped_smollm2_path())
    assert len(types) == 272
    assert types["token_embd.weight"] == Q.Q8_0 and types["blk.0.attn_q.weight"] == Q.Q4_1
    assert NATIVE_TYPES == {Q.F32, Q.F16, Q.Q4_0, Q.Q8_0}


def test_refuses_to_overwrite_without_force(tmp_path):
    src = write_tiny_gguf(tmp_path / "src.gguf", n_layers=1, wtype=Q.Q4_1)
    dst = tmp_path / "dst.gguf"
    dst.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="already exists.*--force"):
        convert_gguf(src, dst)
    assert dst.read_bytes() == b"precious"
    convert_gguf(src, dst, force=True)
    check_shared_format(src, dst)
    with pytest.raises(ValueError, match="onto itself"):
        convert_gguf(src, src, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst.gguf", "src.gguf"]


def test_unsupported_architecture(tmp_path):
    src = write_tiny_gguf(tmp_path / "gpt2.gguf", "gpt2", n_layers=1)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama, qwen2, qwen3"):
        convert_gguf(src, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
    assert SUPPORTED_ARCHS == ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3")


def _write_minimal(path: Path, tensors: dict[str, np.ndarray], extra_meta: dict | None = None) -> Path:
    writer = _Writer(path, "llama")
    for key, (value, vtype, sub) in (extra_meta or {}).items():
        writer.add_key_value(key, value, vtype, sub)
        if key == "general.alignment":
            writer.data_alignment = value
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_tensor_type_and_shape(tmp_path):
    src = _write_minimal(tmp_path / "i8.gguf", {"blk.0.attn_q.weight": np.ones((32, 64), np.int8)})
    with pytest.raises(ValueError, match="blk.0.attn_q.weight has type I8"):
        convert_gguf(src, tmp_path / "out.gguf")
    src = _write_minimal(tmp_path / "odd.gguf", {"blk.0.attn_q.weight": np.ones((4, 48), np.float32)})
    with pytest.raises(ValueError, match="rows of 48 weights"):
        convert_gguf(src, tmp_path / "out.gguf")
    src = _write_minimal(tmp_path / "3d.gguf", {"blk.0.attn_q.weight": np.ones((2, 4, 32), np.float32)})
    with pytest.raises(ValueError, match="3 dimensions"):  # only a mixture's expert stacks are 3-D
        convert_gguf(src, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out.gguf")
    (tmp_path / "notes.txt").write_text("hello, I am not a model\n")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        convert_gguf(tmp_path / "notes.txt", tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_metadata_copied_byte_for_byte(tmp_path):
    """Empty arrays, non-UTF-8 strings, every scalar type and a custom alignment survive."""
    meta = {
        "test.empty": ([], GGUFValueType.ARRAY, GGUFValueType.INT32),
        "test.raw": (b"\xff\xfe bytes", GGUFValueType.STRING, None),
        "test.f64": (0.1, GGUFValueType.FLOAT64, None),
        "test.i8": (-5, GGUFValueType.INT8, None),
        "test.u64": (2**60, GGUFValueType.UINT64, None),
        "test.bools": ([True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL),
        "general.alignment": (64, GGUFValueType.UINT32, None),
    }
    weights = {"token_embd.weight": np.linspace(-1, 1, 64 * 96, dtype=np.float32).reshape(96, 64)}
    src = _write_minimal(tmp_path / "meta.gguf", weights, meta)
    dst = convert_gguf(src, tmp_path / "out.gguf")
    out = scan_gguf(dst)
    assert out.alignment == 64 and out.data_offset % 64 == 0
    for key, (value, vtype, sub) in meta.items():
        assert out.metadata[key] == MetaValue(value, vtype, sub), key
    check_shared_format(src, dst)


# ---------------------------------------------------------------------------------------------------
# llama.cpp as the oracle


def _llama_quantize_q4_0(src: Path, dst: Path) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


def check_same_bytes_as_llama_cpp(src: Path, ours: Path, tmp_path: Path) -> None:
    """Every layer tensor is byte-identical to llama.cpp's own Q4_0 quantization of the same source.

    (llama.cpp picks the embedding / output types by other rules, compared only when they agree, and
    leaves F16 norms F16, compared by value.)
    """
    theirs = tmp_path / "llama-cpp-q4_0.gguf"
    _llama_quantize_q4_0(src, theirs)
    our_raw, their_raw = _raw(ours), _raw(theirs)
    assert set(our_raw) == set(their_raw)
    compared = 0
    for name, (qtype, data) in our_raw.items():
        their_type, their_data = their_raw[name]
        # llama.cpp keeps F16 norms and routers F16; we widen them
        if (data.ndim == 1 or name.endswith("ffn_gate_inp.weight")) and their_type != qtype:
            assert np.array_equal(dequantize(data, qtype), dequantize(their_data, their_type)), name
            compared += 1
            continue
        if name in EMBEDDINGS and qtype != their_type:
            continue
        assert qtype == their_type, name
        assert np.array_equal(data, their_data), name
        compared += 1
    assert compared >= len(our_raw) - 2


@pytest.mark.llama
@pytest.mark.parametrize(("arch", "wtype", "embd_type", "tied"), SOURCES[:5])
def test_tiny_same_bytes_as_llama_cpp_and_runs(tmp_path, arch, wtype, embd_type, tied):
    src = _tiny(tmp_path, arch, wtype, embd_type, tied)
    dst = convert_gguf(src, tmp_path / "out.gguf")
    check_same_bytes_as_llama_cpp(src, dst, tmp_path)
    src_logits = llama_logits(llama_model(src, n_ctx=256), PROMPT)  # [T, vocab]
    dst_logits = llama_logits(llama_model(dst, n_ctx=256), PROMPT)
    assert np.isfinite(dst_logits).all()
    assert mean_kl(src_logits, dst_logits) < 0.15  # measured ~0.03-0.05 for one round of Q4_0


@pytest.mark.slow
def test_smollm2_shared_format(smollm2_q4_0):
    src = shipped_smollm2_path()
    check_shared_format(src, smollm2_q4_0)
    counts: dict[str, int] = {}
    for qtype in tensor_types(smollm2_q4_0).values():
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    assert counts == {"Q4_0": 210, "Q8_0": 1, "F32": 61}


@pytest.mark.slow
@pytest.mark.llama
def test_smollm2_same_bytes_as_llama_cpp_and_runs(smollm2_q4_0, tmp_path):
    check_same_bytes_as_llama_cpp(shipped_smollm2_path(), smollm2_q4_0, tmp_path)
    llm = llama_model(smollm2_q4_0, n_ctx=256)
    logits = llama_logits(llm, llm.tokenize(b"The capital of France is", add_bos=False))
    assert np.isfinite(logits).all() and logits.shape[1] == 49152


def test_conversion_reports_what_it_requantized_and_the_error_it_added(tmp_path):
    from weaved.model.convert import ConversionStats

    src = write_tiny_gguf(tmp_path / "f16.gguf", "llama", wtype=Q.F16, embd_type=Q.F16)
    stats = ConversionStats()
    convert_gguf(src, tmp_path / "out.gguf", stats=stats)
    assert stats.requantized == {"F16": 7 * 2 + 1}  # every layer matrix, and the embedding (to Q8_0)
    assert 0.05 < stats.relative_error("Q4_0") < 0.2  # Q4_0 of Gaussian weights: about a tenth of their RMS
    assert 0.001 < stats.relative_error("Q8_0") < 0.02
    assert "requantized 15 F16 tensor(s)" in stats.describe()
    native = ConversionStats()
    convert_gguf(write_tiny_gguf(tmp_path / "q4.gguf", "llama"), tmp_path / "out2.gguf", stats=native)
    assert native.requantized == {} and native.relative_error() == 0.0
