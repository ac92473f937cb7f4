"""The second activation level of the logits product, added to the candidate logits of each row.

``residual.linear_residual`` computes every logit with one-level Q8_0 activations (the batched
gemm), then calls ``refine_rows``: in each row, every logit within ``margin`` of the row's largest
gets the second level's product (the first level's rounding error, quantized) added.  The rule
reads values only, so the candidate set is a function of the row alone (batch invariance), and
another backend reproduces it exactly (``torch_q4.linear_residual``).

One correction follows the gemm kernels' recipe op for op: per 32-block the exact integer dot of
the weight's and the activation's quants, ``s = d_w * d_x`` and ``acc = fma(float(isum), s, acc)``
in block order from 0.0; then ``y = y1 + acc``.  So each refined logit is bit-identical to the full
two-level product's.  Weights are read from the gemm's packed tiles (a row's block is five or nine
cache lines of its tile, and a row's blocks are one tile's contiguous run), so the refinement never
touches the model file: reading the file's rows mapped whole page-cache folios into the process
(~650 KB a row), which then had to be unmapped every step - 0.75 ms of a 19 ms single-stream step
of the Llama 3.2 1B shape, 1.6 ms of a 64-row SmolLM2 step.

The block dot is generic IR (sign-extend, multiply, add-reduce: exact in int32), so it compiles
for any CPU; on AVX-512 LLVM lowers it to vpmovsxbw / vpmaddwd.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import F32, HALF, I8, I32, I64, c32, c64, fn, ptr, splat
from ._pack import RT, TB_Q4, TB_Q8

_OPTS = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False)
_V32I32 = ir.VectorType(I32, 32)
_V32I8 = ir.VectorType(I8, 32)
_V16I8 = ir.VectorType(I8, 16)


@intrinsic
def _dot_row(typingctx, P, r, qk, xq, xd, t):
    """Second-level logit of weight row ``r`` of the packed matrix P (uint8, ``_pack``'s tiles of Q4_0
    or Q8_0 blocks per ``qk`` = 4 | 8) against activation column ``t`` (xq int8 [nb, T, 32], xd
    float32 [nb, T]): acc = fma(float(isum_b), d_w[b] * d_x[b], acc) for b = 0..nb-1, acc from 0.0.

    A tile interleaves 32 rows four bytes at a time: row r's bytes of block b are its fp16 scale at
    2 * (r % 32) and 4 (Q4_0) or 8 (Q8_0) words of four bytes, 64 bytes apart, which are the GGUF
    block's quant bytes in order (Q8_0's stored XOR 0x80)."""
    sig = types.float32(P, r, qk, xq, xd, t)

    def codegen(context, builder, signature, args):
        pv, rv, qkv, xqv, xdv, tv = args
        sa = signature.args
        pa = context.make_array(sa[0])(context, builder, pv)
        xqa = context.make_array(sa[3])(context, builder, xqv)
        xda = context.make_array(sa[4])(context, builder, xdv)
        nb = builder.extract_value(xda.shape, 0)
        T = builder.extract_value(xda.shape, 1)
        rv = context.cast(builder, rv, sa[1], types.int64)
        is_q4 = builder.icmp_signed("==", context.cast(builder, qkv, sa[2], types.int64), c64(4))
        tb = builder.select(is_q4, c64(TB_Q4), c64(TB_Q8))
        rr = builder.and_(rv, c64(RT - 1))  # the row within its tile
        g, i = builder.lshr(rr, c64(4)), builder.and_(rr, c64(15))
        gstride = builder.select(is_q4, c64(256), c64(512))
        quants = builder.add(c64(64), builder.add(builder.mul(g, gstride), builder.mul(i, c64(4))))
        tile = builder.gep(builder.bitcast(pa.data, I8.as_pointer()),
                           [builder.mul(builder.mul(builder.lshr(rv, c64(5)), nb), tb)])
        xq8 = builder.bitcast(xqa.data, I8.as_pointer())
        radd = fn(builder, "llvm.vector.reduce.add.v32i32", I32, [_V32I32])
        fma = fn(builder, "llvm.fma.f32", F32, [F32, F32, F32])
        low = ir.Constant(_V16I8, [15] * 16)
        four = ir.Constant(_V16I8, [4] * 16)
        eight = ir.Constant(_V32I8, [8] * 32)
        flip = ir.Constant(_V32I8, [-128] * 32)
        cat = ir.Constant(ir.VectorType(I32, 32), list(range(32)))

        def words(base, n):  # n words of four bytes, 64 bytes apart, as one vector of 4n bytes
            v = ir.Constant(ir.VectorType(I32, n), ir.Undefined)
            for d in range(n):
                w = builder.load(ptr(builder, base, builder.add(quants, c64(64 * d)), I32), align=1)
                v = builder.insert_element(v, w, c32(d))
            return builder.bitcast(v, ir.VectorType(I8, 4 * n))

        acc_p = builder.alloca(F32)
        builder.store(ir.Constant(F32, 0.0), acc_p)
        with cgutils.for_range(builder, nb, intp=I64) as lb:
            b = lb.index
            base = builder.gep(tile, [builder.mul(b, tb)])
            dw = builder.fpext(builder.load(ptr(builder, base, builder.mul(rr, c64(2)), HALF), align=1), F32)
            with builder.if_else(is_q4) as (then, other):
                with then:
                    v = words(base, 4)  # the block's 16 nibble bytes
                    lo, hi = builder.and_(v, low), builder.lshr(v, four)  # elements 0..15, 16..31
                    w4 = builder.sub(builder.shuffle_vector(lo, hi, cat), eight)
                    bb4 = builder.block
                with other:
                    w8 = builder.xor(words(base, 8), flip)
                    bb8 = builder.block
            w = builder.phi(_V32I8)
            w.add_incoming(w4, bb4)
            w.add_incoming(w8, bb8)
            idx = builder.add(builder.mul(b, T), tv)
            x = builder.load(ptr(builder, xq8, builder.mul(idx, c64(32)), _V32I8), align=1)
            prod = builder.mul(builder.sext(w, _V32I32), builder.sext(x, _V32I32))
            isum = builder.call(radd, [prod])  # exact: |sum| <= 32 * 127 * 128
            dx = builder.load(builder.gep(xda.data, [idx]))
            s = builder.fmul(dw, dx)  # IEEE, no fast-math flags
            builder.store(builder.call(fma, [builder.sitofp(isum, F32), s, builder.load(acc_p)]), acc_p)
        return builder.load(acc_p)

    return sig, codegen


_V16F = ir.VectorType(F32, 16)


def _row_base(context, builder, sig_arr, arr, t):
    a = context.make_array(sig_arr)(context, builder, arr)
    base = builder.gep(builder.bitcast(a.data, I8.as_pointer()), [builder.mul(t, builder.extract_value(a.strides, 0))])
    return base


@intrinsic
def _max16(typingctx, y, t, n16):
    """max of y[t, :16*n16] (float32, C-contiguous rows, finite; -inf when n16 == 0): four
    independent 16-lane compare-and-select chains (vmaxps), exact in any order."""
    sig = types.float32(y, t, n16)

    def codegen(context, builder, signature, args):
        base = _row_base(context, builder, signature.args[0], args[0], args[1])
        n16v = args[2]
        ninf = ir.Constant(_V16F, [float("-inf")] * 16)
        accs = [builder.alloca(_V16F) for _ in range(4)]
        for a in accs:
            builder.store(ninf, a)

        def step(acc, i):
            v = builder.load(ptr(builder, base, builder.mul(i, c64(64)), _V16F), align=4)
            old = builder.load(acc)
            builder.store(builder.select(builder.fcmp_ordered(">", v, old), v, old), acc)

        n4 = builder.sdiv(n16v, c64(4))
        with cgutils.for_range(builder, n4, intp=I64) as lp:
            for u in range(4):
                step(accs[u], builder.add(builder.mul(lp.index, c64(4)), c64(u)))
        with cgutils.for_range(builder, builder.sub(n16v, builder.mul(n4, c64(4))), intp=I64) as lr:
            step(accs[0], builder.add(builder.mul(n4, c64(4)), lr.index))
        vs = [builder.load(a) for a in accs]
        m = vs[0]
        for v in vs[1:]:
            m = builder.select(builder.fcmp_ordered(">", v, m), v, m)
        red = fn(builder, "llvm.vector.reduce.fmax.v16f32", F32, [_V16F])
        return builder.call(red, [m], fastmath=("nnan",))  # finite inputs: nnan cannot change it

    return sig, codegen


@intrinsic
def _ge_masks(typingctx, y, t, n16, lo, masks):
    """masks[j] (int32) = bit l set where y[t, 16 j + l] >= lo, for j < n16; returns the number of
    bits set.  One vector compare per 16 logits."""
    sig = types.int64(y, t, n16, lo, masks)

    def codegen(context, builder, signature, args):
        base = _row_base(context, builder, signature.args[0], args[0], args[1])
        mk = context.make_array(signature.args[4])(context, builder, args[4]).data
        lov = context.cast(builder, args[3], signature.args[3], types.float32)
        splat_lo = splat(builder, lov, _V16F)
        pop = fn(builder, "llvm.ctpop.i32", I32, [I32])
        cnt = builder.alloca(I64)
        builder.store(c64(0), cnt)
        with cgutils.for_range(builder, args[2], intp=I64) as lp:
            v = builder.load(ptr(builder, base, builder.mul(lp.index, c64(64)), _V16F), align=4)
            bits = builder.zext(builder.bitcast(builder.fcmp_ordered(">=", v, splat_lo), ir.IntType(16)), I32)
            builder.store(bits, builder.gep(mk, [lp.index]))
            builder.store(builder.add(builder.load(cnt), builder.zext(builder.call(pop, [bits]), I64)), cnt)
        return builder.load(cnt)

    return sig, codegen


@intrinsic
def _cttz(typingctx, m):
    """Index of the lowest set bit of the int32 m (m != 0)."""
    sig = types.int64(types.int32)

    def codegen(context, builder, signature, args):
        f = fn(builder, "llvm.cttz.i32", I32, [I32, ir.IntType(1)])
        return builder.sext(builder.call(f, [args[0], ir.Constant(ir.IntType(1), 1)]), I64)

    return sig, codegen


@njit(**_OPTS)
def _row_max(y, t, V):
    """max of y[t, :V] (finite)."""
    n16 = V // 16
    m = _max16(y, t, n16)
    for i in range(n16 * 16, V):
        m = y[t, i] if y[t, i] > m else m
    return m


@njit(**_OPTS)
def _count_ge(y, t, V, lo, masks):
    """Fill masks (bits of y[t, :16 * (V // 16)] >= lo) and return how many of y[t, :V] are >= lo."""
    n16 = V // 16
    c = _ge_masks(y, t, n16, lo, masks)
    for i in range(n16 * 16, V):
        c += 1 if y[t, i] >= lo else 0
    return c


@njit(**_OPTS)
def _floor(y, t, V, margin, k, masks, spare):
    """(a, masks, c): a floor a for row t's threshold, masks filled for it, and c = how many values
    are >= a, negative when more than k (then the k-th largest is still to be found among them).
    a = max - margin, raised by bisecting the value range with vector counting passes while more
    than 4k values lie above it and still at least k would (a flat row has tens of thousands of
    logits within the margin)."""
    b = _row_max(y, t, V)
    a = np.float32(b - margin)
    c = _count_ge(y, t, V, a, masks)
    if c <= k:
        return a, masks, c
    while c > 4 * k:
        mid = np.float32(a + (b - a) * np.float32(0.5))
        if not (a < mid < b):
            break  # the range cannot be split further (ties)
        c2 = _count_ge(y, t, V, mid, spare)
        if c2 >= k:
            a, c = mid, c2
            masks, spare = spare, masks
        else:
            b = mid
    return a, masks, -c


@njit(**_OPTS)
def _candidates(y, t, V, lo, masks, vals, idx):
    """vals[:n], idx[:n] = the values of y[t, :V] that are >= lo and their indices (index order),
    from masks filled for lo; returns n."""
    n16 = V // 16
    n = 0
    for j in range(n16):
        m = masks[j]
        while m != 0:
            i = j * 16 + _cttz(m)
            vals[n] = y[t, i]
            idx[n] = i
            n += 1
            m &= m - np.int32(1)
    for i in range(n16 * 16, V):
        if y[t, i] >= lo:
            vals[n] = y[t, i]
            idx[n] = i
            n += 1
    return n


@njit(**_OPTS)
def _refine_row(y, t, V, P, qk, xq, xd, margin, k, masks, spare, vals, idx):
    """Refine y[t, :V]; returns how many logits were refined.  The threshold is max - margin, raised
    to the k-th largest value when more than k values lie above that: exact values whatever the
    ties, so another backend finds the same set."""
    a, m, c = _floor(y, t, V, margin, k, masks, spare)
    n = _candidates(y, t, V, a, m, vals, idx)
    thr = a if c >= 0 else np.partition(vals[:n].copy(), n - k)[n - k]
    r = 0
    for j in range(n):
        if vals[j] >= thr:
            i = idx[j]
            y[t, i] = vals[j] + _dot_row(P, i, qk, xq, xd, t)
            r += 1
    return r


@njit(**_OPTS)
def refine_serial(y, V, P, qk, xq, xd, margin, k, counts):
    """y float32 [T, >= V] (first-level logits in columns 0..V-1), in place: in each row, the
    logits >= the row's threshold (``_refine_row``) get their second level added; counts int64 [T]
    receives how many."""
    masks, spare = np.empty(V // 16 + 1, np.int32), np.empty(V // 16 + 1, np.int32)
    vals, idx = np.empty(V + 1, np.float32), np.empty(V + 1, np.int64)
    for t in range(y.shape[0]):
        counts[t] = _refine_row(y, t, V, P, qk, xq, xd, margin, k, masks, spare, vals, idx)


@njit(parallel=True, **_OPTS)
def refine_par(y, V, P, qk, xq, xd, margin, k, counts, nch):
    """refine_serial with the rows split into nch contiguous chunks."""
    T = y.shape[0]
    for c in prange(nch):
        masks, spare = np.empty(V // 16 + 1, np.int32), np.empty(V // 16 + 1, np.int32)
        vals, idx = np.empty(V + 1, np.float32), np.empty(V + 1, np.int64)
        for t in range(T * c // nch, T * (c + 1) // nch):
            counts[t] = _refine_row(y, t, V, P, qk, xq, xd, margin, k, masks, spare, vals, idx)
