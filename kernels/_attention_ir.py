"""LLVM IR building blocks of the attention kernels (numba ``@intrinsic``s).

K/V rows are reached through the address of a kv head's position 0 (an int64 from ``.ctypes.data``;
rows of ``head_dim`` float16 values follow each other), which lets one compiled kernel serve the
per-sequence kv arrays of ``attend`` and the shard views of ``attend_partial``.  The caller keeps
the arrays alive and checks every row read lies inside them.

Two register-tiled inner loops that LLVM does not find on its own, because both need a fixed
arithmetic order that a vectorizer would only produce by reassociating:

* ``scores8``: 8 dot products q . k_r at once.  Lane l of accumulator r sums q[d] * k_r[d] over
  d = l, l + 16, ... (one fused multiply-add per step); the 16 lanes are then added by a fixed
  shuffle tree that reduces all 8 keys together (no per-key horizontal reduction).
* ``acc_v``: out[h, d] += p[h, r] * v[r, d] over keys r in order, for a tile of up to 4 heads x 4
  chunks of 16 dims held in registers (independent FMA chains, one per (head, chunk)); V is read
  as float16 and converted in registers.

Both use ``llvm.fma`` (one rounding) and no fast-math flags: the result is a fixed function of the
inputs, identical wherever and however often it is computed.  Both need head_dim % 16 == 0.  The
float16 <-> float32 conversions are the CPU's (F16C) instructions via LLVM fpext / fptrunc: exact,
and rounding to nearest even like numpy.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

I32, I64, F32, HALF = ir.IntType(32), ir.IntType(64), ir.FloatType(), ir.HalfType()
V8F, V16F, V16H = ir.VectorType(F32, 8), ir.VectorType(F32, 16), ir.VectorType(HALF, 16)
MAX_TILE_HEADS, MAX_TILE_CHUNKS = 4, 4


def _c(v: int) -> ir.Constant:
    return ir.Constant(I64, v)


def _mask(idx: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(I32, len(idx)), idx)


def _splat(builder: ir.IRBuilder, val: ir.Value, vty: ir.VectorType = V16F) -> ir.Value:
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, val, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, undef, _mask([0] * vty.count))


def _vec(builder: ir.IRBuilder, base: ir.Value, off: ir.Value, vty: ir.VectorType = V16F) -> ir.Value:
    """Pointer to a vector at element offset ``off`` of ``base``."""
    return builder.bitcast(builder.gep(base, [off]), vty.as_pointer())


def _halfs(builder: ir.IRBuilder, addr: ir.Value) -> ir.Value:
    return builder.inttoptr(addr, HALF.as_pointer())


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3), "llvm.fma.v16f32")
    return builder.call(f, [a, b, c])


def _data(context, builder, aty, aval) -> ir.Value:
    return context.make_array(aty)(context, builder, aval).data


@intrinsic
def h2f(typingctx, h):
    """float32 value of a float16 bit pattern (uint16)."""
    if h != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], HALF), F32)

    return types.float32(types.uint16), codegen


@intrinsic
def h2f_at(typingctx, addr, i):
    """float32 value of the float16 at ``addr`` + 2 * i."""
    sig = types.float32(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.load(builder.gep(_halfs(builder, args[0]), [args[1]])), F32)

    return sig, codegen


@intrinsic
def f2h(typingctx, x):
    """float16 bit pattern (uint16) nearest to a float32, ties to even."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], HALF), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def cvt_rows(typingctx, addr, off, n, dst):
    """dst.flat[0:n] = the float16 values at addr[off : off + n] as float32 (n a multiple of 16;
    dst float32, C-contiguous)."""
    sig = types.void(types.int64, types.int64, types.int64, dst)

    def codegen(context, builder, signature, args):
        src = _halfs(builder, args[0])
        dd = _data(context, builder, signature.args[3], args[3])
        with cgutils.for_range(builder, builder.udiv(args[2], _c(16))) as loop:
            i16 = builder.mul(loop.index, _c(16))
            h = builder.load(_vec(builder, src, builder.add(args[1], i16), V16H), align=2)
            builder.store(builder.fpext(h, V16F), _vec(builder, dd, i16), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _pair_sums(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, width: int) -> ir.Value:
    """One step of the reduction tree: a and b hold keys of ``width`` partial-sum lanes each; the
    result holds the keys of a, then of b, with width / 2 lanes each (lane i + lane i + width/2)."""
    half = width // 2
    lo, hi = [], []
    for src in (0, 16):
        for k in range(16 // width):
            base = src + k * width
            lo += [base + i for i in range(half)]
            hi += [base + half + i for i in range(half)]
    return builder.fadd(builder.shuffle_vector(a, b, _mask(lo)), builder.shuffle_vector(a, b, _mask(hi)))


@intrinsic
def scores8(typingctx, q, qoff, kf, kfoff, D, scale, s, soff):
    """s[soff + r] = scale * q[qoff : qoff + D] . kf[kfoff + r*D : ... + D] for r = 0..7.
    q, kf, s: float32 arrays (flat element offsets); D a multiple of 16."""
    sig = types.void(q, types.int64, kf, types.int64, types.int64, types.float32, s, types.int64)

    def codegen(context, builder, signature, args):
        qd, kd, sd = (_data(context, builder, signature.args[i], args[i]) for i in (0, 2, 6))
        qoff, kfoff, D, scale, soff = args[1], args[3], args[4], args[5], args[7]
        slots = [cgutils.alloca_once(builder, V16F) for _ in range(8)]
        for p in slots:
            builder.store(ir.Constant(V16F, None), p)
        with cgutils.for_range(builder, builder.udiv(D, _c(16))) as loop:
            c16 = builder.mul(loop.index, _c(16))
            qv = builder.load(_vec(builder, qd, builder.add(qoff, c16)), align=4)
            for r, p in enumerate(slots):
                off = builder.add(builder.add(kfoff, builder.mul(D, _c(r))), c16)
                kv = builder.load(_vec(builder, kd, off), align=4)
                builder.store(_fma(builder, qv, kv, builder.load(p)), p)
        res = _reduce8(builder, [builder.load(p) for p in slots], scale)
        builder.store(res, _vec(builder, sd, soff, V8F), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def scores8_heads(typingctx, q, qoff, nh, kaddr, koff, D, scale, s, soff):
    """``scores8`` for query heads 0..nh-1 (nh <= MAX_TILE_HEADS, their rows following each other in q
    from flat offset qoff) against the 8 float16 key rows at kaddr + 2 * koff, converted in registers:
    s[soff + h * (row stride of s) + r].  Each key is loaded and converted once
    for all heads.  Every (head, key) score is the same chain of operations as ``scores8``'s, so the
    same bits; the caller keeps the 8 rows inside the kv array."""
    sig = types.void(q, types.int64, types.int64, types.int64, types.int64, types.int64, types.float32, s,
                     types.int64)

    def codegen(context, builder, signature, args):
        qd = _data(context, builder, signature.args[0], args[0])
        sa = context.make_array(signature.args[7])(context, builder, args[7])
        qoff, nh, D, scale, soff = args[1], args[2], args[5], args[6], args[8]
        sstride = cgutils.unpack_tuple(builder, sa.shape)[1]
        kd = builder.gep(_halfs(builder, args[3]), [args[4]])
        slots = [cgutils.alloca_once(builder, V16F) for _ in range(8 * MAX_TILE_HEADS)]
        done = builder.append_basic_block("scores8_heads.done")
        sw = builder.switch(nh, done)
        for H in range(1, MAX_TILE_HEADS + 1):
            bb = builder.append_basic_block(f"scores8_heads.{H}")
            sw.add_case(_c(H), bb)
            builder.position_at_end(bb)
            _scores_tile(builder, qd, qoff, kd, D, scale, sa.data, soff, sstride, H, slots)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


def _scores_tile(builder, qd, qoff, kd, D, scale, sd, soff, sstride, H, slots) -> None:
    """H heads x 8 keys of ``scores8_heads``: accumulators in registers across the dims."""
    for p in slots[: 8 * H]:
        builder.store(ir.Constant(V16F, None), p)
    with cgutils.for_range(builder, builder.udiv(D, _c(16))) as loop:
        c16 = builder.mul(loop.index, _c(16))
        kvs = [builder.fpext(builder.load(_vec(builder, kd, builder.add(builder.mul(D, _c(r)), c16), V16H),
                                          align=2), V16F) for r in range(8)]
        for h in range(H):
            qv = builder.load(_vec(builder, qd, builder.add(builder.add(qoff, builder.mul(D, _c(h))), c16)), align=4)
            for r in range(8):
                p = slots[h * 8 + r]
                builder.store(_fma(builder, qv, kvs[r], builder.load(p)), p)
    for h in range(H):
        v = [builder.load(p) for p in slots[h * 8 : h * 8 + 8]]
        res = _reduce8(builder, v, scale)
        off = builder.add(soff, builder.mul(sstride, _c(h)))
        builder.store(res, _vec(builder, sd, off, V8F), align=4)


def _reduce8(builder, v, scale) -> ir.Value:
    """The 8 keys' 16-lane accumulators -> their 8 scaled sums (``scores8``'s tree)."""
    v = [_pair_sums(builder, v[i], v[i + 1], 16) for i in range(0, 8, 2)]  # 2 keys x 8 lanes each
    v = [_pair_sums(builder, v[i], v[i + 1], 8) for i in range(0, 4, 2)]  # 4 keys x 4 lanes
    v = _pair_sums(builder, v[0], v[1], 4)  # 8 keys x 2 lanes
    even = builder.shuffle_vector(v, v, _mask(list(range(0, 16, 2))))
    odd = builder.shuffle_vector(v, v, _mask(list(range(1, 16, 2))))
    return builder.fmul(builder.fadd(even, odd), _splat(builder, scale, V8F))


@intrinsic
def acc_v(typingctx, p, g0, hn, n, vaddr, j0, c0, cn, acc):
    """acc[g0 + h, 16*(c0 + c) + i] += p[g0 + h, r] * V[j0 + r, 16*(c0 + c) + i] for r = 0..n-1 in
    order, h < hn <= 4, c < cn <= 4, i < 16, where V is the float16 [positions, D] rows at vaddr.
    p float32 [G, >= n]; acc float32 [G, D], C-contiguous.  Each V value is converted once."""
    sig = types.void(p, types.int64, types.int64, types.int64, types.int64, types.int64, types.int64,
                     types.int64, acc)

    def codegen(context, builder, signature, args):
        pa = context.make_array(signature.args[0])(context, builder, args[0])
        aa = context.make_array(signature.args[8])(context, builder, args[8])
        g0, hn, n, j0, c0, cn = args[1], args[2], args[3], args[5], args[6], args[7]
        pstride = cgutils.unpack_tuple(builder, pa.shape)[1]
        D = cgutils.unpack_tuple(builder, aa.shape)[1]
        vd = builder.gep(_halfs(builder, args[4]), [builder.mul(j0, D)])
        slots = [cgutils.alloca_once(builder, V16F) for _ in range(MAX_TILE_HEADS * MAX_TILE_CHUNKS)]
        done = builder.append_basic_block("acc_v.done")
        sw = builder.switch(builder.add(builder.mul(hn, _c(8)), cn), done)
        for H in range(1, MAX_TILE_HEADS + 1):
            for C in range(1, MAX_TILE_CHUNKS + 1):
                bb = builder.append_basic_block(f"acc_v.{H}x{C}")
                sw.add_case(_c(H * 8 + C), bb)
                builder.position_at_end(bb)
                _acc_tile(builder, pa.data, pstride, vd, D, aa.data, g0, c0, n, H, C, slots)
                builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


def _acc_tile(builder, pd, pstride, vd, D, ad, g0, c0, n, H, C, slots) -> None:
    """The (H heads) x (C chunks) tile of acc_v, accumulators in registers across the keys."""
    cols = [builder.mul(builder.add(c0, _c(c)), _c(16)) for c in range(C)]
    rows = [builder.mul(builder.add(g0, _c(h)), D) for h in range(H)]
    aoffs = [[builder.add(rows[h], cols[c]) for c in range(C)] for h in range(H)]
    for h in range(H):
        for c in range(C):
            builder.store(builder.load(_vec(builder, ad, aoffs[h][c]), align=4), slots[h * C + c])
    with cgutils.for_range(builder, n) as loop:
        r = loop.index
        row = builder.mul(r, D)
        vs = [builder.fpext(builder.load(_vec(builder, vd, builder.add(row, cols[c]), V16H), align=2), V16F)
              for c in range(C)]
        for h in range(H):
            ph = builder.load(builder.gep(pd, [builder.add(builder.mul(builder.add(g0, _c(h)), pstride), r)]))
            ps = _splat(builder, ph)
            for c in range(C):
                slot = slots[h * C + c]
                builder.store(_fma(builder, ps, vs[c], builder.load(slot)), slot)
    for h in range(H):
        for c in range(C):
            builder.store(builder.load(slots[h * C + c]), _vec(builder, ad, aoffs[h][c]), align=4)
