"""Decode steps replayed from CUDA graphs against the same steps launched kernel by kernel: two sets of
the same sequences fed the same tokens, one set's steps through the graphs and the other's without,
interleaved step by step (so a drift in the machine's clocks falls on both), every step's logits
compared bit for bit and each step timed on its own."""

from __future__ import annotations

import time

import numpy as np

from weaved.backends.base import Logits, SeqChunk
from weaved.gpucheck.speed import token_ids


def graphs_ab(be, batch: int, context: int, steps: int, seed: int = 4) -> dict:
    """``steps`` decode steps of ``batch`` sequences ``context`` tokens in, with the backend's decode
    graphs and without: {graphs_tok_s, eager_tok_s, speedup, equal, graphs_made, graphs_seconds}."""
    graphs = be.graphs
    if graphs is None:
        raise RuntimeError("this backend makes no decode graphs (the Triton path on CUDA, a dense model)")
    vocab = be.config.vocab_size
    prompts = [token_ids(context, vocab, seed + i) for i in range(batch)]
    fed = [token_ids(steps + 1, vocab, seed + batch + i) for i in range(batch)]  # the same tokens both ways
    sets = {mode: [be.new_kv(context + steps + 2) for _ in range(batch)] for mode in ("graphs", "eager")}
    seconds = {"graphs": 0.0, "eager": 0.0}
    equal = True
    try:
        be.graphs = None
        for kvs in sets.values():
            for kv, p in zip(kvs, prompts, strict=True):  # one at a time, as a pool's token budget feeds them
                be.forward([SeqChunk(kv, p, Logits.NONE)])
        for k in range(steps + 1):  # step 0 warms (makes the graph, compiles the kernels): not timed
            out = {}
            for mode, kvs in sets.items():
                be.graphs = graphs if mode == "graphs" else None
                t0 = time.perf_counter()
                out[mode] = be.forward([SeqChunk(kv, f[k:k + 1], Logits.LAST) for kv, f in zip(kvs, fed, strict=True)])
                if k:
                    seconds[mode] += time.perf_counter() - t0
            equal = equal and all(np.array_equal(a, b) for a, b in zip(out["graphs"], out["eager"], strict=True))
    finally:
        be.graphs = graphs
        for kvs in sets.values():
            for kv in kvs:
                be.release(kv)
    t_g, t_e = seconds["graphs"], seconds["eager"]
    return {"batch": batch, "context": context, "steps": steps, "graphs_tok_s": batch * steps / t_g,
            "eager_tok_s": batch * steps / t_e, "speedup": t_e / t_g, "equal": equal,
            "graphs_made": graphs.made, "graphs_seconds": graphs.seconds}
