"""CPU backend: the forward contract, batch invariance, chunking, errors."""

from __future__ import annotations

import numpy as np
import pytest

from weaved.backends.base import Logits, SeqChunk
from weaved.backends.cpu import CPUBackend


@pytest.fixture(scope="module")
def backend(smollm2_q4_0):
    return CPUBackend.from_file(smollm2_q4_0, threads=2)


PROMPTS = [
    [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 2060],
    [1, 19556, 905, 30, 1073, 253],
    [1, 1812, 2116, 3458, 17, 23, 4563, 7, 1241, 982, 7543, 21, 339],
]


def _prefill(be, tokens, logits=Logits.LAST):
    kv = be.new_kv(64)
    out = be.forward([SeqChunk(kv, np.array(tokens, np.int32), logits)])[0]
    return kv, out


def test_shapes_and_kv_length(backend):
    kv = backend.new_kv(32)
    chunks = [SeqChunk(kv, np.array(PROMPTS[0], np.int32), Logits.ALL)]
    (out,) = backend.forward(chunks)
    assert out.shape == (len(PROMPTS[0]), backend.config.vocab_size) and out.dtype == np.float32
    assert kv.length == len(PROMPTS[0])
    assert np.isfinite(out).all()
    kv2 = backend.new_kv(32)
    (none,) = backend.forward([SeqChunk(kv2, np.array(PROMPTS[1], np.int32), Logits.NONE)])
    assert none.shape == (0, backend.config.vocab_size)


def test_prefill_batch_invariance(backend):
    """A sequence's logits are bit-identical alone and inside a ragged batch, in any order."""
    alone = [_prefill(backend, p, Logits.ALL)[1] for p in PROMPTS]
    kvs = [backend.new_kv(64) for _ in PROMPTS]
    order = [2, 0, 1]
    outs = backend.forward([SeqChunk(kvs[i], np.array(PROMPTS[i], np.int32), Logits.ALL) for i in order])
    for j, i in enumerate(order):
        assert np.array_equal(outs[j], alone[i])
        ref_kv = _prefill(backend, PROMPTS[i])[0]
        assert np.array_equal(kvs[i].data[:, :, :, : kvs[i].length], ref_kv.data[:, :, :, : ref_kv.length])


def test_decode_batch_invariance_and_chunking(backend):
    """Decode rows match alone vs batched (mixed with a prefill chunk) and match chunked prefill."""
    # sequence A alone: prefill then 3 decode steps
    kv_a, last = _prefill(backend, PROMPTS[0])
    alone = []
    tok = int(np.argmax(last[0]))
    for _ in range(3):
        (row,) = backend.forward([SeqChunk(kv_a, np.array([tok], np.int32))])
        alone.append(row)
        tok = int(np.argmax(row[0]))
    # A again, now every decode step shares the batch with other sequences' prefill/decode chunks
    kv_b, last_b = _prefill(backend, PROMPTS[0])
    assert np.array_equal(last_b, last)
    other = [backend.new_kv(64) for _ in range(2)]
    tok = int(np.argmax(last_b[0]))
    for step in range(3):
        chunks = [SeqChunk(other[0], np.array(PROMPTS[1][step * 2 : step * 2 + 2], np.int32))]
        chunks.append(SeqChunk(kv_b, np.array([tok], np.int32)))
        chunks.append(SeqChunk(other[1], np.array([PROMPTS[2][step]], np.int32)))
        row = backend.forward(chunks)[1]
        assert np.array_equal(row, alone[step])
        tok = int(np.argmax(row[0]))
    # prefill in chunks gives the same last logits as one prefill
    kv_c = backend.new_kv(64)
    p = np.array(PROMPTS[2], np.int32)
    backend.forward([SeqChunk(kv_c, p[:5], Logits.NONE)])
    (chunked,) = backend.forward([SeqChunk(kv_c, p[5:])])
    whole = _prefill(backend, PROMPTS[2])[1]
    assert np.array_equal(chunked, whole)


def test_capacity_and_bad_tokens(backend):
    kv = backend.new_kv(4)
    with pytest.raises(ValueError, match="KV cache full"):
        backend.forward([SeqChunk(kv, np.arange(1, 6, dtype=np.int32))])
    assert kv.length == 0
    with pytest.raises(ValueError, match="token id out of range"):
        backend.forward([SeqChunk(kv, np.array([backend.config.vocab_size], np.int32))])
    assert kv.length == 0


def test_stats_count_prefill_and_decode(backend):
    before = (backend.stats.prefill_tokens, backend.stats.decode_tokens)
    kv, _ = _prefill(backend, PROMPTS[1])
    backend.forward([SeqChunk(kv, np.array([5], np.int32))])
    assert backend.stats.prefill_tokens - before[0] == len(PROMPTS[1])
    assert backend.stats.decode_tokens - before[1] == 1


@pytest.mark.parametrize("model", ["tiny_gemma3", "tiny_llama3", "tiny_qwen2_yarn", "tiny_qwen3moe",
                                   "tiny_qwen3moe_wide", "tiny_mixtral"])
def test_new_architectures_are_batch_invariant(model, request):
    """Windowed layers (gemma3, window 24, prompts past it), rope factors, YaRN and mixtures of experts
    (a step's tokens routed to shared and to disjoint experts): a sequence's logits and KV are
    bit-identical alone, in a ragged batch, and prefilled one chunk or token at a time."""
    be = CPUBackend.from_file(request.getfixturevalue(model), threads=2)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 40000, n).astype(np.int32) for n in (40, 7, 31)]
    alone = []
    for p in prompts:
        kv = be.new_kv(64)
        alone.append((be.forward([SeqChunk(kv, p, Logits.ALL)])[0], kv))
    kvs = [be.new_kv(64) for _ in prompts]
    outs = be.forward([SeqChunk(kvs[i], prompts[i], Logits.ALL) for i in (2, 0, 1)])
    for j, i in enumerate((2, 0, 1)):
        assert np.array_equal(outs[j], alone[i][0])
        assert np.array_equal(kvs[i].data, alone[i][1].data)
    kv = be.new_kv(64)  # the first prompt a token at a time: the same rows
    steps = np.concatenate([be.forward([SeqChunk(kv, prompts[0][t:t + 1], Logits.ALL)])[0] for t in range(40)])
    assert np.array_equal(steps, alone[0][0])
