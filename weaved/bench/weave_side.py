"""The Weave side of ``weave bench``: the CPU backend called directly, no engine or daemon.

Besides the shared measurements it reports ``load_s`` (from opening the file to the end of a first
one-token forward, i.e. weights repacked and kernels compiled or loaded from numba's cache: ready to
serve) and ``rss_mb`` (resident memory right after that).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from weaved.bench import BenchConfig
from weaved.bench.harness import Progress, measure, memory_after_load, resident_mb


class WeaveEngine:
    """``harness.Engine`` over ``CPUBackend``: one ``KVCache`` per sequence, one forward per call."""

    def __init__(self, backend):
        from weaved.backends.base import Logits, SeqChunk

        self.be = backend
        self._Logits, self._SeqChunk = Logits, SeqChunk
        self.kvs: list = []

    def open(self, n_seqs: int, capacity: int) -> None:
        self.kvs = [self.be.new_kv(capacity) for _ in range(n_seqs)]

    def prefill(self, seqs: Sequence[int], prompts: Sequence[Sequence[int]], want_logits: bool) -> list[int]:
        mode = self._Logits.LAST if want_logits else self._Logits.NONE
        chunks = [
            self._SeqChunk(self.kvs[s], np.asarray(p, dtype=np.int32), mode)
            for s, p in zip(seqs, prompts, strict=True)
        ]
        out = self.be.forward(chunks)  # one [1, vocab] (or [0, vocab]) f32 per chunk
        return [int(np.argmax(o[-1])) for o in out] if want_logits else []

    def step(self, tokens: Sequence[int]) -> list[int]:
        chunks = [
            self._SeqChunk(kv, np.asarray([t], dtype=np.int32), self._Logits.LAST)
            for kv, t in zip(self.kvs, tokens, strict=True)
        ]
        return [int(np.argmax(o[0])) for o in self.be.forward(chunks)]

    def truncate(self, seq: int, length: int) -> None:
        self.kvs[seq].truncate(length)


def load_backend(cfg: BenchConfig):
    """The CPU backend for ``cfg``, warmed by one forward; returns (backend, load seconds)."""
    from weaved.backends.base import Logits, SeqChunk
    from weaved.backends.cpu import CPUBackend

    t0 = time.perf_counter()
    be = CPUBackend.from_file(cfg.model, threads=cfg.threads)
    kv = be.new_kv(1)
    be.forward([SeqChunk(kv, np.zeros(1, dtype=np.int32), Logits.LAST)])
    return be, time.perf_counter() - t0


def measure_weave(cfg: BenchConfig, tokens: Sequence[int], progress: Progress) -> dict[str, float]:
    """Every selected measurement on Weave's CPU backend, and its informational figures (``INFO_KEYS``):
    load time, file size, resident memory after loading and after the measurements (the sequences'
    KV freed: in the daemon it lives in files), the weights a decode token reads, the rate
    single-stream decode reads them at and the rate this machine streams memory at."""
    import gc

    from weaved.bench.stream import stream_gbs

    progress("loading the model (repacking weights, compiling kernels)")
    be, load_s = load_backend(cfg)
    memory = memory_after_load()
    progress(f"ready in {load_s:.1f} s, {memory['rss_mb']:.0f} MB resident")
    engine = WeaveEngine(be)
    out = measure(engine, cfg, tokens, progress)
    engine.open(0, 1)
    gc.collect()
    info = {"load_s": load_s, "file_mb": cfg.model.stat().st_size / 2**20, **memory, "rss_end_mb": resident_mb(),
            "weights_mb": be.decode_bytes / 2**20}
    if "decode_tps" in out:
        info["decode_gbs"] = be.decode_bytes * out["decode_tps"] / 1e9
        progress("measuring the memory streaming rate")
        info["stream_gbs"] = stream_gbs(cfg.threads)
    return {**out, **info}
