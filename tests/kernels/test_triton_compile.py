"""Every Triton kernel the torch backend launches, compiled for a GPU (sm_90) on a machine without one.

Triton's interpreter (``test_triton_interp``) checks what the kernels compute, but it accepts programs
the compiler refuses (an early ``return`` inside a compile-time branch of a recursive helper, say), so
a kernel can pass every interpreter test and fail on the first GPU.  Triton's wheel carries ``ptxas``:
with a stand-in driver that names the target, each launch here builds its kernel down to a cubin with
the real arguments' types and skips running it.  The backend's forward goes on with unwritten
outputs, which is fine for everything but the host logic that reads a result: the products' outputs
are allocated as zeros (with what a fresh buffer held, the logits' refinement found candidates in
some test orders and not in others), and a mixture of experts' grouping reads the router's choices,
so the router (compiled too) hands back the torch op's.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


class _Target:
    """The driver calls a compile-only launch makes: a device, a stream, and the target to build for."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


class _ZeroedOutputs:
    """torch, with ``empty`` allocating zeros (for one module's outputs in a compile-only run)."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def empty(self, *args, **kwargs):
        return self._torch.zeros(*args, **kwargs)


@pytest.fixture
def compile_only(monkeypatch):
    """Launches compile for sm_90 and return without running: {kernel name: [compiled kernels]}."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces the compiler")
    import torch
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    from weaved.kernels import triton_q4

    built: dict[str, list] = {}
    run = JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        built.setdefault(self.fn.__name__, []).append(run(self, *args, grid=grid, warmup=True, **kwargs))

    monkeypatch.setattr(JITFunction, "run", compile_launch)
    # the products' outputs start as zeros, not as whatever the allocator left there: the logits'
    # refinement then finds candidates (every logit) and launches its kernel in every run
    monkeypatch.setattr(triton_q4, "torch", _ZeroedOutputs(torch))
    before = driver._active  # None here: reset_active would look for a GPU driver, and there is none
    driver.set_active(_Target())
    try:
        yield built
    finally:
        driver._active = before


@pytest.mark.parametrize("model, kernels", [
    ("tiny_llama", {"_q_matmul", "_pair_dots", "_rmsnorm", "_rope_qkv", "_quantize", "_chunks", "_merge",
                    "_add_norm_quant", "_glu_quant"}),
    ("tiny_gemma3", {"_q_matmul", "_rmsnorm", "_rope_qkv", "_glu_quant", "_chunks", "_merge", "_add_norm_quant"}),
    ("tiny_qwen3moe", {"_route", "_grouped", "_q_matmul", "_rope_qkv", "_chunks", "_add_norm_quant", "_glu"}),
])
def test_every_kernel_of_a_step_compiles_for_a_gpu(compile_only, model, kernels, request, monkeypatch):
    from weaved.kernels import torch_moe, triton_router

    import weaved.backends.torch as backend_module
    from weaved.backends.base import Logits, SeqChunk
    from weaved.backends.torch import TorchBackend

    monkeypatch.setattr(backend_module, "kernel_path", lambda device: "triton")
    route = triton_router.route

    def compiled_router_torch_choices(h, w, k):
        route(h, w, k)  # compiled, not run
        return torch_moe.route(h, w, k)

    monkeypatch.setattr(triton_router, "route", compiled_router_torch_choices)
    be = TorchBackend.from_file(request.getfixturevalue(model), threads=1)
    assert be.kernels == "triton" and be._paged_kernel
    tokens = (np.arange(600, dtype=np.int32) * 37 + 5) % 400
    kv, long = be.new_kv(64), be.new_kv(600)
    be.forward([SeqChunk(kv, tokens[:30], Logits.LAST)])  # a prompt chunk: one chunk of keys a row
    be.forward([SeqChunk(long, tokens[:530], Logits.LAST)])  # past 512 keys: chunks merged
    be.forward([SeqChunk(kv, tokens[30:31], Logits.LAST), SeqChunk(be.new_kv(16), tokens[:12], Logits.ALL),
                SeqChunk(long, tokens[530:531], Logits.LAST)])
    assert kernels <= set(compile_only), sorted(set(compile_only))
    for name, ks in compile_only.items():
        assert all(k.asm.get("cubin") for k in ks), name  # built down to machine code by ptxas


def test_the_sweeps_prompt_tiles_compile_for_a_gpu(compile_only):
    """The tile sweep's configurations at a prompt chunk's rows (128-row programs, one block a chunk,
    deeper pipelining, the hardware's int-to-float converter) build down to machine code, so a lent
    GPU's sweep does not stop at a refused one."""
    import torch
    from weaved.kernels import quants, triton_q4
    from weaved.kernels import torch_q4 as tq

    from weaved.gpucheck.sweep import CONFIGS

    rng = np.random.default_rng(0)
    N, K = 96, 256
    raw = quants.quantize_q4_0(rng.standard_normal((N, K)).astype(np.float32))
    w = tq.DeviceWeight(tq.Q4_0, N, K, torch.from_numpy(raw).reshape(N, K // 32, tq.BLOCK_BYTES[tq.Q4_0]))
    a = tq.quantize_act(torch.zeros((512, K)))
    for cfg in CONFIGS[512]:
        triton_q4.linear_q(w, a, *cfg)
    triton_q4.linear_q(w, a, converter=True)  # the sweep's other way of making the sums floats
    built = compile_only["_q_matmul"]
    assert len(built) == len(CONFIGS[512]) + 1 and all(k.asm.get("cubin") for k in built)
    # by default a block's integer sums become floats by adds, not through the converter (exact_float)
    assert "cvt.rn.f32.s32" not in built[0].asm["ptx"] and "cvt.rn.f32.s32" in built[-1].asm["ptx"]
