"""Products with float32 activations on Q4_0 / Q8_0 weights (no activation quantization).

The CPU backend uses this for the output (logits) matrix only; see ``_gemm_f32act`` for why and
for the recipe.  F16 / F32 weights already run with float activations (``matmul.linear``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _gemm_f32act
from .ggml import BLOCK_BYTES, BLOCK_ELEMS, GGMLType, as_ggml_type, row_bytes
from .threads import get_threads

# below this much work (rows x tokens) a parallel region costs more than it saves
_PAR_MIN_ROWS = 4096


@dataclass(frozen=True, eq=False)
class F32ActWeight:
    qtype: GGMLType
    n_out: int
    n_in: int
    _w8: np.ndarray = field(repr=False)  # int8 [nt, nb, 32, RT]
    _d: np.ndarray = field(repr=False)  # float32 [nt, nb, RT]

    @property
    def nbytes(self) -> int:
        return int(self._w8.nbytes + self._d.nbytes)


def pack_weight_f32act(raw: np.ndarray, qtype: GGMLType | int, n_out: int, n_in: int) -> F32ActWeight:
    """Repack a Q4_0 / Q8_0 GGUF tensor (uint8 [n_out, row_bytes]) for ``linear_f32act``."""
    qt = as_ggml_type(qtype)
    if qt not in (GGMLType.Q4_0, GGMLType.Q8_0):
        raise ValueError(f"pack_weight_f32act: needs Q4_0 or Q8_0 weights, got {qt.name}")
    rb = row_bytes(qt, n_in)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.shape != (n_out, rb):
        raise ValueError(f"pack_weight_f32act: {qt.name} [{n_out}, {n_in}] needs uint8 [{n_out}, {rb}], "
                         f"got {raw.dtype} {raw.shape}")
    nb = n_in // BLOCK_ELEMS
    blk = raw.reshape(n_out, nb, BLOCK_BYTES[qt])
    d = blk[:, :, :2].copy().view(np.float16).astype(np.float32).reshape(n_out, nb)
    if qt == GGMLType.Q8_0:
        q = blk[:, :, 2:].copy().view(np.int8).reshape(n_out, n_in)
    else:  # low nibbles are elements 0..15, high nibbles 16..31; value q - 8
        nib = blk[:, :, 2:]
        q = (np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.int8) - 8).reshape(n_out, n_in)
    w8, ds = _gemm_f32act.pack(q, d)
    return F32ActWeight(qt, int(n_out), int(n_in), w8, ds)


def linear_f32act(w: F32ActWeight, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x float32 [T, n_in] (C-contiguous) -> float32 [T, n_out] = x @ W.T, batch invariant."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != w.n_in \
            or not x.flags.c_contiguous:
        raise ValueError(f"linear_f32act: x must be a C-contiguous float32 [T, {w.n_in}] array, got "
                         f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}")
    T = x.shape[0]
    if out is None:
        out = np.empty((T, w.n_out), np.float32)
    elif out.dtype != np.float32 or out.shape != (T, w.n_out) or not out.flags.c_contiguous:
        raise ValueError(f"linear_f32act: out must be C-contiguous float32 [{T}, {w.n_out}]")
    if T == 0:
        return out
    nch = min(get_threads(), w._w8.shape[0])
    if nch > 1 and w.n_out * T >= _PAR_MIN_ROWS:
        _gemm_f32act.run_par(w._w8, w._d, w.n_out, x, out, nch)
    else:
        _gemm_f32act.run_serial(w._w8, w._d, w.n_out, x, out)
    return out
