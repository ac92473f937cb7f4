"""Shape files: a shape too large for its F16 file is quantized in-process, to the bytes llama.cpp's own
quantizer gives the F16 file - a mixture of experts' stacks and router included."""

from __future__ import annotations

import numpy as np
import pytest

from weaved.bench.shape_files import f16_bytes, llama_quantize_q4_0, write_f16, write_q4_0
from weaved.bench.shapes import SMOLLM2, ModelShape
from weaved.model.gguf_scan import scan_gguf, tensor_views

TINY_MOE = ModelShape("tiny-moe", "qwen3moe", 2, 128, 4, 2, 32, 256, 49152, 4096, 1e6, 1e-6, SMOLLM2, tied=False,
                      experts=(8, 2, 64))


@pytest.mark.llama
def test_the_in_process_q4_0_file_is_llama_cpps_quantization(tmp_path):
    write_f16(TINY_MOE, tmp_path / "f16.gguf", 2)
    llama_quantize_q4_0(tmp_path / "f16.gguf", tmp_path / "theirs.gguf", threads=1)
    said: list[str] = []
    write_q4_0(TINY_MOE, tmp_path / "ours.gguf", 2, progress=said.append)
    assert len(said) == 2 and "layer 1 of 2" in said[-1]
    ours, theirs = (scan_gguf(tmp_path / f) for f in ("ours.gguf", "theirs.gguf"))
    assert sorted(t.name for t in ours.tensors) == sorted(t.name for t in theirs.tensors)  # (its own order)
    ov, tv = tensor_views(tmp_path / "ours.gguf", ours), tensor_views(tmp_path / "theirs.gguf", theirs)
    types = {t.name: t.type.name for t in ours.tensors}
    for t in theirs.tensors:
        assert types[t.name] == t.type.name, t.name
        assert np.array_equal(np.asarray(ov[t.name]), np.asarray(tv[t.name])), t.name
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_0" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert ours.metadata["qwen3moe.expert_count"].value == 8


def test_sizes():
    assert TINY_MOE.params == 2 * (128 * (128 + 2 * 64) + 128 * 128 + 8 * 128 + 8 * 3 * 128 * 64) + 2 * 49152 * 128
    assert TINY_MOE.active_params == TINY_MOE.params - 2 * 6 * 3 * 128 * 64
    assert f16_bytes(TINY_MOE, 2) == 2 * TINY_MOE.params
