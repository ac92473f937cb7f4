"""The CPU backend: the model on the host's cores with Weave's numba kernels.

Weights stay in their GGUF quantization (Q4_0 for every layer matrix) and are repacked once at
load into the kernel's layout; q|k|v and gate|up are fused into one matrix each so that a step
quantizes each activation once per fused product.  Dense layers run as one product over all
tokens of the step; attention runs per sequence over that sequence's KV array (over the last
``window`` positions on a sliding-window layer; the KV file keeps every position of every layer).
A mixture of experts' FFN (``kernels.moe``) runs each expert once over the tokens routed to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from weaved.backends.base import Backend, BackendStats, Logits, SeqChunk
from weaved.backends.experts import load_experts
from weaved.backends.rope import kernel_rope
from weaved.kernels import attention as ka
from weaved.kernels import elementwise as ke
from weaved.kernels import layer_loop, matmul
from weaved.kernels import threads as kthreads
from weaved.kernels.elementwise import geglu, swiglu
from weaved.kernels.moe import ExpertWeights, moe_ffn
from weaved.kernels.residual import linear_residual
from weaved.kv.cache import KVCache
from weaved.model.config import ModelConfig
from weaved.model.gguf_file import GGUFFile
from weaved.model.loader import open_model


@dataclass(frozen=True)
class _Layer:
    attn_norm: np.ndarray  # [d_model] f32
    wqkv: object  # PackedWeight [q_dim + 2*kv_dim, d_model]
    bqkv: np.ndarray | None  # [q_dim + 2*kv_dim] f32 (qwen2)
    q_norm: np.ndarray | None  # [head_dim] f32 (qwen3)
    k_norm: np.ndarray | None
    wo: object  # PackedWeight [d_model, q_dim]
    ffn_norm: np.ndarray
    wgu: object  # PackedWeight [2*d_ff, d_model] (None: a mixture of experts)
    wdown: object  # PackedWeight [d_model, d_ff]
    post_attn_norm: np.ndarray | None = None  # [d_model] f32 (gemma3)
    post_ffn_norm: np.ndarray | None = None
    experts: ExpertWeights | None = None  # a mixture of experts' router and experts (qwen3moe)


class CPUBackend(Backend):
    fused_layers = True  # one compiled call for all layers where the model allows (``layer_loop``)

    def __init__(self, gguf: GGUFFile, config: ModelConfig, threads: int | None = None,
                 progress: Callable[[int, int], None] | None = None):
        """``progress(done, total)`` hears the repacking of the layers."""
        if threads:
            kthreads.set_threads(threads)
        self.threads = kthreads.get_threads()
        self.config = config
        self.gguf = gguf
        self.stats = BackendStats()
        self._load(gguf, config, progress or (lambda done, total: None))

    # Every method that runs parallel kernels runs them on the process's one kernel thread
    # (``kernels.threads.on_kernel_thread`` says why): repacking, the forward and its pieces.
    @kthreads.on_kernel_thread
    def _load(self, gguf: GGUFFile, config: ModelConfig, progress: Callable[[int, int], None]) -> None:
        t = gguf.tensors
        cfg = config

        def f32(name: str) -> np.ndarray:
            return np.ascontiguousarray(t[name].raw, dtype=np.float32).reshape(-1)

        def packed(names: list[str]):
            parts = [t[n] for n in names]
            qtype = parts[0].type_id
            if any(p.type_id != qtype for p in parts):  # fuse only matrices of one type
                raise ValueError(f"cannot fuse {names}: mixed tensor types")
            raw = matmul.concat_rows([p.raw for p in parts]) if len(parts) > 1 else parts[0].raw
            n_out = sum(p.shape[0] for p in parts)
            return matmul.pack_weight(raw, qtype, n_out, parts[0].shape[1])

        def packed_or_split(names: list[str]):
            if len({t[n].type_id for n in names}) == 1:
                return packed(names)
            return [packed([n]) for n in names]  # mixed types: separate products

        layers = []
        for i in range(cfg.n_layers):
            progress(i, cfg.n_layers + 1)
            p = f"blk.{i}."
            layers.append(
                _Layer(
                    attn_norm=f32(p + "attn_norm.weight"),
                    wqkv=packed_or_split([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
                    bqkv=np.concatenate([f32(p + f"attn_{x}.bias") for x in "qkv"]) if cfg.attn_bias else None,
                    q_norm=f32(p + "attn_q_norm.weight") if cfg.qk_norm else None,
                    k_norm=f32(p + "attn_k_norm.weight") if cfg.qk_norm else None,
                    wo=packed([p + "attn_output.weight"]),
                    ffn_norm=f32(p + "ffn_norm.weight"),
                    wgu=None if cfg.moe else packed_or_split([p + "ffn_gate.weight", p + "ffn_up.weight"]),
                    wdown=None if cfg.moe else packed([p + "ffn_down.weight"]),
                    post_attn_norm=f32(p + "post_attention_norm.weight") if cfg.post_norms else None,
                    post_ffn_norm=f32(p + "post_ffw_norm.weight") if cfg.post_norms else None,
                    experts=load_experts(gguf, cfg, i) if cfg.moe else None,
                )
            )
        self.layers = layers
        self._loop = layer_loop.LayerWeights.build(layers, cfg)  # None: the Python loop runs them
        self._rope = kernel_rope(cfg, cfg.rope)
        self._rope_swa = kernel_rope(cfg, cfg.rope_swa) if cfg.rope_swa is not None else self._rope
        self._ropes = [self._rope_swa if cfg.layer_window(i) and cfg.rope_swa is not None else self._rope
                       for i in range(cfg.n_layers)]
        self.out_norm = f32("output_norm.weight")
        emb = t["token_embd.weight"]
        self._emb_raw, self._emb_type = emb.raw, emb.type_id
        # the output matrix runs with two-level activations: quantizing the final hidden state to
        # Q8_0 once was the largest single error in the next-token distribution (kernels.residual)
        out = t["token_embd.weight" if cfg.tied_output else "output.weight"]
        self.wout = packed([out.name])
        if self.wout.qtype in (2, 8):  # Q4_0, Q8_0: two-level activations for the candidate logits
            self._logits = lambda h: linear_residual(self.wout, h)
        else:
            self._logits = lambda h: matmul.linear(self.wout, h)
        # a tied embedding is looked up in the output's packed copy: the matrix is resident once
        self._emb_packed = cfg.tied_output and self.wout.qk != 0
        self.attn_scale = cfg.scores_scale  # the scores' scale, one float for every path
        gguf.release_pages()  # repacked: the file's pages need not stay in our resident set
        progress(cfg.n_layers + 1, cfg.n_layers + 1)

    @classmethod
    def from_file(cls, path: str | Path, threads: int | None = None) -> CPUBackend:
        gguf, cfg = open_model(path)
        return cls(gguf, cfg, threads=threads)

    @property
    def name(self) -> str:
        return "cpu"

    @property
    def host_parallel(self) -> bool:
        return True

    def new_kv(self, capacity: int) -> KVCache:
        return KVCache.allocate(self.config, capacity)

    @property
    def decode_bytes(self) -> int:
        """Bytes of weights one decode step of one token reads: every layer matrix (of a mixture of
        experts: the router and the experts one token uses) and the output matrix."""
        mats = [w for L in self.layers for m in (L.wqkv, L.wo, L.wgu, L.wdown) if m is not None
                for w in (m if isinstance(m, list) else [m])]
        experts = sum(L.experts.router.nbytes + self.config.n_experts_used * L.experts.nbytes_per_expert
                      for L in self.layers if L.experts is not None)
        return sum(w.nbytes for w in mats) + experts + self.wout.nbytes

    @kthreads.on_kernel_thread
    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token embeddings of ``ids`` int32 [T] (checked against the vocabulary by the caller), times the
        model's embedding scale (gemma3: float32 sqrt(d_model)): float32 [T, d_model]."""
        if self._emb_packed:
            x = matmul.embed_rows(matmul.packed_rows(self.wout, ids), self._emb_type, np.arange(len(ids)))
        else:
            x = matmul.embed_rows(self._emb_raw, self._emb_type, ids)
        if self.config.embed_scale != 1.0:
            x *= np.float32(self.config.embed_scale)
        return x

    @kthreads.on_kernel_thread
    def output(self, hs: np.ndarray) -> np.ndarray:
        """Logits of final-normed hidden rows hs float32 [n, d_model]: float32 [n, vocab], whose rows may
        be padded apart (``kernels.matmul.padded_out``)."""
        return self._logits(hs)

    def _linear(self, w, x: np.ndarray) -> np.ndarray:
        if isinstance(w, list):
            return np.concatenate([matmul.linear(p, x) for p in w], axis=1)
        return matmul.linear(w, x)

    # The two halves of a layer around attention: the forward below runs them with attention over each
    # sequence's own KV; federation's Q-Ring runs them with attention gathered around the ring.
    @kthreads.on_kernel_thread
    def pre_attention(self, li: int, x: np.ndarray, positions: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer ``li``'s attention norm, q|k|v product (+ biases, q/k norms) and rope on x float32
        [T, d_model] at ``positions`` [T] int64 -> q [T, n_heads, head_dim], k and v [T, n_kv_heads,
        head_dim], float32."""
        cfg, L = self.config, self.layers[li]
        T = x.shape[0]
        H, Hkv, D, qd, kd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.q_dim, cfg.kv_dim
        h = ke.rmsnorm(x, L.attn_norm, cfg.rms_eps)  # [T, d_model]
        qkv = self._linear(L.wqkv, h)  # [T, q_dim + 2*kv_dim]
        if L.bqkv is not None:
            qkv += L.bqkv
        q = np.ascontiguousarray(qkv[:, :qd]).reshape(T, H, D)
        k = np.ascontiguousarray(qkv[:, qd : qd + kd]).reshape(T, Hkv, D)
        v = np.ascontiguousarray(qkv[:, qd + kd :]).reshape(T, Hkv, D)
        if L.q_norm is not None:
            ke.rmsnorm_heads(q, L.q_norm, cfg.rms_eps)
            ke.rmsnorm_heads(k, L.k_norm, cfg.rms_eps)
        ke.rope(q, positions, self._ropes[li])
        ke.rope(k, positions, self._ropes[li])
        return q, k, v

    @kthreads.on_kernel_thread
    def post_attention(self, li: int, x: np.ndarray, att: np.ndarray) -> None:
        """Output product + residual, then the feed-forward block + residual, into x [T, d_model] in
        place; att float32 [T, n_heads, head_dim]."""
        cfg, L = self.config, self.layers[li]
        y = self._linear(L.wo, att.reshape(x.shape[0], cfg.q_dim))
        x += ke.rmsnorm(y, L.post_attn_norm, cfg.rms_eps) if L.post_attn_norm is not None else y
        h = ke.rmsnorm(x, L.ffn_norm, cfg.rms_eps)
        if L.experts is not None:
            y = moe_ffn(h, L.experts, cfg.n_experts_used)
        else:
            act = geglu if cfg.act == "gelu" else swiglu
            y = self._linear(L.wdown, act(self._linear(L.wgu, h)))
        x += ke.rmsnorm(y, L.post_ffn_norm, cfg.rms_eps) if L.post_ffn_norm is not None else y

    def _layers_python(self, x: np.ndarray, positions: np.ndarray, kvs, seq_starts: np.ndarray,
                       pos0: np.ndarray) -> None:
        """The layers one kernel call at a time (models ``layer_loop`` does not take)."""
        cfg = self.config
        T = x.shape[0]
        att = np.empty((T, cfg.n_heads, cfg.head_dim), dtype=np.float32)
        lse = np.empty((T, cfg.n_heads), dtype=np.float32)
        for li in range(len(self.layers)):
            q, k, v = self.pre_attention(li, x, positions)
            ka.kv_store(kvs, li, seq_starts, pos0, k, v)
            ka.attend(q, kvs, li, seq_starts, pos0, self.attn_scale, att, lse, self.config.layer_window(li))
            self.post_attention(li, x, att)

    @kthreads.on_kernel_thread
    def forward(self, chunks: list[SeqChunk]) -> list[np.ndarray]:
        if not chunks:
            return []
        t0 = time.perf_counter()
        cfg = self.config
        lens = [len(c.tokens) for c in chunks]
        for c, n in zip(chunks, lens, strict=True):
            if n < 1:
                raise ValueError("a chunk needs at least one token")
            if c.kv.length + n > c.kv.capacity:
                raise ValueError(f"KV cache full: {c.kv.length} + {n} tokens > capacity {c.kv.capacity}")
        T = sum(lens)
        ids = np.concatenate([np.asarray(c.tokens, dtype=np.int32) for c in chunks])  # [T]
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"token id out of range [0, {cfg.vocab_size})")
        seq_starts = np.zeros(len(chunks) + 1, dtype=np.int64)
        seq_starts[1:] = np.cumsum(lens)
        pos0 = np.array([c.kv.length for c in chunks], dtype=np.int64)
        positions = np.concatenate([np.arange(p, p + n, dtype=np.int64) for p, n in zip(pos0, lens, strict=True)])
        kvs = ka.kv_list([c.kv.data for c in chunks])

        x = self.embed(ids)  # [T, d_model]
        if self._loop is not None and self.fused_layers:
            code, bad = layer_loop.run_layers(
                self._loop, x, positions, kvs, seq_starts, pos0, (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim),
                cfg.rms_eps, self._rope, self._rope_swa, self.attn_scale,
                ka.attention_params(cfg.n_heads, cfg.head_dim),
                kthreads.get_threads())
            ka.raise_batch_error(code, bad)
        else:
            self._layers_python(x, positions, kvs, seq_starts, pos0)

        # logits only for the rows that were asked for
        rows, counts = [], []
        for c, s, n in zip(chunks, seq_starts[:-1], lens, strict=True):
            sel = {Logits.NONE: range(0), Logits.LAST: range(s + n - 1, s + n), Logits.ALL: range(s, s + n)}[
                c.logits
            ]
            rows.extend(sel)
            counts.append(len(sel))
        out: list[np.ndarray] = []
        if rows:
            hs = ke.rmsnorm(np.ascontiguousarray(x[rows]), self.out_norm, cfg.rms_eps)
            logits = self.output(hs)  # [n_rows, vocab]
        else:
            logits = np.empty((0, cfg.vocab_size), dtype=np.float32)
        o = 0
        for n in counts:
            out.append(logits[o : o + n])
            o += n
        for c, n in zip(chunks, lens, strict=True):
            c.kv.length += n

        st = self.stats
        st.steps += 1
        st.tokens += T
        st.prefill_tokens += sum(n for n in lens if n > 1)
        st.decode_tokens += sum(1 for n in lens if n == 1)
        st.seconds += time.perf_counter() - t0
        return out
