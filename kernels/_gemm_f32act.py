"""y = x @ W.T for Q4_0 / Q8_0 weights with float32 activations (no activation quantization).

Used for the output (logits) matrix: quantizing the final hidden state to Q8_0 is the largest
single source of error in the next-token distribution (measured on SmolLM2-135M: mean KL from a
float64 reference 0.0035 with Q8_0 activations, 0.0026 with float activations at this layer), and
one row per sequence is cheap enough to compute in float.

Layout: int8 weights ``[nt, nb, 32, RT]`` (the block's 32 values of the tile's 32 rows, rows in
lanes; Q4_0 nibbles become q - 8) and float32 scales ``[nt, nb, RT]``.  Per output element the
float operations are fixed: per block ``s = fma(w_k, x_k, s)`` for k = 0..31, then
``acc = fma(s, d, acc)`` in block order - batch invariant, vectorized across the 32 rows.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import F32, I8, I32, I64, V16F, V32F, V32I8, c64, fn, ptr, splat
from ._pack import RT

_OPTS = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False)
QK = 32


def pack(q: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q int8 [n_out, n_in] (values as dequantized = q * d), d float32 [n_out, n_in // 32] ->
    (int8 [nt, nb, 32, RT], float32 [nt, nb, RT]), rows past n_out zero."""
    n_out, n_in = q.shape
    nt, nb = -(-n_out // RT), n_in // QK
    qp = np.zeros((nt * RT, n_in), np.int8)
    dp = np.zeros((nt * RT, nb), np.float32)
    qp[:n_out], dp[:n_out] = q, d
    w8 = np.ascontiguousarray(qp.reshape(nt, RT, nb, QK).transpose(0, 2, 3, 1))  # [nt, nb, 32, RT]
    ds = np.ascontiguousarray(dp.reshape(nt, RT, nb).transpose(0, 2, 1))  # [nt, nb, RT]
    return w8, ds


@intrinsic
def _tile_col(typingctx, W8, D, t, X, c, out):
    """out[0:RT] = rows of tile t times column c of X (the module docstring's recipe).

    Explicit <16 x float> IR: plain numba loops kept the 32 partial sums in memory and ran ~3x
    slower.  Two 16-lane accumulators per block sum, two for the result; no fast-math flags."""
    sig = types.void(W8, D, t, X, c, out)

    def codegen(context, builder, signature, args):
        W8v, Dv, tv, Xv, cv, outv = args
        sa = signature.args
        wa = context.make_array(sa[0])(context, builder, W8v)
        da = context.make_array(sa[1])(context, builder, Dv)
        xa = context.make_array(sa[3])(context, builder, Xv)
        oa = context.make_array(sa[5])(context, builder, outv)
        nb = builder.extract_value(wa.shape, 1)
        w8 = builder.bitcast(wa.data, I8.as_pointer())
        wt = builder.gep(w8, [builder.mul(tv, builder.mul(nb, c64(QK * RT)))])
        dt = builder.gep(da.data, [builder.mul(tv, builder.mul(nb, c64(RT)))])
        xs = builder.extract_value(xa.strides, 0)
        xrow = builder.bitcast(builder.gep(builder.bitcast(xa.data, I8.as_pointer()), [builder.mul(cv, xs)]),
                               F32.as_pointer())
        fma = fn(builder, "llvm.fma.v16f32", V16F, [V16F, V16F, V16F])
        zero = ir.Constant(V16F, [0.0] * 16)
        lo_idx = ir.Constant(ir.VectorType(I32, 16), list(range(16)))
        hi_idx = ir.Constant(ir.VectorType(I32, 16), list(range(16, 32)))
        acc = [cgutils.alloca_once_value(builder, zero) for _ in range(2)]
        with cgutils.for_range(builder, nb, intp=I64) as lb:
            b = lb.index
            s0 = s1 = zero
            wb = builder.gep(wt, [builder.mul(b, c64(QK * RT))])
            for k in range(QK):
                wv = builder.load(ptr(builder, wb, c64(k * RT), V32I8), align=1)
                wf = builder.sitofp(wv, V32F)
                xk = splat(builder, builder.load(builder.gep(xrow, [builder.add(builder.mul(b, c64(QK)), c64(k))])),
                           V16F)
                s0 = builder.call(fma, [builder.shuffle_vector(wf, wf, lo_idx), xk, s0])
                s1 = builder.call(fma, [builder.shuffle_vector(wf, wf, hi_idx), xk, s1])
            db = builder.gep(dt, [builder.mul(b, c64(RT))])
            for g, sg in enumerate((s0, s1)):
                dv = builder.load(builder.bitcast(builder.gep(db, [c64(16 * g)]), V16F.as_pointer()), align=4)
                builder.store(builder.call(fma, [sg, dv, builder.load(acc[g])]), acc[g])
        for g in range(2):
            builder.store(builder.load(acc[g]),
                          builder.bitcast(builder.gep(oa.data, [c64(16 * g)]), V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(**_OPTS)
def _tiles(W8, D, t0, t1, n_out, X, Y):
    out = np.empty(RT, np.float32)
    for t in range(t0, t1):
        nr = min(RT, n_out - t * RT)
        for c in range(X.shape[0]):
            _tile_col(W8, D, t, X, c, out)
            for r in range(nr):
                Y[c, t * RT + r] = out[r]


@njit(**_OPTS)
def run_serial(W8, D, n_out, X, Y):
    _tiles(W8, D, 0, W8.shape[0], n_out, X, Y)


@njit(parallel=True, **_OPTS)
def run_par(W8, D, n_out, X, Y, nch):
    nt = W8.shape[0]
    for k in prange(nch):
        _tiles(W8, D, nt * k // nch, nt * (k + 1) // nch, n_out, X, Y)
