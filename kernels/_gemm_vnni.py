"""The Q4_0 / Q8_0 x Q8_0 gemm's tile kernel with AVX-512 VNNI (vpdpbusd), as numba ``@intrinsic``
LLVM IR; ``_gemm_driver`` walks the tiles and calls it.

Safe to import anywhere: nothing here is compiled until called, and the driver types it only on
CPUs with AVX-512 F/BW/VNNI.

Tile kernel ("rows in lanes"): for one tile of 32 packed rows (two groups of 16 = zmm int32 lanes)
and one 32-weight block, 8 zmm per group are loaded (Q4_0: 4 loads, unpacked to low/high nibbles
with and/shift; Q8_0: 8 loads, stored as w + 128) once, then reused for every column: 8 vpdpbusd per
group with the column's 4 activation bytes broadcast give the exact int32 block dot of 16 rows,
seeded with -8 * sum(xq) (resp. -128 * sum(xq)) to cancel the unsigned offset.  Per (row, column),
in block order b = 0..nb-1 and with no fast-math flags:
        s   = d_w[b] * d_x[b]                 (fmul)
        acc = fma(float(isum[b]), s, acc)     (llvm.fma: one rounding)
Every output element sees the same float operations in the same order whatever the number of
columns, the column's position, or the thread split: batch invariance by construction, and the same
bits as ``_gemm_portable``.  Accumulators live in a small aligned per-thread buffer (rows of Y can
be 4 KiB-aliased: one L1 set).  A chunk's tiles stream sequentially, one after the other; the
hardware prefetchers alone fall behind that stream, so each block also prefetches the block
PF_BLOCKS ahead into L1.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import I8, I32, I64, V16F, V16H, V16I32, c32, c64, fn, ptr, splat
from ._pack import RT, TB_Q4, TB_Q8

G = 2  # columns interleaved per inner step (independent dependency chains)
# Software prefetch of the weights PF_BLOCKS blocks ahead (about 9 KB of a Q4_0 stream) into L1, in every
# pass.  The hardware prefetchers alone left one column (decode) waiting on DRAM: a 354 MB 1-column
# product read at 38-40 GB/s without it and 47-49 GB/s with it, 2 columns 35 -> 44, 4 columns 37 -> 46,
# 16 columns unchanged (measured A/B on 2 Zen 5 cores).  Farther was worse: two tiles ahead (72 KB on
# a 2,048-wide matrix, into L2) made one column ~25 % slower, and 24 blocks into L1 gained no more.
# Past a chunk's or the matrix's end the hint reads nothing the step needs, and never faults.
PF_BLOCKS = 16


def _make_tile(qk: int):
    """Intrinsic tile(P, off0, nb, xq, xd, xs, A, c0, c1): A (float32, >= (c1-c0)*RT + 16, aligned
    to 64 inside) receives rows 0..RT-1 of the packed tile at byte offset off0 for columns c0..c1 of
    the activations xq int8 [nb, T, 32], xd float32 [nb, T], xs int32 [nb, T]."""
    tb = TB_Q4 if qk == 4 else TB_Q8
    ndw = 4 if qk == 4 else 8  # dword rows per 16-row group as stored
    mult = -8 if qk == 4 else -128

    def typer(typingctx, P, off0, nb, xq, xd, xs, A, c0, c1):
        sig = types.void(P, off0, nb, xq, xd, xs, A, c0, c1)

        def codegen(context, builder, signature, args):
            Pv, off0v, nbv, xqv, xdv, xsv, Av, c0v, c1v = args
            sa = signature.args
            P8 = builder.bitcast(context.make_array(sa[0])(context, builder, Pv).data, I8.as_pointer())
            xqa = context.make_array(sa[3])(context, builder, xqv)
            T = builder.extract_value(xqa.shape, 1)
            xq8 = builder.bitcast(xqa.data, I8.as_pointer())
            xdp = context.make_array(sa[4])(context, builder, xdv).data
            xsp = context.make_array(sa[5])(context, builder, xsv).data
            aint = builder.ptrtoint(context.make_array(sa[6])(context, builder, Av).data, I64)
            abase = builder.inttoptr(builder.and_(builder.add(aint, c64(63)), c64(-64)), I8.as_pointer())
            vnni = fn(builder, "llvm.x86.avx512.vpdpbusd.512", V16I32, [V16I32, V16I32, V16I32])
            fma = fn(builder, "llvm.fma.v16f32", V16F, [V16F, V16F, V16F])
            mask0f = ir.Constant(V16I32, [0x0F0F0F0F] * 16)
            four = ir.Constant(V16I32, [4] * 16)
            zero = ir.Constant(V16F, [0.0] * 16)
            zi = ir.Constant(V16I32, [0] * 16)
            prefetch = fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
            ncols = builder.sub(c1v, c0v)

            def aptr(ci, g_):  # accumulators of column c0 + ci, rows 16 g_ .. 16 g_ + 15
                return ptr(builder, abase, builder.add(builder.mul(ci, c64(4 * RT)), c64(64 * g_)), V16F)

            def block(b, first):
                """One 32-weight block of the tile, every column.  In block 0 (first) the
                accumulators start at +0.0: fma(x, s, +0.0), the value a zeroed buffer gave, with
                no zeroing pass (LLVM made one a memset call per tile) and no select in the loop."""
                base = builder.gep(P8, [builder.add(off0v, builder.mul(b, c64(tb)))])
                DW, WV = [], []
                for g_ in range(2):
                    dh = builder.load(ptr(builder, base, c64(32 * g_), V16H), align=1)
                    DW.append(builder.fpext(dh, V16F))
                    raw = [builder.load(ptr(builder, base, c64(64 + 64 * ndw * g_ + 64 * d), V16I32), align=1)
                           for d in range(ndw)]
                    # lane i of WV[j]: u8 weights 4j..4j+3 of row i (Q4_0: 0..15 low, 16..31 high nibbles)
                    if qk == 4:
                        WV.append([builder.and_(t, mask0f) for t in raw]
                                  + [builder.and_(builder.lshr(t, four), mask0f) for t in raw])
                    else:
                        WV.append(raw)
                bT = builder.mul(b, T)
                # the block PF_BLOCKS ahead in the stream (tiles follow each other), into L1
                nxt = builder.gep(base, [c64(PF_BLOCKS * tb)])
                for k in range(0, tb, 64):
                    builder.call(prefetch, [builder.gep(nxt, [c64(k)]), c32(0), c32(3), c32(1)])

                def cols(ci0, n):
                    res = []
                    for u in range(n):
                        ci = builder.add(ci0, c64(u))
                        idx = builder.add(bT, builder.add(c0v, ci))
                        xp = builder.gep(xq8, [builder.mul(idx, c64(32))])
                        s = builder.mul(builder.load(builder.gep(xsp, [idx])), c32(mult))
                        res.append((ci, idx, xp, [[splat(builder, s, V16I32), zi] for _ in range(2)]))
                    for j in range(8):
                        for _ci, _idx, xp, accs in res:
                            xw = builder.load(ptr(builder, xp, c64(4 * j), I32), align=1)
                            xv = splat(builder, xw, V16I32)
                            for g_ in range(2):
                                accs[g_][j % 2] = builder.call(vnni, [accs[g_][j % 2], WV[g_][j], xv])
                    for ci, idx, _xp, accs in res:
                        dxs = splat(builder, builder.load(builder.gep(xdp, [idx])), V16F)
                        for g_ in range(2):
                            isum = builder.add(accs[g_][0], accs[g_][1])  # exact int32 block dot
                            s_ = builder.fmul(DW[g_], dxs)  # IEEE, no fast-math flags
                            ap = aptr(ci, g_)
                            old = zero if first else builder.load(ap, align=64)
                            acc = builder.call(fma, [builder.sitofp(isum, V16F), s_, old])
                            builder.store(acc, ap, align=64)

                ng = builder.sdiv(ncols, c64(G))
                with cgutils.for_range(builder, ng, intp=I64) as lg:
                    cols(builder.mul(lg.index, c64(G)), G)
                with cgutils.for_range(builder, builder.sub(ncols, builder.mul(ng, c64(G))), intp=I64) as lr:
                    cols(builder.add(builder.mul(ng, c64(G)), lr.index), 1)

            block(c64(0), True)
            with cgutils.for_range(builder, nbv, start=c64(1), intp=I64) as lb:
                block(lb.index, False)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"tile_vnni_q{qk}"
    return intrinsic(typer)


tile_q4 = _make_tile(4)
tile_q8 = _make_tile(8)
