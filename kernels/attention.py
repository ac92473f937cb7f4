"""Attention of the CPU backend: causal attention over per-sequence float16 KV arrays, attention
over one KV shard and the merge of shard results (Q-Ring), KV row stores.

KV layout (one array per sequence): float16 ``[n_layers, 2, n_kv_heads, capacity, head_dim]``
(index 1: 0 = K, 1 = V).  numba has no float16 type, so the kernels see the same memory as uint16
bit patterns (``kv_list`` makes those views) and convert with the CPU's half <-> single
instructions (exact; rounding to nearest even like numpy's ``astype``).

A query row's result depends only on that row (its query, position and keys): never on the other
rows of the batch or on the thread count (see ``_attention_rows``).  Prefill and decode are the
same kernel.  ``*_ref`` functions are float64 numpy references.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
from numba import types
from numba.typed import List as TypedList
from weaved.kernels._attention_batch import attend_batch, kv_store_batch
from weaved.kernels._attention_chunk import BLOCK, CHUNK
from weaved.kernels._attention_rows import attend_rows
from weaved.kernels.threads import on_kernel_thread

_SCRATCH_FLOATS = 1 << 22  # chunk partial results held at once (16 MiB); more rows are taken in groups
# work is cut into this many runs of about equal cost, one per thread of numba's pool (prange spreads
# them over however many threads are in use; the cut never changes a result)
_SLICES = max(1, numba.config.NUMBA_NUM_THREADS)
_KV_ITEM_TYPE = types.Array(types.uint16, 5, "C")
_NEG_INF = np.float32(-np.inf)


_BATCH_ERRORS = {
    1: "seq_starts must have len(pos0) + 1 entries and kvs one array per sequence",
    2: "seq_starts must rise from 0 to the number of rows",
    3: "pos0 must be >= 0",
    4: "kv array shape does not match (layer out of range, or n_kv_heads / head_dim differ)",
    5: "rows run past the kv array's capacity",
    6: "n_heads is not a multiple of the kv arrays' n_kv_heads",
}


def kv_list(arrays: Sequence[np.ndarray]) -> TypedList:
    """The numba list the kernels take: uint16 views of C-contiguous float16 kv arrays
    [n_layers, 2, n_kv_heads, capacity, head_dim]; writes through the views reach the arrays.
    Build it once per batch step and pass it to every layer's ``kv_store`` and ``attend``."""
    out = TypedList.empty_list(_KV_ITEM_TYPE)
    for i, a in enumerate(arrays):
        a = np.asarray(a)  # a memory map becomes a plain ndarray over the same memory
        if a.dtype != np.float16 or a.ndim != 5 or a.shape[1] != 2 or not a.flags.c_contiguous:
            raise ValueError(f"kv array {i} must be C-contiguous float16 [L, 2, Hkv, cap, D], "
                             f"got {a.dtype} {a.shape}")
        out.append(a.view(np.uint16))
    return out


def _as_kv_list(kvs) -> TypedList:
    if type(kvs) is TypedList:
        ty = kvs._numba_type_  # the list's numba type (how numba itself types the object)
        if ty.item_type != _KV_ITEM_TYPE:
            raise ValueError(f"kvs must hold uint16 views of float16 kv arrays (see kv_list), got {ty}")
        return kvs
    return kv_list(kvs)


def _check_array(name: str, a, dtype, shape: tuple) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
        desc = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{name} must be a C-contiguous {np.dtype(dtype).name} array of shape {shape}, "
                         f"got {desc}")


def _check_3d(name: str, a) -> tuple[int, int, int]:
    if not isinstance(a, np.ndarray) or a.ndim != 3:
        raise ValueError(f"{name} must be float32 [T, heads, head_dim], got {getattr(a, 'shape', type(a))}")
    _check_array(name, a, np.float32, a.shape)
    return a.shape


def _check_index_arrays(layer, seq_starts, pos0) -> None:
    if not isinstance(layer, int | np.integer):
        raise ValueError(f"layer must be an int, got {type(layer).__name__}")
    if not isinstance(seq_starts, np.ndarray) or seq_starts.dtype != np.int64 or seq_starts.ndim != 1:
        raise ValueError("seq_starts must be an int64 [S + 1] array")
    if not isinstance(pos0, np.ndarray) or pos0.dtype != np.int64 or pos0.ndim != 1:
        raise ValueError("pos0 must be an int64 [S] array")


def attention_params(n_heads: int, head_dim: int) -> tuple[int, int]:
    """(n_slices, max_items): how ``attend`` cuts its work (for callers of the compiled kernel)."""
    return _SLICES, _max_items(n_heads, head_dim)


def raise_batch_error(code: int, s: int) -> None:
    """Raise the ValueError of a batch kernel's (error code, sequence); nothing for code 0."""
    if code:
        raise ValueError(_BATCH_ERRORS[code] + (f" (sequence {s})" if s >= 0 else ""))


def kv_store(kvs, layer: int, seq_starts: np.ndarray, pos0: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """Store new K/V rows as float16: rows seq_starts[s] + i of k and v (float32 [T, n_kv_heads,
    head_dim]) go to kvs[s][layer, 0 and 1, :, pos0[s] + i, :].  kvs: ``kv_list`` of the batch's kv
    arrays (a plain sequence of float16 arrays is converted, at a cost)."""
    kvs = _as_kv_list(kvs)
    _check_3d("k", k)
    _check_array("v", v, np.float32, k.shape)
    _check_index_arrays(layer, seq_starts, pos0)
    raise_batch_error(*kv_store_batch(kvs, layer, seq_starts, pos0, k, v))


@on_kernel_thread
def attend(q: np.ndarray, kvs, layer: int, seq_starts: np.ndarray, pos0: np.ndarray, scale: float,
           out: np.ndarray, lse: np.ndarray, window: int = 0) -> None:
    """Causal attention of a ragged batch.  q float32 [T, n_heads, head_dim]; row i of sequence s
    (row seq_starts[s] + i) sits at position p = pos0[s] + i and attends keys 0..p of kvs[s]
    (already stored), or with ``window`` > 0 its last ``window`` keys (a sliding-window layer).
    Head h reads kv head h // (n_heads // n_kv_heads).  Writes out float32
    [T, n_heads, head_dim] and lse float32 [T, n_heads] = log(sum_j exp(score_j)) with score_j =
    scale * q.k_j.  kvs: ``kv_list`` of the batch's kv arrays, one per sequence.  A row's results
    are bit-identical whatever else is in the batch."""
    kvs = _as_kv_list(kvs)
    T, H, D = _check_3d("q", q)
    _check_array("out", out, np.float32, (T, H, D))
    _check_array("lse", lse, np.float32, (T, H))
    _check_index_arrays(layer, seq_starts, pos0)
    if T == 0:
        return
    if not isinstance(window, int | np.integer) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    scale32, max_items = np.float32(scale), _max_items(H, D)
    raise_batch_error(*attend_batch(q, kvs, layer, seq_starts, pos0, scale32, np.int64(window), out, lse, _SLICES,
                                    max_items))


@on_kernel_thread
def attend_partial(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Attention of every row of q (float32 [T, H, D]) over all L keys of one shard, no mask:
    k, v float16 [n_kv_heads, L, D] (e.g. ``kv[layer, 0, :, a:b]``; each head's [L, D] block
    contiguous, else it is copied).  Returns (out float32 [T, H, D], lse float32 [T, H]); an empty
    shard (L = 0) gives out 0 and lse -inf."""
    T, H, D = _check_3d("q", q)
    for name, a in (("k", k), ("v", v)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float16 or a.ndim != 3 or a.shape[2] != D:
            desc = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"{name} must be float16 [n_kv_heads, L, {D}], got {desc}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    n_kv, L = k.shape[0], k.shape[1]
    if n_kv == 0 or H % n_kv:
        raise ValueError(f"n_heads {H} is not a multiple of n_kv_heads {n_kv}")
    out = np.empty((T, H, D), np.float32)
    lse = np.empty((T, H), np.float32)
    if T == 0:
        return out, lse
    heads = [[_rows_block(a[g]) for g in range(n_kv)] for a in (k, v)]  # referenced until the kernel returns
    kaddr, vaddr = (np.tile(np.array([h.ctypes.data for h in hs], np.int64), (T, 1)) for hs in heads)
    n_keys = np.full(T, L, np.int64)
    attend_rows(q, kaddr, vaddr, n_keys, np.float32(scale), out, lse, _SLICES, _max_items(H, D))
    return out, lse


def _rows_block(a: np.ndarray) -> np.ndarray:
    """``a`` (float16 [L, D]) if its rows follow each other in memory (what the kernels read), else a copy."""
    if a.strides[1] == 2 and (a.shape[0] <= 1 or a.strides[0] == 2 * a.shape[1]):
        return a
    return np.ascontiguousarray(a)


def _max_items(n_heads: int, head_dim: int) -> int:
    """Chunks per group of rows whose partial results fit in _SCRATCH_FLOATS."""
    return max(1, _SCRATCH_FLOATS // (n_heads * (head_dim + 2)))


def merge_partials(out_a: np.ndarray, lse_a: np.ndarray, out_b: np.ndarray, lse_b: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Online-softmax merge, in float32, of two results over disjoint key sets: out [T, H, D] and
    lse [T, H] of each -> (out, lse) over the union.  m = max(lse_a, lse_b), wa = exp(lse_a - m),
    wb = exp(lse_b - m), out = (wa out_a + wb out_b) / (wa + wb), lse = m + log(wa + wb).  An empty
    part has lse = -inf (its out is ignored, even NaN); two empty parts give out 0, lse -inf."""
    for name, a, nd in (("out_a", out_a, 3), ("lse_a", lse_a, 2), ("out_b", out_b, 3), ("lse_b", lse_b, 2)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != nd:
            raise ValueError(f"{name} must be a float32 array with {nd} dims")
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:2] != lse_a.shape:
        raise ValueError(f"partial shapes differ: {out_a.shape} {lse_a.shape} {out_b.shape} {lse_b.shape}")
    m = np.maximum(lse_a, lse_b)
    m = np.where(np.isfinite(m), m, np.float32(0.0))  # both empty: avoid -inf - (-inf)
    wa = np.exp(lse_a - m)  # [T, H]; 0 for an empty part
    wb = np.exp(lse_b - m)
    total = wa + wb
    oa = np.where((wa > 0)[..., None], out_a, np.float32(0.0))
    ob = np.where((wb > 0)[..., None], out_b, np.float32(0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (wa[..., None] * oa + wb[..., None] * ob) / total[..., None]
        lse = m + np.log(total)
    empty = total == 0
    out[empty] = 0.0
    lse[empty] = _NEG_INF
    return out.astype(np.float32, copy=False), lse.astype(np.float32, copy=False)


# ---------------------------------------------------------------- references


def attend_partial_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float
                       ) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of q [T, H, D] over k, v [n_kv, L, D] (no mask) -> (out, lse) float64."""
    T, H, D = q.shape
    n_kv, L = k.shape[0], k.shape[1]
    G = H // n_kv
    k64 = np.repeat(k.astype(np.float64), G, axis=0)  # [H, L, D]
    v64 = np.repeat(v.astype(np.float64), G, axis=0)
    s = np.einsum("thd,hld->thl", q.astype(np.float64), k64) * scale  # [T, H, L]
    if L == 0:
        return np.zeros((T, H, D)), np.full((T, H), -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    tot = e.sum(axis=-1, keepdims=True)
    return np.einsum("thl,hld->thd", e / tot, v64), (m + np.log(tot))[..., 0]


def attend_ref(q: np.ndarray, kvs: Sequence[np.ndarray], layer: int, seq_starts: np.ndarray, pos0: np.ndarray,
               scale: float, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """float64 causal attention with the semantics of ``attend`` (kvs: float16 kv arrays)."""
    T, H, D = q.shape
    out = np.zeros((T, H, D))
    lse = np.zeros((T, H))
    for s in range(len(pos0)):
        for t in range(seq_starts[s], seq_starts[s + 1]):
            n = int(pos0[s] + t - seq_starts[s] + 1)
            lo = n - window if 0 < window < n else 0
            kv = kvs[s][layer, :, :, lo:n]  # [2, Hkv, n - lo, D]
            o, l_ = attend_partial_ref(q[t:t + 1], kv[0], kv[1], scale)
            out[t], lse[t] = o[0], l_[0]
    return out, lse


__all__ = ["BLOCK", "CHUNK", "kv_list", "kv_store", "attend", "attend_partial", "merge_partials",
           "attend_ref", "attend_partial_ref"]
