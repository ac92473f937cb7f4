"""The router's logits, four experts at a time, as numba ``@intrinsic`` LLVM IR.

A logit is ``moe._logit``'s recipe: 16 float32 lanes, ``lane = lane + h * w`` block after block (a
multiply then an add, two roundings), then the lanes added by the fixed tree l + l+8, +4, +2, +1.
Written as a scalar loop, the lanes lived in memory and each block waited on the last one's add
through a store and a load: one token's 1 MB router (128 experts of 2,048) took ~40 us on two
threads, bound by that chain rather than by memory.  Here four experts' lanes are four vector
registers, so four independent chains share each load of ``h``; every lane sees the same operations
in the same order, so the bits are ``_logit``'s.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ._llvm import F32, I32, I64, V16F, c64

GROUP = 4  # experts a call computes
_V8F, _V4F, _V2F = ir.VectorType(F32, 8), ir.VectorType(F32, 4), ir.VectorType(F32, 2)


def _half(builder: ir.IRBuilder, v: ir.Value, n: int, vty: ir.VectorType) -> ir.Value:
    """lanes i < n/2 of v: v[i] + v[n/2 + i] (one IEEE add each, as the scalar tree)."""
    h = n // 2
    lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, h), list(range(h))))
    hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, h), list(range(h, n))))
    assert lo.type == vty
    return builder.fadd(lo, hi)


@intrinsic
def logits4(typingctx, h, w, e0, z):
    """z[e0 + j] = h . w[e0 + j] for j < 4: h float32 [d] (contiguous), w float32 [E, d] (C-contiguous),
    z float32 [E]; d a multiple of 16 and e0 + 4 <= E (the caller's checks)."""
    for a, nd in ((h, 1), (w, 2), (z, 1)):
        if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == nd and a.layout == "C"):
            raise TypingError(f"logits4: float32 C-contiguous arrays of {nd} dimensions, got {a}")
    sig = types.void(h, w, e0, z)

    def codegen(context, builder, signature, args):
        sa = signature.args
        ha = context.make_array(sa[0])(context, builder, args[0])
        wa = context.make_array(sa[1])(context, builder, args[1])
        za = context.make_array(sa[3])(context, builder, args[3])
        e0v = context.cast(builder, args[2], sa[2], types.int64)
        d = builder.extract_value(wa.shape, 1)
        hp = builder.bitcast(ha.data, F32.as_pointer())
        wp = builder.bitcast(wa.data, F32.as_pointer())
        rows = [builder.gep(wp, [builder.mul(builder.add(e0v, c64(j)), d)]) for j in range(GROUP)]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16)) for _ in range(GROUP)]

        def load16(p, off):
            return builder.load(builder.bitcast(builder.gep(p, [off]), V16F.as_pointer()), align=4)

        with cgutils.for_range(builder, builder.sdiv(d, c64(16)), intp=I64) as lp:
            off = builder.mul(lp.index, c64(16))
            hv = load16(hp, off)
            for j in range(GROUP):
                prod = builder.fmul(hv, load16(rows[j], off))  # no fast-math flags: no fma contraction
                builder.store(builder.fadd(builder.load(accs[j]), prod), accs[j])
        zp = builder.bitcast(za.data, F32.as_pointer())
        for j in range(GROUP):
            v8 = _half(builder, builder.load(accs[j]), 16, _V8F)
            v4 = _half(builder, v8, 8, _V4F)
            v2 = _half(builder, v4, 4, _V2F)
            s = builder.fadd(builder.extract_element(v2, ir.Constant(I32, 0)),
                             builder.extract_element(v2, ir.Constant(I32, 1)))
            builder.store(s, builder.gep(zp, [builder.add(e0v, c64(j))]))
        return context.get_dummy_value()

    return sig, codegen
