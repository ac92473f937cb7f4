"""LLVM IR building blocks for numba ``@intrinsic`` kernels.

Everything here is target-independent IR (LLVM lowers it for whatever CPU numba compiles for); the
AVX-512 VNNI tile kernel lives in ``_gemm_vnni`` and is only ever compiled on CPUs that have it.
No IR here carries fast-math flags except where a comment says why the result cannot change.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
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

