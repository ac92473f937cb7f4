"""The compiled layer loop (``kernels.layer_loop``) gives the Python loop's bits, for every
architecture it takes, and models with matrices it does not take run the Python loop."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.tiny_models import write_tiny_gguf
from weaved.backends.base import Logits, SeqChunk
from weaved.backends.cpu import CPUBackend
from weaved.kv.cache import KVCache


def _steps(be: CPUBackend, fused: bool, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A ragged prefill (1..40 tokens per sequence), then three decode steps; logits and KV."""
    be.fused_layers = fused
    rng = np.random.default_rng(seed)
    V = be.config.vocab_size
    kvs = [be.new_kv(64) for _ in range(4)]
    out = be.forward([SeqChunk(kv, rng.integers(0, V, n).astype(np.int32), Logits.ALL)
                      for kv, n in zip(kvs, (1, 7, 40, 3), strict=True)])
    for _ in range(3):
        out += be.forward([SeqChunk(kv, rng.integers(0, V, 1).astype(np.int32), Logits.LAST) for kv in kvs])
    return out, [kv.data.copy() for kv in kvs]


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_llama3", "tiny_qwen2_yarn",
                                   "tiny_gemma3", "tiny_qwen3moe", "tiny_qwen3moe_wide", "tiny_mixtral"])
def test_compiled_loop_is_the_python_loop(model, request):
    be = CPUBackend.from_file(request.getfixturevalue(model), threads=2)
    assert be._loop is not None
    fused, kv_f = _steps(be, True, 0)
    plain, kv_p = _steps(be, False, 0)
    assert all(np.array_equal(a, b) for a, b in zip(fused, plain, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(kv_f, kv_p, strict=True))


def test_float_matrices_take_the_python_loop(tmp_path):
    path = write_tiny_gguf(tmp_path / "f16.gguf", "llama", wtype=Q.F16)
    be = CPUBackend.from_file(path, threads=2)
    assert be._loop is None
    out, _ = _steps(be, True, 1)
    assert all(np.isfinite(o).all() for o in out)


def test_kv_errors_surface_from_the_compiled_loop(tiny_llama):
    be = CPUBackend.from_file(tiny_llama, threads=1)
    c = be.config
    bad = KVCache(np.zeros((c.n_layers, 2, c.n_kv_heads + 1, 8, c.head_dim), np.float16))
    with pytest.raises(ValueError, match="kv array shape does not match"):
        be.forward([SeqChunk(bad, np.zeros(3, np.int32), Logits.LAST)])
