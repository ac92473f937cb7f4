"""The torch backend: the model on a torch device (CUDA in production, torch's CPU device in tests).

It mirrors the CPU backend step for step with its arithmetic, operation for operation
(``weaved.kernels``'s torch_q4 / torch_rowwise / torch_attention, and on CUDA the Triton product
of triton_q4): weights stay in their GGUF encoding on the device, activations are quantized to
Q8_0 per row, block dot products are exact integers accumulated by fma in block order, the logits
use two-level activations, and every other sum runs in the CPU kernels' fixed order, which depends
on the row alone.  So a sequence's logits are bit-identical alone or in any batch, n tokens in one
chunk give the rows of n single steps, and the numbers are the CPU backend's: a session moves
between the two without its continuation changing.  (Anything less drifts: an ulp here and there
flips a Q8_0 rounding now and then, and the flips compound until the two are as far apart as
either is from the float64 truth.)

On the CPU device this is a test vehicle - correct, not fast (torch dispatches one small op at a
time; attention alone is a few ops per key and layer).

KV: each cache gets a block table in the device's paged KV pool (``torch_paged``), shared prefix
blocks held once per device; a step writes its new rows to its blocks and through to ``kv.data``
before returning.  Attention gathers a sequence's blocks into one run of keys, then computes as the
CPU kernel does.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from weaved.backends.base import Backend, BackendStats, Logits, SeqChunk
from weaved.backends.rope import kernel_rope
from weaved.backends.torch_experts import experts_ffn
from weaved.backends.torch_graphs import DecodeGraphs, GraphUnavailable
from weaved.backends.torch_paged import PagedKV
from weaved.backends.torch_step import PagedStep
from weaved.backends.torch_transfer import to_host
from weaved.backends.torch_weights import upload_model
from weaved.kernels.torch_attention import attend
from weaved.kernels.torch_products import Products, kernel_path
from weaved.kernels.torch_q4 import DeviceWeight, Q8Act, embed_rows, linear_float
from weaved.kernels.torch_rowwise import RopeTable, gelu_table
from weaved.kv.cache import KVCache
from weaved.model.config import ModelConfig, RopeStyle
from weaved.model.gguf_file import GGUFFile
from weaved.model.loader import open_model

log = logging.getLogger("weave.backend")

class TorchBackend(Backend):
    def __init__(self, gguf: GGUFFile, config: ModelConfig, device: torch.device | str = "cpu",
                 threads: int | None = None, kv_bytes: int | Callable[[int], int] | None = None,
                 graphs: bool | None = None):
        """``threads``: set torch's intra-op thread count (process-wide, like the CPU backend's
        ``threads``); on the CPU device one thread avoids OpenMP barrier stalls on busy cores.
        ``kv_bytes``: the paged KV pool's size, or a function of the uploaded weights' bytes that gives it
        (and may refuse: ``weaved.backends.device_memory``); None: ``default_kv_bytes``.
        ``graphs``: replay decode steps from CUDA graphs (``torch_graphs``); None: on CUDA with the Triton
        kernels, unless ``WEAVE_DECODE_GRAPHS=0``.  On torch's CPU device True runs the graphs' buffers
        without capturing (tests)."""
        if threads:
            torch.set_num_threads(threads)
        self.config = config
        self.gguf = gguf
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stats = BackendStats()
        self.stats.extra.update(h2d_bytes=0.0, d2h_bytes=0.0)
        self.device_plan = None  # the daemon's split of the device's memory (weaved.backends.device_memory)
        self._io_h2d = self._io_d2h = 0  # token ids and positions in, logits out (the mirrors count KV)
        self.kernels = kernel_path(self.device)  # "triton" or "torch"
        self._products = Products(self.kernels)
        self._ops = self._products.rows  # RMSNorm, RoPE, SwiGLU/GeGLU, quantization of this path
        self.weights = upload_model(gguf, config, self.device)
        self._rope = RopeTable(kernel_rope(config, config.rope), self.device)
        self._rope_swa = (RopeTable(kernel_rope(config, config.rope_swa), self.device) if config.rope_swa is not None
                          else self._rope)
        self._gelu = gelu_table(self.device) if config.act == "gelu" else None
        if callable(kv_bytes):
            kv_bytes = kv_bytes(self.weights.nbytes)
        self._kv = PagedKV(config, self.device, kv_bytes if kv_bytes is not None else default_kv_bytes(self.device))
        self._scale = config.scores_scale
        self._paged_kernel = self.kernels == "triton" and _triton_attention_takes(config.head_dim)
        self.graphs = DecodeGraphs(self, capture=self.device.type == "cuda") if self._graphs_wanted(graphs) else None
        if self.graphs is not None:
            self._kv.scratch_block()  # taken now: a full pool later must not fail the first graph step
        gguf.release_pages()  # uploaded: the file's pages need not stay in our resident set

    @classmethod
    def from_file(cls, path: str | Path, device: torch.device | str = "cpu", threads: int | None = None,
                  kv_bytes: int | None = None, graphs: bool | None = None) -> TorchBackend:
        gguf, cfg = open_model(path)
        return cls(gguf, cfg, device=device, threads=threads, kv_bytes=kv_bytes, graphs=graphs)

    def _graphs_wanted(self, graphs: bool | None) -> bool:
        """Decode graphs need the paged Triton path, on which the host never waits for a step: a dense
        model, or experts stacked for the grouped kernels (``kernels.triton_moe`` sorts a step's tokens by
        expert on the device; other experts are grouped on the host).  Asked for elsewhere, refused."""
        env = os.environ.get("WEAVE_DECODE_GRAPHS", "").strip().lower()
        if env not in ("", "0"):
            raise ValueError(f"WEAVE_DECODE_GRAPHS may only be 0 (no decode graphs), got {env!r}")
        grouped = all(L.experts is None or (L.experts.gate_up_stack is not None and L.experts.down_stack is not None)
                      for L in self.weights.layers)
        possible = self._paged_kernel and grouped
        if graphs is None:
            return possible and env != "0" and self.device.type == "cuda"
        if graphs and not possible:
            raise ValueError("decode graphs need the Triton kernels with paged attention and, on a mixture of "
                             f"experts, Q4_0/Q8_0 experts; not {self.kernels} kernels"
                             + ("" if grouped else " with experts of another type"))
        return graphs

    @property
    def name(self) -> str:
        return "torch"

    @property
    def kv_pool(self) -> PagedKV:
        return self._kv

    @property
    def rope(self) -> RopeTable:
        return self._rope

    @property
    def rope_swa(self) -> RopeTable:
        """The sliding-window layers' table (``rope`` itself where they share one)."""
        return self._rope_swa

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream's rows [T, d_model] through the output norm: what the logits read."""
        return self._ops.rmsnorm(x, self.weights.output_norm, self.config.rms_eps)

    def new_kv(self, capacity: int) -> KVCache:
        return KVCache.allocate(self.config, capacity)

    # ---- migration ------------------------------------------------------------------------------
    def adopt(self, kv: KVCache) -> int:
        with torch.inference_mode():
            n = self._kv.adopt(kv)
        self._sync_stats()
        return n

    def release(self, kv: KVCache) -> int:
        return self._kv.release(kv)

    def prepare(self, kv: KVCache, new_length: int) -> None:
        """Take the blocks a step growing ``kv`` to ``new_length`` needs: a full pool fails that
        session's step alone (``DeviceKVFull``, a 503), before anything is written."""
        with torch.inference_mode():
            self._kv.prepare(kv, max(0, new_length - kv.length))
        self._sync_stats()

    def close(self) -> None:
        """Give the device's memory back: the KV pool, the decode graphs and their buffers, then the
        allocator's cache - a process that starts another backend afterwards (a benchmark's next run)
        finds the device as free as before this one.  The backend serves no step after."""
        if self.graphs is not None:
            self.graphs.close()
        self._kv.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def device_kv_bytes(self) -> int:
        return self._kv.nbytes()

    def device_info(self) -> dict | None:
        if self.device.type != "cuda":
            return None  # torch's CPU device standing in for a GPU: the host's CPU
        free, total = torch.cuda.mem_get_info(self.device)
        return {"index": self.device.index, "name": torch.cuda.get_device_name(self.device),
                "memory_total": total, "memory_used": total - free,
                "decode_graphs": self.graphs.counters() if self.graphs is not None else None}

    def device_kv_capacity(self) -> int:
        """Bytes of the paged KV pool (used or free)."""
        return self._kv.capacity_bytes()

    def device_kv_free_bytes(self) -> int:
        return self._kv.free_bytes()

    def device_kv_bytes_of(self, kv: KVCache) -> int:
        return self._kv.held_bytes(kv)

    def _sync_stats(self) -> None:
        self.stats.extra["h2d_bytes"] = float(self._kv.h2d_bytes + self._io_h2d)
        self.stats.extra["d2h_bytes"] = float(self._kv.d2h_bytes + self._io_d2h)

    # ---- products -------------------------------------------------------------------------------
    def _project(self, ws: tuple[DeviceWeight, ...], h: torch.Tensor, a: Q8Act | None = None) -> torch.Tensor:
        """h float32 [T, n_in] through one or more matrices that read it -> [T, sum of n_out].  ``a``: h's
        Q8_0 when the step already has it (else one quantization for all of them)."""
        if a is None and any(w.quantized for w in ws):
            a = self._ops.quantize_act(h)
        ys = [self._products.linear_act(w, a) if w.quantized else linear_float(w, h) for w in ws]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)

    # ---- the step -------------------------------------------------------------------------------
    def _check(self, chunks: list[SeqChunk]) -> np.ndarray:
        """Every error a step can raise, before anything is written: the step's token ids [T]."""
        for c in chunks:
            n = len(c.tokens)
            if n < 1:
                raise ValueError("a chunk needs at least one token")
            if c.kv.length + n > c.kv.capacity:
                raise ValueError(f"KV cache full: {c.kv.length} + {n} tokens > capacity {c.kv.capacity}")
            if c.kv.data.shape != (self.config.n_layers, 2, self.config.n_kv_heads, c.kv.capacity,
                                   self.config.head_dim):
                raise ValueError(f"KV cache shape {c.kv.data.shape} does not fit this model")
        ids = np.concatenate([np.asarray(c.tokens, dtype=np.int64) for c in chunks])  # [T]
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
        return ids

    def forward(self, chunks: list[SeqChunk]) -> list[np.ndarray]:
        if not chunks:
            return []
        t0 = time.perf_counter()
        ids = self._check(chunks)
        with torch.inference_mode():
            out = self._forward(chunks, ids)
        st = self.stats
        lens = [len(c.tokens) for c in chunks]
        st.steps += 1
        st.tokens += sum(lens)
        st.prefill_tokens += sum(n for n in lens if n > 1)
        st.decode_tokens += sum(1 for n in lens if n == 1)
        st.seconds += time.perf_counter() - t0
        self._sync_stats()
        return out

    def _forward(self, chunks: list[SeqChunk], ids_np: np.ndarray) -> list[np.ndarray]:
        lens = [len(c.tokens) for c in chunks]
        starts = np.concatenate([[0], np.cumsum(lens)]).tolist()  # chunk s has rows starts[s]..starts[s+1]-1
        pos0 = [c.kv.length for c in chunks]
        tables = [self._kv.prepare(c.kv, n) for c, n in zip(chunks, lens, strict=True)]
        self._io_h2d += 2 * ids_np.nbytes
        graphed = None
        if self.graphs is not None and self.graphs.takes(chunks):
            try:  # a decode step replayed from a CUDA graph: the final rows (normed) and the step's K/V rows
                graphed = self.graphs.run(ids_np, tables, pos0)  # [S, d_model], [L, 2, Hkv, >= S, D]
            except GraphUnavailable as e:  # nothing was written: this step and the next run kernel by kernel
                log.warning("decode graphs turned off on %s: %s", self.device, e)
                self.graphs = None
        if graphed is not None:
            hs, new_kv = graphed
            logits = self._split(self._head(hs), [1] * len(chunks))
        else:
            T, dev = starts[-1], self.device
            positions = np.concatenate([np.arange(p, p + n) for p, n in zip(pos0, lens, strict=True)])  # [T]
            ids = torch.from_numpy(ids_np).to(dev)  # [T] int64
            pos_d = torch.from_numpy(positions).to(dev)
            cfg = self.config
            new_kv = torch.empty((cfg.n_layers, 2, cfg.n_kv_heads, T, cfg.head_dim), dtype=torch.float16,
                                 device=dev)  # this step's rows
            if self._paged_kernel:  # every row attends in one launch per layer over the pool (torch_step)
                x = self.layers(ids, pos_d, PagedStep.build(self._kv, tables, pos0, lens, dev), new_kv)
            else:  # the torch path: each sequence's new rows' (block, offset), and attention per sequence
                slots = [self._kv.where(t, p, p + n) for t, p, n in zip(tables, pos0, lens, strict=True)]
                x = self.layers(ids, pos_d, None, new_kv, max(p + n for p, n in zip(pos0, lens, strict=True)),
                                lambda li, q, w: self._attention(li, q, new_kv, tables, slots, starts, pos0, w))
            rows, counts = self._rows(chunks, starts)
            if rows:
                hs = self.final_norm(x[torch.tensor(rows, device=dev)])
                logits = self._split(self._head(hs), counts)
            else:
                logits = self._split(np.empty((0, cfg.vocab_size), dtype=np.float32), counts)
        host_kv = to_host(new_kv)  # one device-to-host copy of the step's rows, then through to the files
        for s, c in enumerate(chunks):
            self._kv.write_through(c.kv, host_kv[:, :, :, starts[s]:starts[s + 1]], pos0[s])
            c.kv.length += lens[s]
        return logits

    def layers(self, ids: torch.Tensor, pos_d: torch.Tensor, paged: PagedStep | None, new_kv: torch.Tensor,
               need: int | None = None, attention: Callable | None = None) -> torch.Tensor:
        """The embeddings of ``ids`` (int64 [T]) at positions ``pos_d`` (int64 [T]) through every layer:
        the residual stream [T, d_model].  Each layer's K/V rows go into ``new_kv`` [L, 2, Hkv, T, D] and,
        on the paged path (``paged``), into their pool slots.  Without ``paged``, ``attention(li, q,
        window)`` attends (the torch path) and ``need`` is one past the highest position.  Nothing here
        waits for the device, so a CUDA graph can capture it (``torch_graphs``)."""
        cfg, W = self.config, self.weights
        need = paged.last + 1 if paged is not None else need
        cos, sin = self._rope.lookup(pos_d, need)  # [T, n_rot/2]
        cos_w, sin_w = self._rope_swa.lookup(pos_d, need) if self._rope_swa is not self._rope else (cos, sin)
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        neox = cfg.rope_style == RopeStyle.NEOX
        x = embed_rows(W.embedding, ids)  # [T, d_model]
        if cfg.embed_scale != 1.0:
            x = x * float(np.float32(cfg.embed_scale))
        ops = self._ops
        rmsnorm, eps = ops.rmsnorm, cfg.rms_eps
        # each residual add is fused with the norm after it and that norm's quantization (add_norm_quant)
        _, h, a = ops.add_norm_quant(x, None, W.layers[0].attn_norm, eps)
        for li, L in enumerate(W.layers):
            qkv = self._project(L.wqkv, h, a)  # [T, q_dim + 2*kv_dim]
            if L.bqkv is not None:
                qkv = qkv + L.bqkv
            window = cfg.layer_window(li)
            c, s_ = (cos_w, sin_w) if window else (cos, sin)
            norms = (L.q_norm, L.k_norm) if L.q_norm is not None else None
            # q normed and rotated [T, H, D]; k and v (float16, rounded to nearest even) into the step's
            # new rows and, on the paged path, into their slots in the pool
            slots_li = (self._kv.pool[li], paged.blk, paged.off) if paged is not None else None
            q = ops.rope_qkv(qkv, (H, Hkv, D), c, s_, neox, norms, eps, new_kv[li], slots_li)
            if paged is not None:  # with the rows' Q8_0 for the output projection, made in the same launches
                att, a = paged.attend(self._kv.pool[li], q, window, self._scale)
            else:
                att, a = attention(li, q, window), None
            y = self._project((L.wo,), att, a)
            if L.post_attn_norm is not None:
                y = rmsnorm(y, L.post_attn_norm, eps)
            x, h, a = ops.add_norm_quant(x, y, L.ffn_norm, eps)
            if L.experts is not None:
                y = experts_ffn(h, L.experts, cfg.n_experts_used, self._project, ops)
            else:
                g, ga = ops.glu_quant(self._project(L.wgu, h, a), self._gelu)
                y = self._project((L.wdown,), g, ga)
            if L.post_ffn_norm is not None:
                y = rmsnorm(y, L.post_ffn_norm, eps)
            if li + 1 < len(W.layers):
                x, h, a = ops.add_norm_quant(x, y, W.layers[li + 1].attn_norm, eps)
            else:
                x = x + y
        return x

    def _attention(self, li: int, q: torch.Tensor, new_kv: torch.Tensor, tables, slots, starts, pos0, window: int
                   ) -> torch.Tensor:
        """Store layer li's new K/V rows in each sequence's blocks, then attend per sequence over its
        keys gathered from its blocks: q float32 [T, H, D] -> float32 [T, q_dim].  With a ``window``, a
        row at position p >= window attends its last ``window`` keys addressed from the first of them,
        as the CPU kernel does (its chunks start there), so such rows go one at a time."""
        T, H, D = q.shape
        B = self._kv.block
        pool = self._kv.pool[li]  # [n_blocks, 2, Hkv, BLOCK, D]
        att = torch.empty((T, H, D), dtype=torch.float32, device=q.device)
        for s, t in enumerate(tables):
            a, b, p = starts[s], starts[s + 1], pos0[s]
            blk, off = slots[s]
            pool[blk, :, :, off] = new_kv[li, :, :, a:b].permute(2, 0, 1, 3)  # [n, 2, Hkv, D] into their slots
            keys = p + b - a
            nb = -(-keys // B)
            kv = pool[self._kv.ids(t)[:nb]].permute(1, 2, 0, 3, 4).reshape(2, -1, nb * B, D)[:, :, :keys]
            # kv: [2, Hkv, keys, D], the sequence's keys in position order
            full = b - a if not window else max(0, min(b - a, window - p))  # rows whose keys start at 0
            if full:
                att[a:a + full] = attend(q[a:a + full], kv[0], kv[1], p, self._scale)[0]
            for r in range(a + full, b):
                pos = p + r - a
                lo = pos + 1 - window
                att[r:r + 1] = attend(q[r:r + 1], kv[0, :, lo:pos + 1], kv[1, :, lo:pos + 1], pos - lo, self._scale)[0]
        return att.reshape(T, H * D)

    @staticmethod
    def _rows(chunks: list[SeqChunk], starts: list[int]) -> tuple[list[int], list[int]]:
        """The step's rows whose logits the chunks asked for, and how many each chunk gets."""
        rows, counts = [], []
        for c, a, b in zip(chunks, starts[:-1], starts[1:], strict=True):
            sel = {Logits.NONE: range(0), Logits.LAST: range(b - 1, b), Logits.ALL: range(a, b)}[c.logits]
            rows.extend(sel)
            counts.append(len(sel))
        return rows, counts

    def _head(self, hs: torch.Tensor) -> np.ndarray:
        """The output norm's rows hs [n, d_model] -> their logits, float32 numpy [n, vocab]."""
        logits = to_host(self._products.linear_residual(self.weights.output, hs))  # [n_rows, vocab]
        self._io_d2h += logits.nbytes
        return logits

    @staticmethod
    def _split(logits: np.ndarray, counts: list[int]) -> list[np.ndarray]:
        out, o = [], 0
        for n in counts:
            out.append(logits[o:o + n])
            o += n
        return out


def _triton_attention_takes(head_dim: int) -> bool:
    from weaved.kernels.triton_attention import head_dim_supported  # imports triton: only on that path

    return head_dim_supported(head_dim)


def default_kv_bytes(device: torch.device) -> int:
    """The paged KV pool's default size: on CUDA, 80 % of the device memory free once the weights are
    uploaded (the rest is the step's activations and the allocator's slack); on torch's CPU device (a
    test vehicle) 1 GiB, whose untouched pages cost no memory."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return 1 << 30
