"""LLVM IR building blocks for numba ``@intrinsic`` kernels.

Everything here is target-independent IR (LLVM lowers it for whatever CPU numba compiles for); the
AVX-512 VNNI tile kernel lives in ``_gemm_vnni`` and is only ever compiled on CPUs that have it.
No IR here carries fast-math flags except where a comment says why the result cannot change.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32, HALF = ir.FloatType(), ir.HalfType()
V16I32, V16F, V16H = ir.VectorType(I32, 16), ir.VectorType(F32, 16), ir.VectorType(HALF, 16)
V32F, V32I32, V32I8 = ir.VectorType(F32, 32), ir.VectorType(I32, 32), ir.VectorType(I8, 32)


def c64(v: int) -> ir.Constant:
    return ir.Constant(I64, v)


def c32(v: int) -> ir.Constant:
    return ir.Constant(I32, v)


def splat(builder: ir.IRBuilder, val: ir.Value, vty: ir.VectorType) -> ir.Value:
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, val, c32(0))
    return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(I32, vty.count), [0] * vty.count))


def ptr(builder: ir.IRBuilder, base_i8: ir.Value, off_bytes: ir.Value, ty: ir.Type) -> ir.Value:
    """Typed pointer to ``base_i8 + off_bytes``."""
    return builder.bitcast(builder.gep(base_i8, [off_bytes]), ty.as_pointer())


def fn(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


@intrinsic
def fma_f32(typingctx, a, b, c):
    """a * b + c with a single rounding (llvm.fma; a libm call on CPUs without FMA hardware)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        a_, b_, c_ = (context.cast(builder, v, t, types.float32)
                      for v, t in zip(args, signature.args, strict=True))
        return builder.call(fn(builder, "llvm.fma.f32", F32, [F32, F32, F32]), [a_, b_, c_])

    return sig, codegen


@intrinsic
def quant_block_q8(typingctx, x, xoff, q, qoff):
    """Quantize the 32 float32 at ``x[xoff:]`` to Q8_0 the way llama.cpp's quantize_row_q8_0 does:
    ``d = fp16(amax / 127)``, ``q = rint(x * (127 / amax))`` (round half to even; 0 when amax == 0),
    int8 to ``q[qoff:]``.  Returns ``(d, sum(q))``.  32-lane IR, IEEE ops: the same bits wherever it runs."""
    sig = types.Tuple((types.float32, types.int32))(x, xoff, q, qoff)

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        qa = context.make_array(signature.args[2])(context, builder, args[2])
        v = builder.load(builder.bitcast(builder.gep(xa.data, [args[1]]), V32F.as_pointer()), align=4)
        fabs = fn(builder, "llvm.fabs.v32f32", V32F, [V32F])
        vmax = fn(builder, "llvm.vector.reduce.fmax.v32f32", F32, [V32F])
        rint = fn(builder, "llvm.rint.v32f32", V32F, [V32F])
        radd = fn(builder, "llvm.vector.reduce.add.v32i32", I32, [V32I32])
        # nnan lets LLVM use a vmaxps tree: max is exact and order-free on finite inputs
        amax = builder.call(vmax, [builder.call(fabs, [v])], fastmath=("nnan",))
        # llama.cpp (x86 SIMD): the block scale is stored as fp16, the quants use 127/amax
        d32 = builder.fdiv(amax, ir.Constant(F32, 127.0))
        d = builder.fpext(builder.fptrunc(d32, ir.HalfType()), F32)
        nz = builder.fcmp_ordered("!=", amax, ir.Constant(F32, 0.0))
        idd = builder.select(nz, builder.fdiv(ir.Constant(F32, 127.0), amax), ir.Constant(F32, 0.0))
        qi = builder.fptosi(builder.call(rint, [builder.fmul(v, splat(builder, idd, V32F))]), V32I32)
        qp = builder.bitcast(builder.gep(qa.data, [args[3]]), V32I8.as_pointer())
        builder.store(builder.trunc(qi, V32I8), qp, align=1)
        s = builder.call(radd, [qi])
        return context.make_tuple(builder, signature.return_type, [d, s])

    return sig, codegen


@intrinsic
def sumsq_f64(typingctx, x):
    """sum(x[i]^2) of float32 x [n] (contiguous) the way ggml's rms_norm sums it: each square in
    float32, added in float64 to lane i % 16 in index order, then lanes 0..15 added in order from 0.0.
    The lanes are one register pair, not memory: as a loop over a lanes array each block waited on
    the last one's add through a store and a load (and the array was an allocation per row).  A
    missing tail lane adds +0.0 to a sum of squares (>= +0.0), which leaves it as it was."""
    if not (isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 1 and x.layout == "C"):
        raise TypingError(f"sumsq_f64: a contiguous float32 vector, got {x}")
    sig = types.float64(x)

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        n = builder.extract_value(xa.shape, 0)
        xp = builder.bitcast(xa.data, F32.as_pointer())
        f64, v16d = ir.DoubleType(), ir.VectorType(ir.DoubleType(), 16)
        acc = cgutils.alloca_once_value(builder, ir.Constant(v16d, [0.0] * 16))

        def add(v):  # lanes += float64(v * v)
            builder.store(builder.fadd(builder.load(acc), builder.fpext(builder.fmul(v, v), v16d)), acc)

        n16 = builder.sdiv(n, c64(16))
        with cgutils.for_range(builder, n16, intp=I64) as lp:
            add(builder.load(builder.bitcast(builder.gep(xp, [builder.mul(lp.index, c64(16))]), V16F.as_pointer()),
                             align=4))
        tail = cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16))
        rest = builder.sub(n, builder.mul(n16, c64(16)))
        with cgutils.for_range(builder, rest, intp=I64) as lr:
            v = builder.load(builder.gep(xp, [builder.add(builder.mul(n16, c64(16)), lr.index)]))
            builder.store(builder.insert_element(builder.load(tail), v, builder.trunc(lr.index, I32)), tail)
        add(builder.load(tail))
        lanes = builder.load(acc)
        total = ir.Constant(f64, 0.0)
        for i in range(16):
            total = builder.fadd(total, builder.extract_element(lanes, c32(i)))
        return total

    return sig, codegen


@intrinsic
def store_tile_cols(typingctx, A, Y, c0, c1, col0, nr):
    """Y[c, col0 : col0 + nr] = A[a + 32 (c - c0) : a + 32 (c - c0) + nr] for c = c0 .. c1 - 1, where
    a is the first 64-byte aligned element of A: a tile kernel's accumulators (32 rows per column)
    copied out to the columns' rows of Y.  A float32 1-D, Y float32 2-D with unit inner stride,
    0 <= nr <= 32; the caller keeps every index in bounds.

    Why not a numba loop: its signed indices make LLVM vectorize the copy into gathers and
    scatters (a wrap-around check per element), which took a quarter of the gemm's time at 16
    columns.  Here it is two masked 16-lane stores per column."""
    sig = types.void(A, Y, types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        Av, Yv, c0v, c1v, col0v, nrv = args
        aint = builder.ptrtoint(context.make_array(signature.args[0])(context, builder, Av).data, I64)
        abase = builder.inttoptr(builder.and_(builder.add(aint, c64(63)), c64(-64)), I8.as_pointer())
        ya = context.make_array(signature.args[1])(context, builder, Yv)
        ystride = cgutils.unpack_tuple(builder, ya.strides)[0]  # bytes
        ydata = builder.bitcast(ya.data, I8.as_pointer())
        mstore = fn(builder, "llvm.masked.store.v16f32.p0v16f32", ir.VoidType(),
                    [V16F, V16F.as_pointer(), I32, ir.VectorType(I1, 16)])
        nrs = splat(builder, builder.trunc(nrv, I32), V16I32)
        masks = [builder.icmp_unsigned("<", ir.Constant(V16I32, [16 * h + i for i in range(16)]), nrs)
                 for h in range(2)]
        with cgutils.for_range(builder, builder.sub(c1v, c0v), intp=I64) as lc:
            ci = lc.index
            yrow = builder.add(builder.mul(builder.add(c0v, ci), ystride), builder.mul(col0v, c64(4)))
            for h in range(2):
                v = builder.load(ptr(builder, abase, builder.add(builder.mul(ci, c64(128)), c64(64 * h)), V16F),
                                 align=64)
                dst = ptr(builder, ydata, builder.add(yrow, c64(64 * h)), V16F)
                builder.call(mstore, [v, dst, c32(4), masks[h]])
        return context.get_dummy_value()

    return sig, codegen
