"""Weight matrices repacked once at load, and y = x @ W.T on them.

Q4_0 / Q8_0 weights: every activation row is quantized to Q8_0; each output element is the exact
int32 dot of every 32-block, scaled and summed in block order b = 0..nb-1 as
``acc = fma(float(isum_b), d_w[b] * d_x[b], acc)``.  F16 / F32 weights: one float fma chain over the
input in order.  Either way row t of the result depends only on row t of x: bit-identical whatever
the other rows, their number, or the thread split (batch invariance).

Kernels are picked at run time: AVX-512 VNNI tiles (``_gemm_vnni``) where the CPU has it, else
target-independent vector IR (``_gemm_portable``, the same bits), both driven by ``_gemm_driver``.
``WEAVE_KERNELS=portable`` forces the portable path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from . import _gemm_driver, _gemm_float, _pack
from ._pack import RT
from .ggml import BLOCK_BYTES, BLOCK_ELEMS, GGMLType, as_ggml_type, row_bytes
from .quants import Q8Activations, dequantize_rows
from .threads import cpu_features, get_threads, on_kernel_thread

__all__ = ["PackedWeight", "pack_weight", "concat_rows", "linear", "linear_q", "padded_out", "embed_rows",
           "packed_rows",
           "kernel_path", "set_kernel_path", "vnni_supported"]

_VNNI_FEATURES = frozenset({"avx512f", "avx512bw", "avx512_vnni"})
_QK = {GGMLType.Q4_0: 4, GGMLType.Q8_0: 8}


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A [n_out, n_in] weight matrix in the kernels' layout (see ``_pack``).  Read-only once built."""

    qtype: GGMLType
    n_out: int
    n_in: int
    # Q4_0/Q8_0: uint8 [nt * nb * TB], 64-byte aligned; F16/F32: float32 [nt, n_in, RT]
    data: np.ndarray = field(repr=False)
    qk: int = field(repr=False, default=0)  # 4: Q4_0, 8: Q8_0, 0: float weights
    nt: int = field(repr=False, default=0)  # row tiles
    tblocks: int = field(repr=False, default=0)  # tiles x blocks: 32x32 dot products per token

    @property
    def nbytes(self) -> int:
        """Bytes of the packed matrix (what one product streams from memory)."""
        return int(self.data.nbytes)


def vnni_supported() -> bool:
    """True when this CPU has AVX-512 F/BW/VNNI and numba compiles for it (not for another CPU
    named by NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)."""
    import numba

    host = numba.config.CPU_NAME in (None, "", "host") and not numba.config.CPU_FEATURES
    return host and _VNNI_FEATURES <= cpu_features()


_forced: str | None = None  # set_kernel_path's choice
_marker: np.ndarray | None = None  # the gemm driver's marker for the path in use, resolved on first use


def set_kernel_path(name: str | None) -> None:
    """Force "vnni" or "portable" kernels; None goes back to WEAVE_KERNELS and CPU detection (and
    re-reads WEAVE_KERNELS)."""
    global _forced, _marker
    if name not in (None, "vnni", "portable"):
        raise ValueError(f"kernel path must be 'vnni', 'portable' or None, got {name!r}")
    if name == "vnni" and not vnni_supported():
        raise ValueError("this CPU lacks AVX-512 VNNI (avx512f, avx512bw, avx512_vnni)")
    _forced, _marker = name, None


def kernel_path() -> str:
    """The Q4_0/Q8_0 gemm in use: "vnni" or "portable" (WEAVE_KERNELS=portable forces the latter;
    "vnni" is used only where the CPU has it)."""
    if _forced is not None:
        return _forced
    env = os.environ.get("WEAVE_KERNELS", "").strip().lower()
    if env not in ("", "auto", "vnni", "portable"):
        raise ValueError(f"WEAVE_KERNELS must be 'auto', 'vnni' or 'portable', got {env!r}")
    return "vnni" if env != "portable" and vnni_supported() else "portable"


def gemm_marker() -> np.ndarray:
    """The zero-size array that selects the tile kernel of the path in use in ``_gemm_driver`` (and in
    the compiled layer loop)."""
    global _marker
    if _marker is None:
        vnni = kernel_path() == "vnni"
        _marker = _gemm_driver.VNNI_MARKER if vnni else _gemm_driver.PORTABLE_MARKER
    return _marker


def _nch(n_tiles: int) -> int:
    return max(1, min(get_threads(), n_tiles))


@on_kernel_thread
def pack_weight(raw: np.ndarray, qtype: GGMLType | int, n_out: int, n_in: int) -> PackedWeight:
    """Repack a GGUF tensor (uint8 [n_out, row_bytes] for Q4_0/Q8_0; float16/float32 [n_out, n_in]
    for F16/F32, as gguf.GGUFReader gives it) into the kernels' layout.  The result is a copy."""
    qt = as_ggml_type(qtype)
    if n_out < 1 or n_in < 1:
        raise ValueError(f"pack_weight: need n_out, n_in >= 1, got {n_out}, {n_in}")
    raw = np.asarray(raw)
    nt = (n_out + RT - 1) // RT
    if qt in _QK:
        rb = row_bytes(qt, n_in)
        if raw.dtype != np.uint8 or raw.shape != (n_out, rb):
            raise ValueError(f"pack_weight: {qt.name} [{n_out}, {n_in}] needs uint8 [{n_out}, {rb}], "
                             f"got {raw.dtype} {raw.shape}")
        nb = n_in // BLOCK_ELEMS
        tb = _pack.TB_Q4 if qt == GGMLType.Q4_0 else _pack.TB_Q8
        data = _pack.aligned_empty(nt * nb * tb)
        _pack.pack_quant(np.ascontiguousarray(raw), _QK[qt], n_out, data, _nch(nt))
    else:
        want = np.float32 if qt == GGMLType.F32 else np.float16
        if raw.dtype != want or raw.shape != (n_out, n_in):
            raise ValueError(f"pack_weight: {qt.name} needs {np.dtype(want).name} [{n_out}, {n_in}], "
                             f"got {raw.dtype} {raw.shape}")
        data = np.zeros((nt, n_in, RT), np.float32)
        _pack.pack_float(np.ascontiguousarray(raw, dtype=np.float32), data, _nch(nt))
    data.flags.writeable = False
    return PackedWeight(qt, int(n_out), int(n_in), data, _QK.get(qt, 0), nt, nt * (-(-n_in // BLOCK_ELEMS)))


def concat_rows(raws: list[np.ndarray]) -> np.ndarray:
    """Stack raw tensors of one type and one input size by output rows (fuses q|k|v or gate|up into
    one matrix: one activation quantization and one parallel region instead of several)."""
    if not raws:
        raise ValueError("concat_rows: need at least one tensor")
    arrs = [np.asarray(r) for r in raws]
    a0 = arrs[0]
    for a in arrs:
        if a.ndim != 2 or a.dtype != a0.dtype or a.shape[1] != a0.shape[1]:
            raise ValueError("concat_rows: tensors must be 2-D with the same dtype and row length, got "
                             + ", ".join(f"{a.dtype} {a.shape}" for a in arrs))
    return np.concatenate(arrs, axis=0)


def _check_out(out: np.ndarray | None, T: int, n_out: int) -> np.ndarray:
    if out is None:
        return np.empty((T, n_out), np.float32)
    if type(out) is not np.ndarray or out.dtype != np.float32 or out.ndim != 2 or out.shape[0] != T \
            or out.shape[1] < n_out or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous float32 [{T}, >= {n_out}] array, got "
                         f"{getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}")
    return out


# Row padding of a product's output: rows n_out floats apart are 4 KiB-aliased whenever n_out * 4 is
# a multiple of 4096 (the 49152-logit rows are 192 KiB apart), so a tile's stores to every row land
# in one L1 and one L2 set.  64 more bytes per row spread them (measured: the 64-token logits
# product 12.3 -> 9.0 ms).
ROW_PAD = 16


def padded_out(T: int, n_out: int) -> np.ndarray:
    """A float32 [T, n_out + ROW_PAD] array for ``out=`` when n_out floats are a multiple of 4 KiB;
    the product fills columns 0..n_out-1 (take ``[:, :n_out]``)."""
    pad = ROW_PAD if (n_out * 4) % 4096 == 0 else 0
    return np.empty((T, n_out + pad), np.float32)


# stand-ins for the activation arrays when the kernels quantize x themselves (zero-size, right types)
_NO_Q, _NO_D, _NO_S = np.empty((0, 0, 32), np.int8), np.empty((0, 0), np.float32), np.empty((0, 0), np.int32)


@on_kernel_thread
def linear(w: PackedWeight, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x float32 [T, n_in] (C-contiguous) -> float32 [T, n_out] = x @ W.T (into ``out`` if given:
    C-contiguous float32 [T, m >= n_out], whose columns n_out.. are left as they are; see
    ``padded_out``).  For Q4_0 / Q8_0 weights x is quantized to Q8_0 first (as
    ``quantize_activations``)."""
    if type(x) is not np.ndarray or x.dtype != _F32 or x.ndim != 2 or x.shape[1] != w.n_in \
            or not x.flags.c_contiguous:
        contig = "" if not isinstance(x, np.ndarray) or x.flags.c_contiguous else " (not C-contiguous)"
        raise ValueError(f"linear: x must be a C-contiguous float32 [T, {w.n_in}] array, got "
                         f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}{contig}")
    T = x.shape[0]
    out = np.empty((T, w.n_out), _F32) if out is None else _check_out(out, T, w.n_out)
    if T == 0:
        return out
    data = w.data
    if w.qk:
        _run(w, x, _NO_Q, _NO_D, _NO_S, out)
    else:
        nch = _nch(data.shape[0])
        if nch == 1:
            _gemm_float.linear_float_serial(data, w.n_out, x, out)
        else:
            _gemm_float.linear_float_par(data, w.n_out, x, out, nch)
    return out


@on_kernel_thread
def linear_q(w: PackedWeight, qx: Q8Activations, out: np.ndarray | None = None) -> np.ndarray:
    """``linear`` with activations already quantized (one quantization shared by several weights
    that read the same input).  Q4_0 / Q8_0 weights only."""
    if not w.qk:
        raise ValueError(f"linear_q: needs Q4_0 or Q8_0 weights, got {w.qtype.name} (use linear)")
    if not isinstance(qx, Q8Activations) or qx.n_in != w.n_in:
        raise ValueError(f"linear_q: qx must be Q8Activations with n_in = {w.n_in}, got "
                         f"{getattr(qx, 'n_in', type(qx))}")
    T = qx.n_tokens
    nb = w.n_in // BLOCK_ELEMS
    for a, dt, shp in ((qx.q, np.int8, (nb, T, BLOCK_ELEMS)), (qx.d, np.float32, (nb, T)),
                       (qx.s, np.int32, (nb, T))):
        if a.dtype != dt or a.shape != shp or not a.flags.c_contiguous:
            raise ValueError(f"linear_q: malformed Q8Activations array {a.dtype} {a.shape} "
                             f"(want C-contiguous {np.dtype(dt)} {shp})")
    out = np.empty((T, w.n_out), _F32) if out is None else _check_out(out, T, w.n_out)
    if T:
        _run(w, _no_rows(w.n_in), qx.q, qx.d, qx.s, out)
    return out


_F32 = np.dtype(np.float32)
_NO_ROWS: dict[int, np.ndarray] = {}


def _no_rows(n_in: int) -> np.ndarray:
    """float32 [0, n_in]: tells the kernels that the activations come already quantized."""
    a = _NO_ROWS.get(n_in)
    if a is None:
        a = _NO_ROWS[n_in] = np.empty((0, n_in), np.float32)
    return a


def _run(w: PackedWeight, x: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
         out: np.ndarray) -> None:
    """out = x @ W.T through the Q8_0 gemm (x's rows, if any, quantized first)."""
    nch = _plan(w, out.shape[0])
    mk = _marker if _marker is not None else gemm_marker()
    if nch == 1:
        _gemm_driver.run_serial(mk, w.data, w.qk, w.n_out, x, xq, xd, xs, out)
    else:
        _gemm_driver.run_par(mk, w.data, w.qk, w.n_out, x, xq, xd, xs, out, nch)


def _plan(w: PackedWeight, T: int) -> int:
    """Threads for one product: a parallel region costs ~5 us to start and end, so small products
    (estimated from bytes streamed and tile-block dot products) stay on the calling thread."""
    n = get_threads()
    if n == 1:
        return 1
    est_us = max(w.data.nbytes * US_PER_BYTE, w.tblocks * T * US_PER_TBLOCK)
    return 1 if est_us < PAR_MIN_US else min(n, w.nt)


# cost model of _plan: ~7 ns per 32x32 block dot (a Zen 4 core); bytes at what one core streams from
# DRAM on a slow server, 8 GB/s (a Sapphire Rapids VM's core: 9-10 GB/s; a Zen 4 desktop core: 25).
# The slow rate errs toward splitting mid-sized products: where a core streams faster that costs a
# region's ~5 us, where it does not a serial product takes twice as long (SmolLM2's q|k|v and output
# products, 311 and 187 KB, ran serially at ~8 GB/s: 2 ms of a 9 ms decode token on that VM).
US_PER_BYTE = 1 / 8e3
US_PER_TBLOCK = 7e-3
PAR_MIN_US = 16.0


def packed_rows(w: PackedWeight, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of a packed Q4_0 / Q8_0 matrix as the GGUF stores them: uint8 [len(ids), row_bytes]
    (the packing undone; ``embed_rows`` takes them)."""
    if not w.qk:
        raise ValueError(f"packed_rows: needs Q4_0 or Q8_0 weights, got {w.qtype.name}")
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= w.n_out)):
        raise ValueError(f"packed_rows: ids must be a 1-D array of rows in [0, {w.n_out})")
    out = np.empty((ids.size, row_bytes(w.qtype, w.n_in)), np.uint8)
    if ids.size:
        _pack.unpack_rows(w.data, w.qk, w.n_in // BLOCK_ELEMS, ids, out)
    return out


def embed_rows(raw: np.ndarray, qtype: GGMLType | int, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of a GGUF tensor (uint8 [n_rows, row_bytes] for Q4_0/Q8_0, float16/float32
    [n_rows, n_in]), dequantized to float32 [len(ids), n_in] exactly as gguf.quants.dequantize."""
    qt = as_ggml_type(qtype)
    raw = np.asarray(raw)
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"embed_rows: ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if raw.ndim != 2:
        raise ValueError(f"embed_rows: raw must be 2-D, got {raw.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= raw.shape[0]):
        raise ValueError(f"embed_rows: ids must lie in [0, {raw.shape[0]}), got {ids.min()}..{ids.max()}")
    if qt in _QK:
        bsz = BLOCK_BYTES[qt]
        if raw.dtype != np.uint8 or raw.shape[1] % bsz:
            raise ValueError(f"embed_rows: {qt.name} needs uint8 [n, nb*{bsz}], got {raw.dtype} {raw.shape}")
        rows = np.ascontiguousarray(raw[ids])  # [len(ids), row_bytes]
        out = np.empty((ids.size, raw.shape[1] // bsz * BLOCK_ELEMS), np.float32)
        if ids.size:
            dequantize_rows(rows, _QK[qt], out, 0, ids.size)
        return out
    want = np.float32 if qt == GGMLType.F32 else np.float16
    if raw.dtype != want:
        raise ValueError(f"embed_rows: {qt.name} needs {np.dtype(want).name} rows, got {raw.dtype}")
    return raw[ids].astype(np.float32)

