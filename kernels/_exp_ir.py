"""``exp_f32`` sixteen lanes at a time, as LLVM IR (a numba ``@intrinsic``).

LLVM vectorizes a loop of ``exp_f32`` on its own, but only eight lanes wide: the float -> int64
conversion of the exponent makes it pick 256-bit vectors.  This is the same function, operation for
operation (clamp by the same selects numba's ``max`` / ``min`` lower to, the same multiplies and adds
unfused, floor, the exponent built in the float's bits), on 16 lanes: every lane gives the bits a
scalar call gives.  ``tests/kernels/test_attention.py`` holds it to that on edge and random values.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from weaved.kernels._rowwise import EXP_CONSTANTS as C

I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
V16F, V16I = ir.VectorType(F32, 16), ir.VectorType(I32, 16)


def _k(v) -> ir.Constant:
    """A float32 constant splatted over 16 lanes."""
    return ir.Constant(V16F, [ir.Constant(F32, float(v))] * 16)


def _i(v: int) -> ir.Constant:
    return ir.Constant(V16I, [ir.Constant(I32, v)] * 16)


def _exp16(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """exp_f32 of each lane of x <16 x float>."""
    lo, hi = _k(C["lo"]), _k(C["hi"])
    xc = b.select(b.fcmp_ordered(">", lo, x), lo, x)  # max(x, LO): LO if LO > x else x
    xc = b.select(b.fcmp_ordered("<", hi, xc), hi, xc)  # min(., HI): HI if HI < . else .
    floor = cgutils.get_or_insert_function(b.module, ir.FunctionType(V16F, [V16F]), "llvm.floor.v16f32")
    n = b.call(floor, [b.fadd(b.fmul(xc, _k(C["log2e"])), _k(C["half"]))])
    r = b.fsub(xc, b.fmul(n, _k(C["ln2_hi"])))
    r = b.fsub(r, b.fmul(n, _k(C["ln2_lo"])))
    p0, p1, *rest = C["p"]
    p = b.fadd(b.fmul(_k(p0), r), _k(p1))
    for c in rest:
        p = b.fadd(b.fmul(p, r), _k(c))
    p = b.fadd(b.fadd(b.fmul(p, b.fmul(r, r)), r), _k(C["one"]))
    y = b.fmul(p, b.bitcast(b.shl(b.add(b.fptosi(n, V16I), _i(127)), _i(23)), V16F))  # * 2**n
    y = b.select(b.fcmp_ordered("<", x, lo), _k(C["zero"]), y)
    return b.select(b.fcmp_ordered(">", x, hi), _k(C["inf"]), y)


@intrinsic
def exp_shift16(typingctx, x, n16, m):
    """x[i] = exp_f32(x[i] - m) for i < n16 (a multiple of 16); x float32, C-contiguous."""
    sig = types.void(x, types.int64, types.float32)

    def codegen(context, builder, signature, args):
        xd = context.make_array(signature.args[0])(context, builder, args[0]).data
        undef = ir.Constant(V16F, ir.Undefined)
        mv = builder.shuffle_vector(builder.insert_element(undef, args[2], ir.Constant(I32, 0)), undef,
                                    ir.Constant(V16I, [ir.Constant(I32, 0)] * 16))
        with cgutils.for_range(builder, builder.udiv(args[1], ir.Constant(I64, 16))) as loop:
            ptr = builder.bitcast(builder.gep(xd, [builder.mul(loop.index, ir.Constant(I64, 16))]),
                                  V16F.as_pointer())
            builder.store(_exp16(builder, builder.fsub(builder.load(ptr, align=4), mv)), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen
