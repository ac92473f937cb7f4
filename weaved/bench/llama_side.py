"""The llama.cpp side of ``weave bench``: llama-cpp-python's low-level API on the CPU.

Contexts are created the way the team's baseline measures llama.cpp: ``n_batch = n_ubatch = 512``,
non-unified KV with ``n_seq_max`` equal to the number of sequences (each its own cells), flash
attention left to llama.cpp (``auto``), no GPU layers, ``n_threads = n_threads_batch = threads``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from weaved.bench import BenchConfig
from weaved.bench.harness import Progress, measure, memory_after_load, resident_mb
from weaved.model.tokenizer import quiet_llama_logs


class LlamaEngine:
    """``harness.Engine`` over one llama.cpp model; a new context per ``open``."""

    def __init__(self, path: str, threads: int, n_batch: int = 512, flash_attn: str = "auto"):
        import llama_cpp as L

        self.L = L
        quiet_llama_logs(L)  # the process's one log sink, off the terminal
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.threads = threads
        self.n_batch = n_batch
        self.set_flash_attn(flash_attn)
        self.ctx = None
        self.batch = None
        self.lengths: list[int] = []

    def set_flash_attn(self, mode: str) -> None:
        """``auto`` (llama.cpp's default) or ``off``, for the contexts opened from now on."""
        L = self.L
        self.flash_attn = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}[mode]

    def open(self, n_seqs: int, capacity: int) -> None:
        L = self.L
        self.free_context()
        per_seq = -(-max(capacity, 256) // 256) * 256  # llama.cpp pads KV use to 256 cells
        cp = L.llama_context_default_params()
        cp.n_ctx = per_seq * n_seqs  # non-unified KV: each sequence gets n_ctx / n_seq_max cells
        cp.n_batch = self.n_batch
        cp.n_ubatch = self.n_batch
        cp.n_seq_max = n_seqs
        cp.n_threads = self.threads
        cp.n_threads_batch = self.threads
        cp.flash_attn_type = self.flash_attn
        cp.kv_unified = False
        if hasattr(cp, "swa_full"):  # llama.cpp's own tools keep a sliding-window layer's cache to its window
            cp.swa_full = False  # (the bindings' default is the whole context: a Gemma 3 layer would walk
            # every masked key at long context)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp cannot create a context")
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(max(self.n_batch, n_seqs), 0, 1)
        self.lengths = [0] * n_seqs

    def close(self) -> None:
        self.free_context()
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None

    def free_context(self) -> None:
        """Free the context (its KV, its buffers); the model stays loaded."""
        if self.batch is not None:
            self.L.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None

    def _decode(self, toks: Sequence[int], pos: Sequence[int], seqs: Sequence[int], logits: Sequence[int]):
        b = self.batch
        for i, t in enumerate(toks):
            b.token[i] = t
            b.pos[i] = pos[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seqs[i]
            b.logits[i] = logits[i]
        b.n_tokens = len(toks)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self.L.llama_synchronize(self.ctx)

    def _argmax_rows(self, n_rows: int) -> list[int]:
        # With logits requested for n_rows tokens, llama.cpp stores exactly those rows in order.
        p = self.L.llama_get_logits(self.ctx)
        rows = np.ctypeslib.as_array(p, shape=(n_rows, self.n_vocab))  # [n_rows, vocab] f32
        return [int(v) for v in rows.argmax(axis=1)]

    def prefill(self, seqs: Sequence[int], prompts: Sequence[Sequence[int]], want_logits: bool) -> list[int]:
        toks, pos, sq, lg = [], [], [], []
        for s, p in zip(seqs, prompts, strict=True):
            n = len(p)
            toks += list(p)
            pos += range(self.lengths[s], self.lengths[s] + n)
            sq += [s] * n
            lg += [0] * (n - 1) + [1 if want_logits else 0]
            self.lengths[s] += n
        self._decode(toks, pos, sq, lg)
        return self._argmax_rows(len(seqs)) if want_logits else []

    def step(self, tokens: Sequence[int]) -> list[int]:
        n = len(tokens)
        self._decode(tokens, self.lengths, range(n), [1] * n)
        for s in range(n):
            self.lengths[s] += 1
        return self._argmax_rows(n)

    def truncate(self, seq: int, length: int) -> None:
        if not self.L.llama_memory_seq_rm(self.mem, seq, length, -1):
            raise RuntimeError(f"llama.cpp cannot truncate sequence {seq} to {length}")
        self.lengths[seq] = length


def measure_llama(cfg: BenchConfig, tokens: Sequence[int], progress: Progress) -> dict[str, float]:
    """Every selected measurement on llama.cpp, and the figures it shares with Weave's side
    (``LLAMA_INFO_KEYS``): load time and resident memory, measured as Weave's are - after loading
    and one forward of one token in a one-sequence context (the model's pages touched, its CPU
    repacking done), and at the end with the last context freed.

    Each figure is the better of llama.cpp's flash attention settings ``cfg.llama_flash_attn`` (its
    default ``auto``, and ``off``): which one is faster depends on the CPU and the figure (on an
    AVX-512 FP16 Xeon, off decodes at long context at twice the speed of auto, whose prefill is
    faster), and a baseline held to the slower one would flatter Weave."""
    import time

    progress("loading the model")
    t0 = time.perf_counter()
    engine = LlamaEngine(str(cfg.model), cfg.threads, cfg.n_batch)
    try:
        engine.open(1, 256)
        engine.prefill([0], [[int(tokens[0])]], want_logits=True)
        load_s = time.perf_counter() - t0
        memory = memory_after_load()
        progress(f"ready in {load_s:.1f} s, {memory['rss_mb']:.0f} MB resident")
        out: dict[str, float] = {}
        for fa in cfg.llama_flash_attn:
            engine.set_flash_attn(fa)
            progress(f"flash attention {fa}")
            for k, v in measure(engine, cfg, tokens, progress).items():
                if k in out and v > out[k]:
                    progress(f"{k}: flash attention {fa} is faster ({v:.1f} against {out[k]:.1f} tok/s)")
                out[k] = max(out.get(k, 0.0), v)
        engine.free_context()  # the model stays, as Weave's does at its end figure
        return {**out, "load_s": load_s, **memory, "rss_end_mb": resident_mb()}
    finally:
        engine.close()
