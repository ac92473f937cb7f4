"""The Q4_0 / Q8_0 x Q8_0 gemm's tile kernel for CPUs without AVX-512 VNNI: target-independent LLVM
vector IR; ``_gemm_driver`` walks the tiles and calls it.

Same packed layout, tiles and recipe as ``_gemm_vnni``, with no instruction-set-specific intrinsic
(LLVM lowers the <16 x float> operations to AVX-512, AVX2, SSE or NEON as the CPU allows).  The
int8 block dot is computed in float32 lanes instead of vpdpbusd: every weight (-128..127), product
(|.| <= 16256) and partial sum (|.| < 2^20) is an integer below 2^24, so each operation is exact,
in any order, fused or not, and the block sum equals the int32 dot.  The rest is the recipe,
op for op: ``acc = fma(float(isum_b), d_w[b] * d_x[b], acc)`` in block order, so the results are
bit-identical to the VNNI kernel's.  (Plain numba loops over these 16-lane tiles do not vectorize:
they ran ~50x slower than VNNI.)
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import F32, I8, I32, I64, V16F, V16I32, c32, c64, fn, ptr, splat
from ._pack import RT, TB_Q4, TB_Q8

V16I16 = ir.VectorType(ir.IntType(16), 16)
V32F, V32I8, V32I32 = ir.VectorType(F32, 32), ir.VectorType(I8, 32), ir.VectorType(I32, 32)


def _c16(builder, v):
    return ir.Constant(V16I32, [v] * 16)


def _half_to_float(builder, h):
    """<16 x i32> fp16 bit patterns -> <16 x float>, exactly, with integer ops only (no F16C)."""
    sign = builder.shl(builder.and_(h, _c16(builder, 0x8000)), _c16(builder, 16))
    e = builder.and_(h, _c16(builder, 0x7C00))
    m = builder.and_(h, _c16(builder, 0x3FF))
    normal = builder.or_(sign, builder.shl(builder.add(builder.and_(h, _c16(builder, 0x7FFF)),
                                                       _c16(builder, 0x1C000)), _c16(builder, 13)))
    infnan = builder.or_(builder.or_(sign, _c16(builder, 0x7F800000)), builder.shl(m, _c16(builder, 13)))
    bits = builder.select(builder.icmp_unsigned("==", e, _c16(builder, 0x7C00)), infnan, normal)
    sub = builder.fmul(builder.sitofp(m, V16F), ir.Constant(V16F, [2.0**-24] * 16))  # exact, normal
    sub = builder.select(builder.icmp_unsigned("!=", sign, _c16(builder, 0)), builder.fneg(sub), sub)
    return builder.select(builder.icmp_unsigned("==", e, _c16(builder, 0)), sub, builder.bitcast(bits, V16F))


def _make_tile(qk: int):
    """Intrinsic tile(P, off0, nb, xq, xd, xs, A, c0, c1), the contract of ``_gemm_vnni``'s."""
    tb = TB_Q4 if qk == 4 else TB_Q8
    ndw = 4 if qk == 4 else 8

    def typer(typingctx, P, off0, nb, xq, xd, xs, A, c0, c1):
        sig = types.void(P, off0, nb, xq, xd, xs, A, c0, c1)

        def codegen(context, builder, signature, args):
            Pv, off0v, nbv, xqv, xdv, _xsv, Av, c0v, c1v = args
            sa = signature.args
            P8 = builder.bitcast(context.make_array(sa[0])(context, builder, Pv).data, I8.as_pointer())
            xqa = context.make_array(sa[3])(context, builder, xqv)
            T = builder.extract_value(xqa.shape, 1)
            xq8 = builder.bitcast(xqa.data, I8.as_pointer())
            xdp = context.make_array(sa[4])(context, builder, xdv).data
            aint = builder.ptrtoint(context.make_array(sa[6])(context, builder, Av).data, I64)
            abase = builder.inttoptr(builder.and_(builder.add(aint, c64(63)), c64(-64)), I8.as_pointer())
            fma = fn(builder, "llvm.fma.v16f32", V16F, [V16F, V16F, V16F])
            fmuladd = fn(builder, "llvm.fmuladd.v16f32", V16F, [V16F, V16F, V16F])
            zero = ir.Constant(V16F, [0.0] * 16)
            ncols = builder.sub(c1v, c0v)

            def aptr(ci, g_):
                return ptr(builder, abase, builder.add(builder.mul(ci, c64(4 * RT)), c64(64 * g_)), V16F)

            def block(b, first):
                """One 32-weight block of the tile, every column; block 0 (first) starts the
                accumulators at +0.0 (as _gemm_vnni)."""
                base = builder.gep(P8, [builder.add(off0v, builder.mul(b, c64(tb)))])
                DW, WF = [], []
                for g_ in range(2):
                    h = builder.zext(builder.load(ptr(builder, base, c64(32 * g_), V16I16), align=1), V16I32)
                    DW.append(_half_to_float(builder, h))
                    raw = [builder.load(ptr(builder, base, c64(64 + 64 * ndw * g_ + 64 * d), V16I32), align=1)
                           for d in range(ndw)]
                    wf = []  # wf[j]: lane i = weight j of row 16 g_ + i, as float
                    for j in range(32):
                        if qk == 4:
                            sh = 8 * (j % 4) + (4 if j >= 16 else 0)
                            v = builder.lshr(raw[(j % 16) // 4], _c16(builder, sh))
                            v = builder.sub(builder.and_(v, _c16(builder, 15)), _c16(builder, 8))
                        else:
                            v = builder.lshr(raw[j // 4], _c16(builder, 8 * (j % 4)))
                            v = builder.sub(builder.and_(v, _c16(builder, 255)), _c16(builder, 128))
                        wf.append(builder.sitofp(v, V16F))
                    WF.append(wf)
                bT = builder.mul(b, T)
                with cgutils.for_range(builder, ncols, intp=I64) as lc:
                    ci = lc.index
                    idx = builder.add(bT, builder.add(c0v, ci))
                    xv = builder.load(ptr(builder, xq8, builder.mul(idx, c64(32)), V32I8), align=1)
                    xf = builder.sitofp(xv, V32F)
                    dxs = splat(builder, builder.load(builder.gep(xdp, [idx])), V16F)
                    for g_ in range(2):
                        chains = [None] * 4  # four independent exact partial sums
                        for j in range(32):
                            xj = splat(builder, builder.extract_element(xf, c32(j)), V16F)
                            k = j % 4
                            if chains[k] is None:
                                chains[k] = builder.fmul(WF[g_][j], xj)
                            else:
                                chains[k] = builder.call(fmuladd, [WF[g_][j], xj, chains[k]])
                        isum = builder.fadd(builder.fadd(chains[0], chains[1]),
                                            builder.fadd(chains[2], chains[3]))
                        s_ = builder.fmul(DW[g_], dxs)  # IEEE, no fast-math flags
                        ap = aptr(ci, g_)
                        old = zero if first else builder.load(ap, align=64)
                        builder.store(builder.call(fma, [isum, s_, old]), ap, align=64)

            block(c64(0), True)
            with cgutils.for_range(builder, nbv, start=c64(1), intp=I64) as lb:
                block(lb.index, False)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"tile_portable_q{qk}"
    return intrinsic(typer)


tile_q4 = _make_tile(4)
tile_q8 = _make_tile(8)
