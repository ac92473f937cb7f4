"""A session's KV moving between the CPU and the torch backend: one copy of the same bytes, nothing
recomputed, and the destination's first logits from that state within KL 0.0005 of the source's."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from weaved.backends.base import Logits, SeqChunk
from weaved.backends.cpu import CPUBackend

torch_backend = pytest.importorskip("weaved.backends.torch")

MODELS = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3moe", "smollm2_q4_0"]


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p = np.exp(p_logits - p_logits.max())
    p /= p.sum()
    q = np.exp(q_logits - q_logits.max())
    q /= q.sum()
    return float(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30))))


def _digest(kv) -> str:
    return hashlib.sha256(np.ascontiguousarray(kv.data[:, :, :, : kv.length]).tobytes()).hexdigest()


def _step(be, kv, toks) -> np.ndarray:
    return be.forward([SeqChunk(kv, np.asarray(toks, np.int32), Logits.LAST)])[0][-1]


@pytest.fixture(params=MODELS)
def pair(request):
    path = request.getfixturevalue(request.param)
    return CPUBackend.from_file(path, threads=2), torch_backend.TorchBackend.from_file(path, device="cpu")


def test_cpu_to_torch_and_back_copies_bytes_once(pair):
    cpu, tb = pair
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 200, 40).tolist()
    kv = cpu.new_kv(128)
    first = _step(cpu, kv, prompt)
    tok = int(np.argmax(first))
    before = _digest(kv)
    length = kv.length

    # promotion: the torch backend adopts the file's rows with one host-to-device copy
    moved = tb.adopt(kv)
    assert moved == length * cpu.config.kv_bytes_per_token
    assert tb.adopt(kv) == 0  # idempotent
    assert tb.device_kv_bytes() >= moved
    twin = cpu.new_kv(128)  # the same state, continued on the CPU
    twin.data[...] = kv.data
    twin.length = kv.length
    on_torch = _step(tb, kv, [tok])
    on_cpu = _step(cpu, twin, [tok])
    assert _kl(on_cpu, on_torch) < 0.0005
    assert tb.stats.prefill_tokens == 0 and tb.stats.decode_tokens == 1  # nothing recomputed
    # the rows that travelled are untouched, and the new row was written through to the host array
    assert hashlib.sha256(np.ascontiguousarray(kv.data[:, :, :, :length]).tobytes()).hexdigest() == before
    assert kv.length == length + 1 and np.any(kv.data[:, :, :, length] != 0)

    # demotion: nothing to write back, the device copy is freed, the CPU continues from the host array
    assert tb.release(kv) == 0
    assert tb.device_kv_bytes() == 0
    tok2 = int(np.argmax(on_torch))
    after = _step(cpu, kv, [tok2])
    ref = _step(cpu, twin, [tok2])
    assert _kl(ref, after) < 0.0005


def test_torch_prefill_then_cpu_decode(pair):
    """A long prompt prefilled on the GPU pool and decoded on the CPU pool (the KV handed over through
    the file): from that state the CPU's first logits are within KL 0.0005 of the torch backend's."""
    cpu, tb = pair
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 200, 48).tolist()
    kv = cpu.new_kv(128)
    tok = int(np.argmax(_step(tb, kv, prompt)))
    twin = cpu.new_kv(128)  # what stays on the device: the torch backend's own continuation
    twin.data[...] = kv.data
    twin.length = kv.length
    tb.release(kv)
    assert tb.stats.prefill_tokens == len(prompt)
    assert _kl(_step(tb, twin, [tok]), _step(cpu, kv, [tok])) < 0.0005
    assert cpu.stats.prefill_tokens == 0  # the CPU recomputed nothing
