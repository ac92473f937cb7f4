"""Decode graphs' buffers (``backends/torch_graphs``) through Triton's interpreter: the padded, bucketed
steps give the plain Triton path's bits.  Run by ``test_triton_interp`` with TRITON_INTERPRET=1."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.triton_interp_shim import require_interpreter

require_interpreter()


@pytest.mark.parametrize("model, lengths", [("tiny_llama", (520, 30, 5)), ("tiny_gemma3", (40, 30, 5)),
                                            ("tiny_qwen3moe", (40, 30, 5))])
def test_decode_graphs_give_the_plain_steps_bits(model, lengths, request, monkeypatch):
    """Decode steps through the graphs' buffers (``torch_graphs``, run without capture here): rows padded
    to a bucket on the scratch block, the attention grid a power of two of chunks (one row past 512 keys;
    Gemma 3's windows of 24 keys) - the plain path's logits and K/V rows, bit for bit, at 1, 2 and 3
    sequences; on a mixture of experts, padding rows routed beside the real ones.  The plain path here
    is torch's ops, whose bits the plain Triton path gives (``test_torch_backend_on_the_triton_path``):
    the interpreter runs only the graphed side, half the time."""
    from weaved.backends.base import Logits, SeqChunk
    from weaved.backends.torch import TorchBackend
    from weaved.backends.torch_graphs import bucket_chunks, bucket_rows
    from weaved.kv.cache import KVCache

    path = request.getfixturevalue(model)
    ref = TorchBackend.from_file(path, threads=1)  # the torch path prefills (the same bits, faster here)
    tokens = (np.arange(600, dtype=np.int32) * 37 + 5) % 400
    prompts = []
    for n in lengths:
        kv = ref.new_kv(n + 8)
        ref.forward([SeqChunk(kv, tokens[:n], Logits.NONE)])
        prompts.append(kv)
    plain = ref
    monkeypatch.setenv("WEAVE_TORCH_KERNELS", "triton")
    graphed = TorchBackend.from_file(path, threads=1)  # None: not on a CPU device
    assert (plain.kernels, plain.graphs, graphed.graphs) == ("torch", None, None)
    graphed = TorchBackend.from_file(path, threads=1, graphs=True)
    assert not graphed.graphs.capture
    # the output head runs after the graphs, outside them: torch's ops on both sides here (in the
    # interpreter its 49,152-column product was three quarters of this test's time)
    monkeypatch.setattr(graphed, "_head", plain._head)
    kvs = {be: [KVCache(kv.data.copy(), kv.length) for kv in prompts] for be in (plain, graphed)}
    for step, seqs in enumerate(([2], [1, 2], [0, 1, 2])):
        toks = [np.asarray([(step * 11 + s * 7) % 400], np.int32) for s in seqs]
        want, got = ([be.forward([SeqChunk(kvs[be][s], t, Logits.LAST) for s, t in zip(seqs, toks, strict=True)])
                      for be in (plain, graphed)])
        assert all(np.array_equal(w, g) for w, g in zip(want, got, strict=True)), (model, step)
    assert graphed.graphs.replays == 3 and graphed.graphs.made == 3
    c = graphed.graphs.counters()
    assert (c["made"], c["replays"], c["held"]) == (3, 3, 1 if lengths[0] > 512 else 3) and c["seconds"] >= 0
    if lengths[0] > 512:  # (1, 1), (2, 1), then (4, 2), whose 1,024 positions grew the RoPE tables: the
        # first two were dropped
        assert [(g.rows, g.chunks) for g in graphed.graphs.graphs()] == [(4, 2)]
    assert (bucket_rows(3), bucket_chunks(520), bucket_chunks(511), bucket_chunks(1600)) == (4, 2, 1, 4)
    for a, b in zip(kvs[plain], kvs[graphed], strict=True):  # the rows written through to the host
        assert a.length == b.length and np.array_equal(a.data[:, :, :, :a.length], b.data[:, :, :, :b.length])
    scratch = graphed.kv_pool.scratch_block()
    assert all(scratch not in graphed.kv_pool.table(kv).blocks for kv in kvs[graphed])
    # a prefill chunk, or logits for every row, is not a decode step: the plain path runs it
    assert not graphed.graphs.takes([SeqChunk(kvs[graphed][2], tokens[:2], Logits.LAST)])
    assert not graphed.graphs.takes([SeqChunk(kvs[graphed][2], tokens[:1], Logits.ALL)])


def test_decode_graphs_are_refused_where_a_step_waits_on_the_host(tiny_qwen3moe, monkeypatch):
    from weaved.backends.torch import TorchBackend

    monkeypatch.setenv("WEAVE_TORCH_KERNELS", "torch")  # torch's ops: experts grouped on the host
    with pytest.raises(ValueError, match="Triton kernels"):
        TorchBackend.from_file(tiny_qwen3moe, threads=1, graphs=True)
    monkeypatch.setenv("WEAVE_TORCH_KERNELS", "triton")
    monkeypatch.setenv("WEAVE_DECODE_GRAPHS", "yes")
    with pytest.raises(ValueError, match="WEAVE_DECODE_GRAPHS"):
        TorchBackend.from_file(tiny_qwen3moe, threads=1)
