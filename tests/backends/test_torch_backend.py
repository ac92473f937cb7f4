"""Torch backend on torch's CPU device: the forward contract, batch invariance (across batches and
across chunkings), the CPU backend's numbers, paged device KV (adopt / release / write-through / growth),
errors, and the accuracy bars (slow)."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

from tests.oracles import (
    GREEDY_PROMPTS,
    NATURAL_TEXT_PATH,
    check_against_truth_and_llama,
    check_greedy_near_ties,
    mean_kl,
)
from tests.tiny_models import write_tiny_gguf
from weaved.backends import torch_transfer
from weaved.backends.base import Logits, SeqChunk
from weaved.backends.cpu import CPUBackend
from weaved.backends.torch import TorchBackend
from weaved.backends.torch_paged import BLOCK
from weaved.kv.cache import KVCache
from weaved.model.tokenizer import Tokenizer

PROMPTS = [
    [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 2060],
    [1, 19556, 905, 30, 1073, 253],
    [1, 1812, 2116, 3458, 17, 23, 4563, 7, 1241, 982, 7543, 21, 339],
]


@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    """The backends here take one torch thread (a second one mostly waits at OpenMP barriers when
    the cores are shared); give the process its setting back afterwards."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def backend(smollm2_q4_0):
    return TorchBackend.from_file(smollm2_q4_0, device="cpu", threads=1)


@pytest.fixture(scope="module")
def cpu(smollm2_q4_0):
    return CPUBackend.from_file(smollm2_q4_0, threads=2)


def _run(be, kv, tokens, logits=Logits.LAST):
    return be.forward([SeqChunk(kv, np.array(tokens, np.int32), logits)])[0]


def _prefill(be, tokens, logits=Logits.LAST, capacity=64):
    kv = be.new_kv(capacity)
    return kv, _run(be, kv, tokens, logits)


def _copy(kv: KVCache) -> KVCache:
    return KVCache(kv.data.copy(), kv.length)


def test_name_and_weights_in_file_encoding(backend, smollm2_q4_0):
    assert backend.name == "torch" and backend.device == torch.device("cpu")
    assert not backend.host_parallel  # its engine thread starts no team of kernel threads for sampling
    layer = backend.weights.layers[0]
    (wqkv,) = layer.wqkv  # q|k|v fused: one Q4_0 matrix of raw 18-byte blocks
    cfg = backend.config
    assert wqkv.data.dtype == torch.uint8 and wqkv.data.shape == (cfg.q_dim + 2 * cfg.kv_dim, cfg.d_model // 32, 18)
    assert backend.weights.output is backend.weights.embedding  # tied: one copy
    raw = backend.gguf.tensors["blk.0.attn_q.weight"].raw
    assert np.array_equal(wqkv.data[:cfg.q_dim].numpy().reshape(cfg.q_dim, -1), raw)


def test_shapes_and_kv_length(backend):
    kv = backend.new_kv(32)
    (out,) = backend.forward([SeqChunk(kv, np.array(PROMPTS[0], np.int32), Logits.ALL)])
    assert out.shape == (len(PROMPTS[0]), backend.config.vocab_size) and out.dtype == np.float32
    assert kv.length == len(PROMPTS[0]) and np.isfinite(out).all()
    (none,) = backend.forward([SeqChunk(backend.new_kv(32), np.array(PROMPTS[1], np.int32), Logits.NONE)])
    assert none.shape == (0, backend.config.vocab_size)
    assert backend.forward([]) == []


def test_prefill_batch_invariance(backend):
    """A sequence's logits and KV are bit-identical alone and inside a ragged batch, in any order."""
    alone = [_prefill(backend, p, Logits.ALL) for p in PROMPTS]
    kvs = [backend.new_kv(64) for _ in PROMPTS]
    order = [2, 0, 1]
    outs = backend.forward([SeqChunk(kvs[i], np.array(PROMPTS[i], np.int32), Logits.ALL) for i in order])
    for j, i in enumerate(order):
        assert np.array_equal(outs[j], alone[i][1])
        n = len(PROMPTS[i])
        assert np.array_equal(kvs[i].data[:, :, :, :n], alone[i][0].data[:, :, :, :n])


def test_one_chunk_equals_one_token_per_step(backend):
    """Logits.ALL over n tokens gives, row for row, the bits of n single-token steps (what
    speculative decoding's verification relies on), and so does any split into chunks."""
    tokens = PROMPTS[2]
    _, whole = _prefill(backend, tokens, Logits.ALL)
    kv = backend.new_kv(64)
    steps = np.concatenate([_run(backend, kv, [t]) for t in tokens])
    assert np.array_equal(steps, whole)
    kv = backend.new_kv(64)
    parts = [_run(backend, kv, tokens[a:b], Logits.ALL) for a, b in ((0, 4), (4, 5), (5, 13))]
    assert np.array_equal(np.concatenate(parts), whole)


def test_decode_batch_invariance(backend):
    """Decode rows match alone vs batched with other sequences' prefill and decode chunks."""
    kv_a, last = _prefill(backend, PROMPTS[0])
    alone, tok = [], int(np.argmax(last[0]))
    for _ in range(3):
        row = _run(backend, kv_a, [tok])
        alone.append(row)
        tok = int(np.argmax(row[0]))
    kv_b, _ = _prefill(backend, PROMPTS[0])
    other = [backend.new_kv(64) for _ in range(2)]
    tok = int(np.argmax(last[0]))
    for step in range(3):
        row = backend.forward([
            SeqChunk(other[0], np.array(PROMPTS[1][step * 2:step * 2 + 2], np.int32)),
            SeqChunk(kv_b, np.array([tok], np.int32)),
            SeqChunk(other[1], np.array([PROMPTS[2][step]], np.int32), Logits.ALL),
        ])[1]
        assert np.array_equal(row, alone[step])
        tok = int(np.argmax(row[0]))


def test_same_numbers_as_the_cpu_backend(backend, cpu, smollm2_q4_0):
    """Same recipe, same bits: teacher-forced text and a ragged batch with decode steps give the CPU
    backend's logits and KV bytes (the contract's bar is mean KL <= 0.0005)."""
    tokens = Tokenizer(smollm2_q4_0, cpu.gguf).encode(NATURAL_TEXT_PATH.read_text())[:64]
    kv_t, ours = _prefill(backend, tokens, Logits.ALL, capacity=80)
    kv_c, theirs = _prefill(cpu, tokens, Logits.ALL, capacity=80)
    assert mean_kl(theirs, ours) <= 0.0005
    assert np.array_equal(ours, theirs)
    assert np.array_equal(kv_t.data, kv_c.data)

    def ragged(be):
        kvs = [be.new_kv(64) for _ in PROMPTS]
        out = be.forward([SeqChunk(kv, np.array(p, np.int32), Logits.ALL) for kv, p in zip(kvs, PROMPTS, strict=True)])
        for step in range(2):
            out += be.forward([SeqChunk(kv, np.array([7 + step + i], np.int32)) for i, kv in enumerate(kvs)])
        return out, kvs

    (ours, kvs_t), (theirs, kvs_c) = ragged(backend), ragged(cpu)
    for a, b in zip(ours, theirs, strict=True):
        assert mean_kl(b, a) <= 0.0005 and np.array_equal(a, b)
    for a, b in zip(kvs_t, kvs_c, strict=True):
        assert np.array_equal(a.data, b.data)


def test_errors_before_anything_is_written(backend):
    kv = backend.new_kv(4)
    before = backend.device_kv_bytes()
    with pytest.raises(ValueError, match="KV cache full"):
        backend.forward([SeqChunk(kv, np.arange(1, 6, dtype=np.int32))])
    with pytest.raises(ValueError, match="token id out of range"):
        backend.forward([SeqChunk(kv, np.array([backend.config.vocab_size], np.int32))])
    good = backend.new_kv(8)
    with pytest.raises(ValueError, match="token id out of range"):  # one bad chunk stops the whole step
        backend.forward([SeqChunk(good, np.array([5, 6], np.int32)), SeqChunk(kv, np.array([-1], np.int32))])
    with pytest.raises(ValueError, match="at least one token"):
        backend.forward([SeqChunk(kv, np.array([], np.int32))])
    assert kv.length == 0 and good.length == 0
    assert not good.data.any() and backend.device_kv_bytes() == before


def test_stats_count_tokens_and_copies(backend):
    st = backend.stats
    before = (st.prefill_tokens, st.decode_tokens, st.steps, st.extra["d2h_bytes"])
    kv, _ = _prefill(backend, PROMPTS[1])
    _run(backend, kv, [5])
    assert st.prefill_tokens - before[0] == len(PROMPTS[1]) and st.decode_tokens - before[1] == 1
    assert st.steps - before[2] == 2 and st.seconds > 0
    kv_row = backend.config.kv_bytes_per_token
    logits_row = 4 * backend.config.vocab_size
    assert st.extra["d2h_bytes"] - before[3] == (len(PROMPTS[1]) + 1) * kv_row + 2 * logits_row


def test_write_through_and_device_blocks(backend):
    kv, _ = _prefill(backend, PROMPTS[0], capacity=2000)
    _run(backend, kv, [42])
    n = kv.length
    paged = backend._kv
    table = paged.table(kv)
    assert len(table.blocks) == -(-n // BLOCK)  # idle capacity costs no device memory
    rows = paged.pool[:, paged.ids(table)].permute(0, 2, 3, 1, 4, 5).reshape(*kv.data.shape[:3], -1, kv.data.shape[4])
    assert rows.dtype == torch.float16
    assert np.array_equal(rows[:, :, :, :n].numpy(), kv.data[:, :, :, :n])  # same bytes, same layout
    assert not kv.data[:, :, :, n:].any()
    assert backend.device_kv_bytes() >= len(table.blocks) * BLOCK * backend.config.kv_bytes_per_token


def test_a_graph_that_cannot_be_made_turns_the_graphs_off_not_the_step(smollm2_q4_0, caplog):
    """Making a decode graph fails (a capture the driver refused): the step runs kernel by kernel with
    the same numbers, later steps too, and the log says why."""
    from weaved.backends.torch_graphs import DecodeGraphs, GraphUnavailable

    class Refusing:
        takes = staticmethod(DecodeGraphs.takes)  # decode steps: not the prompt

        def run(self, *args):
            raise GraphUnavailable("making the decode graph for 1 rows and 1 chunks of keys failed: capture refused")

    be, ref = TorchBackend.from_file(smollm2_q4_0, threads=1), TorchBackend.from_file(smollm2_q4_0, threads=1)
    be.graphs = Refusing()
    kvs = [_prefill(b, PROMPTS[0])[0] for b in (be, ref)]
    assert be.graphs is not None  # the prompt ran without asking for a graph
    with caplog.at_level("WARNING", logger="weave.backend"):
        got, want = (_run(b, kv, [PROMPTS[1][0]]) for b, kv in zip((be, ref), kvs, strict=True))
    assert np.array_equal(got, want) and be.graphs is None
    assert "decode graphs turned off" in caplog.text and "capture refused" in caplog.text
    assert kvs[0].length == kvs[1].length and np.array_equal(kvs[0].data, kvs[1].data)


@pytest.mark.parametrize("stage_bytes", [None, 1], ids=["one-chunk", "a-layer-a-chunk"])
def test_promotion_copies_whole_blocks_and_partial_ones_to_their_slots(backend, stage_bytes, monkeypatch):
    """Rows copied in from the host land in the table's blocks at their offsets: from position 0 (whole
    blocks as runs, then a partial one) and from inside a block (the host went on without the device);
    sent all at once or a layer at a time."""
    if stage_bytes is not None:
        monkeypatch.setattr(torch_transfer, "STAGE_BYTES", stage_bytes)
    cfg = backend.config
    rng = np.random.default_rng(7)
    n = 3 * BLOCK + 5
    data = rng.standard_normal((cfg.n_layers, 2, cfg.n_kv_heads, n + BLOCK, cfg.head_dim)).astype(np.float16)
    kv = KVCache(data, n)
    paged = backend.kv_pool

    def device_rows():
        table = paged.table(kv)
        rows = paged.pool[:, paged.ids(table)].permute(0, 2, 3, 1, 4, 5)
        return rows.reshape(*kv.data.shape[:3], -1, kv.data.shape[4])[:, :, :, :kv.length].numpy()

    assert backend.adopt(kv) == n * cfg.kv_bytes_per_token
    assert np.array_equal(device_rows(), data[:, :, :, :n])
    kv.length = n + BLOCK - 2  # the host went on from inside the last block, across the next
    backend.prepare(kv, 1)
    assert np.array_equal(device_rows(), data[:, :, :, :kv.length])
    backend.release(kv)


def test_adopt_release_and_migration(backend, cpu):
    """A session prefilled on the CPU backend moves to the torch backend with one copy and goes on
    with the numbers it would have had on the CPU; release drops the device copy."""
    kv, last = _prefill(cpu, PROMPTS[2])
    stay = _copy(kv)
    h2d = backend.stats.extra["h2d_bytes"]
    assert backend.adopt(kv) == kv.nbytes_used > 0
    assert backend.adopt(kv) == 0  # already adopted
    assert backend.stats.extra["h2d_bytes"] - h2d == kv.nbytes_used
    held = backend.device_kv_bytes()
    tok = int(np.argmax(last[0]))
    for _ in range(2):
        row_t, row_c = _run(backend, kv, [tok]), _run(cpu, stay, [tok])
        assert np.array_equal(row_t, row_c)
        tok = int(np.argmax(row_t[0]))
    assert np.array_equal(kv.data, stay.data)  # written through to the host array
    assert backend.release(kv) == 0 and backend.release(kv) == 0
    assert backend.device_kv_bytes() < held
    row_t, row_c = _run(backend, kv, [tok]), _run(cpu, stay, [tok])  # forward adopts again
    assert np.array_equal(row_t, row_c)
    held = backend.device_kv_bytes()
    del kv, row_t
    gc.collect()
    assert backend.device_kv_bytes() < held  # a dropped cache drops its mirror


def test_a_release_from_another_thread_waits_for_a_prepare_under_way(backend, cpu, monkeypatch):
    """A delete frees a session's device copy from an API thread while the engine thread prepares its
    next step: the release waits for the prepare, which neither fails nor leaves blocks behind."""
    kv, _ = _prefill(cpu, PROMPTS[2])
    pk = backend._kv
    real_adopt = pk.adopt
    released = threading.Event()

    def adopt_then_race(c):
        n = real_adopt(c)
        t = threading.Thread(target=lambda: (backend.release(c), released.set()))
        t.start()
        t.join(0.2)  # the release runs now, or waits for the prepare's lock
        return n

    monkeypatch.setattr(pk, "adopt", adopt_then_race)
    held = backend.device_kv_bytes()
    backend.prepare(kv, kv.length + 1)  # adopts (a session with history moving here), then takes a block
    assert released.wait(5)
    assert kv not in pk and backend.device_kv_bytes() == held


def test_host_progress_and_truncation_are_followed(backend, cpu):
    """Rows the host gained elsewhere are copied in before use; a truncated cache (rejected draft
    tokens) is overwritten from its new length."""
    kv, last = _prefill(backend, PROMPTS[0])
    ref = _copy(kv)
    for t in (11, 12):  # the CPU backend goes on without a release
        _run(cpu, kv, [t])
        _run(cpu, ref, [t])
    assert np.array_equal(_run(backend, kv, [13]), _run(cpu, ref, [13]))

    kv, _ = _prefill(backend, PROMPTS[1])
    draft = _run(backend, kv, [501, 502, 503], Logits.ALL)
    kv.truncate(len(PROMPTS[1]) + 1)  # keep the first draft token, reject two
    got = _run(backend, kv, [600, 601], Logits.ALL)
    _, fresh = _prefill(backend, PROMPTS[1] + [501, 600, 601], Logits.ALL)
    assert np.array_equal(draft[:1], fresh[-3:-2]) and np.array_equal(got, fresh[-2:])


def test_blocks_grow_without_changing_results(tiny_llama):
    be = TorchBackend.from_file(tiny_llama, threads=1)
    tokens = list(range(100, 200))
    _, whole = _prefill(be, tokens, Logits.ALL, capacity=128)
    kv = be.new_kv(128)
    rows, sizes = [], []
    for a in range(0, 100, 7):
        rows.append(_run(be, kv, tokens[a:a + 7], Logits.ALL))
        sizes.append(len(be._kv.table(kv).blocks))
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == -(-100 // BLOCK)
    assert np.array_equal(np.concatenate(rows), whole)


def test_a_full_pool_fails_the_step_before_anything_is_written(tiny_llama):
    from weaved.backends.torch_paged import DeviceKVFull

    be = TorchBackend.from_file(tiny_llama, threads=1, kv_bytes=3 * BLOCK * _row_bytes(tiny_llama))
    a, _ = _prefill(be, list(range(10, 10 + 2 * BLOCK)), capacity=4 * BLOCK)  # two of the three blocks
    b = be.new_kv(4 * BLOCK)
    with pytest.raises(DeviceKVFull, match="device KV full") as e:
        be.prepare(b, 2 * BLOCK)  # the engine's check before a step: two blocks wanted, one free
    assert e.value.http_status == 503 and b.length == 0 and not b.data.any()
    with pytest.raises(DeviceKVFull):
        _run(be, b, list(range(20, 20 + 2 * BLOCK)))
    assert b.length == 0 and not b.data.any()
    be.release(a)  # demotion frees the blocks
    _run(be, b, list(range(20, 20 + 2 * BLOCK)))
    assert b.length == 2 * BLOCK and be.device_kv_bytes() == 2 * BLOCK * be.config.kv_bytes_per_token


def _row_bytes(path) -> int:
    from weaved.model.loader import open_model

    return open_model(path)[1].kv_bytes_per_token


@pytest.fixture(scope="module")
def tiny_untied_f16(tmp_path_factory):
    from gguf import GGMLQuantizationType as Q

    path = tmp_path_factory.mktemp("tiny") / "f16.gguf"
    return write_tiny_gguf(path, "llama", wtype=Q.F16, embd_type=Q.F32, tied=False, output_norm_scale=4.0)


def _both_backends_agree(path, steps) -> None:
    """``steps(backend)`` -> (logits list, kv caches) on the torch and the CPU backend: the same bits."""
    (ours, kvs_t), (theirs, kvs_c) = (steps(be) for be in (TorchBackend.from_file(path, threads=1),
                                                            CPUBackend.from_file(path, threads=2)))
    for a, b in zip(ours, theirs, strict=True):
        assert np.array_equal(a, b)
    for a, b in zip(kvs_t, kvs_c, strict=True):
        assert np.array_equal(a.data, b.data)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_untied_f16", "tiny_llama3",
                                   "tiny_qwen2_yarn", "tiny_gemma3", "tiny_qwen3moe", "tiny_qwen3moe_wide",
                                   "tiny_mixtral"])
def test_architectures_match_the_cpu_backend(model, request):
    """llama, qwen2 (qkv biases), qwen3 (q/k norms, head_dim != d_model / n_heads), F16 layers with a
    separate F32 output, rope factors, YaRN, gemma3, mixtures of experts (the same experts picked, the
    same products): the CPU backend's logits and KV, in a ragged batch with decode steps."""
    def steps(be):
        kvs = [be.new_kv(32) for _ in PROMPTS]
        out = be.forward([SeqChunk(kv, np.array(p, np.int32), Logits.ALL) for kv, p in zip(kvs, PROMPTS, strict=True)])
        out += be.forward([SeqChunk(kv, np.array([9 + i], np.int32)) for i, kv in enumerate(kvs)])
        return out, kvs

    _both_backends_agree(request.getfixturevalue(model), steps)


def test_sliding_windows_match_the_cpu_backend(tiny_gemma3):
    """gemma3's windowed layers (window 24) past the window: prompts longer than it in one chunk, a
    prefill split mid-window, then decode steps - the CPU backend's logits and KV."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 40000, n).tolist() for n in (30, 57, 9)]

    def steps(be):
        kvs = [be.new_kv(96) for _ in prompts]
        out = be.forward([SeqChunk(kv, np.array(p[:20], np.int32), Logits.ALL)
                          for kv, p in zip(kvs, prompts, strict=True)])
        out += be.forward([SeqChunk(kv, np.array(p[20:] or [5], np.int32), Logits.ALL)
                           for kv, p in zip(kvs, prompts, strict=True)])
        for i in range(3):
            out += be.forward([SeqChunk(kv, np.array([100 + i], np.int32)) for kv in kvs])
        return out, kvs

    _both_backends_agree(tiny_gemma3, steps)


# ---- accuracy bars (docs/architecture.md, "Correctness"), as the CPU backend's in test_accuracy.py -----
@pytest.mark.llama
@pytest.mark.slow
def test_smollm2_close_to_truth_and_llama(smollm2_q4_0):
    check_against_truth_and_llama(TorchBackend.from_file(smollm2_q4_0, threads=1), smollm2_q4_0, 256)


@pytest.mark.llama
@pytest.mark.slow
def test_smollm2_greedy_leaves_llama_only_at_near_ties(smollm2_q4_0):
    # three of the prompts: the torch path's bits are the CPU backend's (above), whose test takes all five
    check_greedy_near_ties(TorchBackend.from_file(smollm2_q4_0, threads=1), smollm2_q4_0, GREEDY_PROMPTS[:3], 64)


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3", "qwen2_yarn", "gemma3"])
def test_synthetic_architectures_close_to_truth_and_llama(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}")
    check_against_truth_and_llama(TorchBackend.from_file(path, threads=1), path, 362)
    check_greedy_near_ties(TorchBackend.from_file(path, threads=1), path, GREEDY_PROMPTS[:3], 32)
