"""Every transformer layer of one step in a single compiled call.

A step of the CPU backend runs ~11 kernels per layer; called one by one from Python, each pays its
argument checks and numba's dispatch (a few microseconds), which is a quarter of a single-stream
decode step on SmolLM2 (30 layers, ~330 calls).  ``run_layers`` runs the same kernels, in the same
order and on the same arrays, from one numba function: RMSNorm, the fused q|k|v product (+ biases,
q/k norms), RoPE (each layer's: global or sliding-window), KV stores, attention (over a window on
sliding-window layers), the output product (+ its RMSNorm, gemma3) and residual, RMSNorm, the fused
gate|up product, SwiGLU or GeGLU, the down product (+ its RMSNorm) and residual - or, for a mixture of
experts, the router and the experts (``moe``).  The results are the Python loop's bits
(``CPUBackend.forward`` keeps that loop for layers this one does not take, and tests compare the
two).

The gemm (VNNI or portable, ``matmul.kernel_path``) is ``_gemm_driver``'s, its tile kernel chosen by
the dtype of a zero-size marker array (``matmul.gemm_marker``), so each path compiles - and is
cached - as its own specialization, and the VNNI one is never compiled on a CPU without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, types
from numba.typed import List as TypedList

from . import _gemm_driver
from ._attention_batch import attend_batch, kv_store_batch
from ._geglu import GELU_TABLE, geglu_drive
from ._rope import rope_drive
from ._rowwise import OPTS
from .elementwise import rmsnorm_drive, swiglu_drive
from .matmul import PAR_MIN_US, US_PER_BYTE, US_PER_TBLOCK, PackedWeight, gemm_marker
from .moe import experts_drive, route_drive
from .threads import on_kernel_thread

_EMPTY = np.zeros(0, np.uint8)  # a mixture of experts' dense FFN slots
_PACKED = types.Array(types.uint8, 1, "C", readonly=True)  # a PackedWeight's data (read-only once built)


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """The layers' matrices and vectors in the shapes ``run_layers`` takes (built once at load)."""

    mats: TypedList  # 4 per layer: q|k|v, o, gate|up, down packed data (uint8 [nbytes])
    qk: np.ndarray  # int64 [L, 4]: 4 (Q4_0) or 8 (Q8_0) per matrix
    n_out: np.ndarray  # int64 [4]: rows of each matrix kind
    est: np.ndarray  # float64 [L, 4, 3]: us per product (bytes term, per-token term), row tiles
    attn_norm: np.ndarray  # float32 [L, d_model]
    ffn_norm: np.ndarray  # float32 [L, d_model]
    bias: np.ndarray  # float32 [L, q_dim + 2 kv_dim] or [0, 0]
    q_norm: np.ndarray  # float32 [L, head_dim] or [0, 0]
    k_norm: np.ndarray  # float32 [L, head_dim] or [0, 0]
    post_attn_norm: np.ndarray  # float32 [L, d_model] or [0, 0] (gemma3)
    post_ffn_norm: np.ndarray  # float32 [L, d_model] or [0, 0]
    window: np.ndarray  # int64 [L]: keys a query attends (0: all)
    gelu: bool  # GeGLU (else SwiGLU)
    # a mixture of experts (``kernels.moe``; gate|up and down above are then placeholders): every layer's
    # router float32 [L, E, d] ([0, 0, 0]: dense), each layer's experts' packed gate|up and down data
    # (expert e of layer li at li * E + e), their types (Q4_0: 4, Q8_0: 8), experts a token, expert FFN length
    moe_router: np.ndarray
    moe_gu: TypedList
    moe_down: TypedList
    moe_qk: np.ndarray  # int64 [2]
    moe_k: int
    moe_ff: int

    @classmethod
    def build(cls, layers: list, cfg) -> LayerWeights | None:
        """From the CPU backend's ``_Layer`` list; None when a layer has a matrix this loop does not
        run (split products of mixed types, float weights) - the Python loop runs those models."""
        mats = TypedList()
        qk, est = [], []
        moe = cfg.n_experts > 0
        gu, down = TypedList.empty_list(_PACKED), TypedList.empty_list(_PACKED)
        for L in layers:
            ws = (L.wqkv, L.wo) if moe else (L.wqkv, L.wo, L.wgu, L.wdown)
            if not all(isinstance(w, PackedWeight) and w.qk for w in ws):
                return None
            for w in ws:
                mats.append(w.data)
            qk.append([w.qk for w in ws] + ([4, 4] if moe else []))
            est.append([[w.data.nbytes * US_PER_BYTE, w.tblocks * US_PER_TBLOCK, w.nt] for w in ws]
                       + ([[0.0, 0.0, 1.0]] * 2 if moe else []))
            if moe:  # the dense FFN's two slots stay empty
                mats.append(_EMPTY)
                mats.append(_EMPTY)
                for e in range(L.experts.n_experts):
                    gu.append(L.experts.gu_data[e])
                    down.append(L.experts.down_data[e])
        L0 = layers[0]
        if moe:
            n_out = np.array([L0.wqkv.n_out, L0.wo.n_out, 2, 1], np.int64)
            router = np.ascontiguousarray(np.stack([L.experts.router for L in layers]), np.float32)
            moe_qk = np.array([L0.experts.qk_gu, L0.experts.qk_down], np.int64)
            moe_args = (router, gu, down, moe_qk, cfg.n_experts_used, cfg.d_ff_expert)
        else:
            n_out = np.array([w.n_out for w in (L0.wqkv, L0.wo, L0.wgu, L0.wdown)], np.int64)
            moe_args = (np.zeros((0, 0, 0), np.float32), gu, down, np.zeros(2, np.int64), 0, 0)

        def stack(name):
            v = getattr(L0, name)
            if v is None:
                return np.zeros((0, 0), np.float32)
            return np.ascontiguousarray(np.stack([getattr(L, name) for L in layers]), np.float32)

        return cls(mats, np.array(qk, np.int64), n_out,
                   np.array(est, np.float64), stack("attn_norm"), stack("ffn_norm"), stack("bqkv"),
                   stack("q_norm"), stack("k_norm"), stack("post_attn_norm"), stack("post_ffn_norm"),
                   np.array([cfg.layer_window(i) for i in range(len(layers))], np.int64), cfg.act == "gelu",
                   *moe_args)


@njit(**OPTS)
def _threads_for(est, li, m, T, nthreads):
    """``matmul._plan`` inside the loop: small products stay on the calling thread."""
    us = max(est[li, m, 0], est[li, m, 1] * T)
    return 1 if nthreads == 1 or us < PAR_MIN_US else min(nthreads, np.int64(est[li, m, 2]))


@njit(**OPTS)
def _product(mk, mats, qk, n_out, est, li, m, X, nthreads, Y, noq, nod, nos):
    """Y = X @ W.T for matrix m (0 q|k|v, 1 o, 2 gate|up, 3 down) of layer li; X is quantized inside."""
    nch = _threads_for(est, li, m, X.shape[0], nthreads)
    if nch == 1:
        _gemm_driver.run_serial(mk, mats[4 * li + m], qk[li, m], n_out[m], X, noq, nod, nos, Y)
    else:
        _gemm_driver.run_par(mk, mats[4 * li + m], qk[li, m], n_out[m], X, noq, nod, nos, Y, nch)


@njit(**OPTS)
def _residual(x, y, post_norm, li, eps, h):
    """x += y, or x += rmsnorm(y) * post_norm[li] when the model has post norms (h: scratch)."""
    if post_norm.shape[0]:
        rmsnorm_drive(y, post_norm[li], eps, h)
        x += h
    else:
        x += y


@njit(**OPTS)
def _layers(mk, w, x, positions, kvs, seq_starts, pos0, n_heads, n_kv, head_dim, eps, rope_g, rope_s, scale,
            n_slices, max_items, nthreads, gelu_table):
    """Layers 0..L-1 in place on x float32 [T, d_model]; returns (error code, sequence) of the first
    KV check that failed (``_attention_batch._check_batch``), (0, -1) when all ran.  w: the fields of
    ``LayerWeights`` as a tuple; rope_g / rope_s: ``rope_params`` of global / sliding-window layers."""
    mats, qk, n_out, est, attn_norm, ffn_norm, bias, q_norm, k_norm, post_attn, post_ffn, window, gelu = w[:13]
    moe_router, moe_gu, moe_down, moe_qk, moe_k, moe_ff = w[13:]
    T = x.shape[0]
    qd, kd = n_heads * head_dim, n_kv * head_dim
    noq, nod, nos = np.empty((0, 0, 32), np.int8), np.empty((0, 0), np.float32), np.empty((0, 0), np.int32)
    h = np.empty_like(x)  # [T, d_model]
    qkv = np.empty((T, n_out[0]), np.float32)
    y = np.empty_like(x)
    gu = np.empty((T, n_out[2]), np.float32)
    act = np.empty((T, n_out[2] // 2), np.float32)
    att = np.empty((T, n_heads, head_dim), np.float32)
    lse = np.empty((T, n_heads), np.float32)
    ids, wts = np.empty((T, max(1, moe_k)), np.int32), np.empty((T, max(1, moe_k)), np.float32)
    for li in range(attn_norm.shape[0]):
        rmsnorm_drive(x, attn_norm[li], eps, h)
        _product(mk, mats, qk, n_out, est, li, 0, h, nthreads, qkv, noq, nod, nos)
        if bias.shape[0]:
            qkv += bias[li]
        q = qkv[:, :qd].copy().reshape(T, n_heads, head_dim)
        k = qkv[:, qd:qd + kd].copy().reshape(T, n_kv, head_dim)
        v = qkv[:, qd + kd:].copy().reshape(T, n_kv, head_dim)
        if q_norm.shape[0]:
            qr, kr = q.reshape(T * n_heads, head_dim), k.reshape(T * n_kv, head_dim)
            rmsnorm_drive(qr, q_norm[li], eps, qr)
            rmsnorm_drive(kr, k_norm[li], eps, kr)
        if window[li]:
            rope_drive(q, positions, rope_s)
            rope_drive(k, positions, rope_s)
        else:
            rope_drive(q, positions, rope_g)
            rope_drive(k, positions, rope_g)
        code, bad = kv_store_batch(kvs, li, seq_starts, pos0, k, v)
        if code:
            return code, bad
        code, bad = attend_batch(q, kvs, li, seq_starts, pos0, scale, window[li], att, lse, n_slices, max_items)
        if code:
            return code, bad
        _product(mk, mats, qk, n_out, est, li, 1, att.reshape(T, qd), nthreads, y, noq, nod, nos)
        _residual(x, y, post_attn, li, eps, h)
        rmsnorm_drive(x, ffn_norm[li], eps, h)
        if moe_k:
            route_drive(h, moe_router[li], moe_k, ids, wts, nthreads)
            n_exp = moe_router.shape[1]
            experts_drive(mk, h, ids, wts, moe_gu, moe_down, li * n_exp, n_exp, moe_qk[0], moe_qk[1], moe_ff,
                          nthreads, y)
        else:
            _product(mk, mats, qk, n_out, est, li, 2, h, nthreads, gu, noq, nod, nos)
            if gelu:
                geglu_drive(gu, act, gelu_table)
            else:
                swiglu_drive(gu, act)
            _product(mk, mats, qk, n_out, est, li, 3, act, nthreads, y, noq, nod, nos)
        _residual(x, y, post_ffn, li, eps, h)
    return 0, -1


@on_kernel_thread
def run_layers(w: LayerWeights, x: np.ndarray, positions: np.ndarray, kvs: TypedList, seq_starts: np.ndarray,
               pos0: np.ndarray, shape: tuple[int, int, int], eps: float, rope: tuple, rope_swa: tuple,
               scale: float, attention: tuple[int, int], threads: int) -> tuple[int, int]:
    """Every layer in place on x float32 [T, d_model] (C-contiguous) at ``positions`` int64 [T].

    kvs, seq_starts, pos0: as ``attention.attend``; shape: (n_heads, n_kv_heads, head_dim); rope /
    rope_swa: ``_rope.rope_params`` of the global and the sliding-window layers (the same tuple when
    the model has no windows); attention: (n_slices, max_items) as ``attention.attend`` computes
    them.  Returns (error code, sequence) of a failed KV check ((0, -1) when all ran) for the caller
    to raise."""
    H, Hkv, D = shape
    fields = (w.mats, w.qk, w.n_out, w.est, w.attn_norm, w.ffn_norm, w.bias, w.q_norm, w.k_norm, w.post_attn_norm,
              w.post_ffn_norm, w.window, w.gelu, w.moe_router, w.moe_gu, w.moe_down, w.moe_qk, w.moe_k, w.moe_ff)
    return _layers(gemm_marker(), fields, x, positions, kvs, seq_starts, pos0, H, Hkv, D, np.float32(eps), rope,
                   rope_swa, np.float32(scale), attention[0], attention[1], threads, GELU_TABLE)
