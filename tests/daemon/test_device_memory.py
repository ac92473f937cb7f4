"""A GPU pool's device memory (the torch backend, on torch's CPU device here): the budget split into
weights, a step's workspace and the paged KV pool at start - refused with the numbers when it cannot
hold one context - and, when the KV pool runs out, idle sessions demoted off the device to make room."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.daemon.test_coexec import IA, coexec_profile, prompt_ids, start
from weaved.backends.device_memory import SLACK, DeviceMemoryError, workspace_bytes
from weaved.backends.torch_paged import BLOCK
from weaved.daemon.core import Daemon
from weaved.engine.sampling import SamplingParams
from weaved.model.loader import open_model

pytest.importorskip("torch")

SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def _profile(device_memory: int):
    prof = coexec_profile()
    gpu = dataclasses.replace(prof.pools[0], device_memory=device_memory)
    return dataclasses.replace(prof, pools=(gpu, *prof.pools[1:]))


def _budget_for(path, kv_bytes: int) -> int:
    """The device_memory that leaves ``kv_bytes`` for the KV pool (with the daemon's step and context)."""
    from weaved.backends.torch import TorchBackend

    _gguf, cfg = open_model(path)
    weights = TorchBackend.from_file(path, kv_bytes=BLOCK * cfg.kv_bytes_per_token).weights.nbytes
    gpu = _profile(1).pools[0]
    context = min(_profile(1).host.default_context, cfg.context_length)
    ws = workspace_bytes(cfg, gpu.token_budget, gpu.max_batch, context)
    return math.ceil((weights + ws + kv_bytes) / (1 - SLACK)) + 1


def _daemon(path, tmp_path, device_memory: int) -> Daemon:
    d = Daemon(_profile(device_memory), path, data_dir=tmp_path / "data", log_fn=lambda m: None)
    d.load()
    return d


def test_a_budget_that_cannot_hold_one_context_is_refused_at_start(tiny_llama, tmp_path):
    d = Daemon(_profile(200 * 1024), tiny_llama, data_dir=tmp_path, log_fn=lambda m: None)
    with pytest.raises(DeviceMemoryError, match=r"budget of 200\.00 KiB, but the model needs .* of weights "
                                                r"\+ .* for a step .* of KV for one 2048-token context"):
        d.load()
    d.shutdown()


def test_the_kv_pool_is_what_the_budget_leaves(tiny_llama, tmp_path):
    _gguf, cfg = open_model(tiny_llama)
    want = 3000 * cfg.kv_bytes_per_token
    d = _daemon(tiny_llama, tmp_path, _budget_for(tiny_llama, want))
    try:
        gpu = d.pools["gpu"].backend
        block = BLOCK * cfg.kv_bytes_per_token
        assert want - block < gpu.device_kv_capacity() <= want + block
        shown = next(p for p in d.status()["pools"] if p["name"] == "gpu")["device_memory"]
        assert shown["kv_bytes"] == gpu.device_plan.kv and shown["weights_bytes"] == gpu.weights.nbytes
        assert d.status()["kv"]["device_free_bytes"] == gpu.device_kv_capacity()
    finally:
        d.shutdown()


def test_shutdown_gives_the_device_memory_back(tiny_llama, tmp_path):
    """A process that runs daemons one after another (a benchmark's runs) finds the device as free at
    each start: the KV pool, the decode graphs' buffers and the sessions' tables go at shutdown."""
    d = _daemon(tiny_llama, tmp_path, _budget_for(tiny_llama, 3000 * open_model(tiny_llama)[1].kv_bytes_per_token))
    gpu = d.pools["gpu"].backend
    sid = d.create_session(IA)["id"]
    start(d, sid, prompt_ids(100), SHORT).finish()
    assert d.sessions[sid].pool == "gpu" and gpu.device_kv_bytes() > 0 and gpu.kv_pool.pool.numel() > 0
    d.shutdown()
    assert gpu.kv_pool.pool.numel() == 0
    assert gpu.device_kv_capacity() == 0 and gpu.device_kv_free_bytes() == 0


def test_a_full_device_demotes_idle_sessions_to_make_room(tiny_llama, tmp_path):
    _gguf, cfg = open_model(tiny_llama)
    d = _daemon(tiny_llama, tmp_path, _budget_for(tiny_llama, 2200 * cfg.kv_bytes_per_token))
    events: list[tuple[str, dict]] = []
    publish = d.events.publish
    d.events.publish = lambda kind, data: (events.append((kind, data)), publish(kind, data))
    try:
        sids = []
        for i in range(2):  # two interactive sessions on the GPU pool, 1,200 tokens each: the pool holds one
            sid = d.create_session(IA)["id"]
            start(d, sid, prompt_ids(1200, 20 + i), SHORT).finish()
            assert d.sessions[sid].pool == "gpu"  # the second counts the first's idle copy as room
            sids.append(sid)
        first, second = (d.sessions[s] for s in sids)
        demoted = [data for kind, data in events if kind == "demotion"]
        assert [e["session"] for e in demoted] == [first.id] and demoted[0]["reason"] == "device memory"
        assert first.kv_at is None and first.pool == "cpu" and second.kv_at == "gpu"
        moved = [data for kind, data in events if kind == "migration" and data["reason"] == "device memory"]
        assert moved and moved[0]["session"] == first.id and moved[0]["to"] == "file"
        # the demoted session goes on from its file on the CPU pool, nothing recomputed: it feeds its last
        # answer's final token (sampled, never fed) and the two new ones
        prefilled = d.pools["cpu"].backend.stats.prefill_tokens
        start(d, first.id, [5, 6], SHORT).finish()
        assert d.pools["cpu"].backend.stats.prefill_tokens - prefilled == 3
    finally:
        d.shutdown()


def test_the_workspace_holds_attentions_partials_not_whole_score_rows(tiny_llama):
    """A step of T rows over a long context needs its chunks' partial outputs (the Triton kernel's
    [T, H, n_chunks, D] and [T, H, n_chunks, 2] float32), far less than T x H x context scores."""
    from weaved.kernels.torch_attention import CHUNK

    _gguf, cfg = open_model(tiny_llama)
    T, context = 1024, 32768
    partials = T * cfg.n_heads * (context // CHUNK) * (cfg.head_dim + 2) * 4
    ws = workspace_bytes(cfg, T, 64, context)
    short = workspace_bytes(cfg, T, 64, CHUNK)
    assert ws - short >= partials - T * cfg.n_heads * (cfg.head_dim + 2) * 4  # grows with the chunks
    assert ws < T * cfg.n_heads * context * 4  # whole rows of scores would not fit beside it
