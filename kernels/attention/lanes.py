"""Eight-lane sums of products as one vector: the first stage of the attention kernels' dot product
(:func:`kernels.attention.sparse_step.attend_one`), written as LLVM IR because numba's loop over eight
scalar sums stays scalar (eight ``mulss``/``addss`` chains where one ``<8 x float>`` chain does).

Lane i sums ``a[i] * b[i] + a[i + 8] * b[i + 8] + ...`` in that order, a rounded multiply then a rounded
add (``fmul`` then ``fadd`` without fast-math flags: no FMA contraction, no reordering), so each lane is
bitwise the scalar chain it replaces.
"""
from __future__ import annotations

from typing import Any

from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.extending import intrinsic

LANES = 8


def _lane_sums(typingctx: Any, a: Any, b: Any, full: Any) -> Any:  # pragma: no cover - compile-time
    """(s0, .., s7) f32: lane i's sum over k < ``full`` (a multiple of 8) of x[8k + i] * y[8k + i], x and
    y the f32 runs at byte addresses ``a`` and ``b`` (ints)."""
    sig = types.UniTuple(types.float32, LANES)(a, b, full)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a_v, b_v, full_v = args
        f32, i64 = ir.FloatType(), ir.IntType(64)
        vt = ir.VectorType(f32, LANES)
        vptr = vt.as_pointer()
        pre = builder.basic_block
        header = builder.append_basic_block("lanes.header")
        body = builder.append_basic_block("lanes.body")
        done = builder.append_basic_block("lanes.done")
        builder.branch(header)
        builder.position_at_end(header)
        i = builder.phi(i64)
        i.add_incoming(ir.Constant(i64, 0), pre)
        acc = builder.phi(vt)
        acc.add_incoming(ir.Constant(vt, [0.0] * LANES), pre)
        builder.cbranch(builder.icmp_signed("<", i, full_v), body, done)
        builder.position_at_end(body)
        off = builder.mul(i, ir.Constant(i64, 4))
        va = builder.load(builder.inttoptr(builder.add(a_v, off), vptr), align=4, typ=vt)
        vb = builder.load(builder.inttoptr(builder.add(b_v, off), vptr), align=4, typ=vt)
        acc.add_incoming(builder.fadd(acc, builder.fmul(va, vb)), body)
        i.add_incoming(builder.add(i, ir.Constant(i64, LANES)), body)
        builder.branch(header)
        builder.position_at_end(done)
        lanes = [builder.extract_element(acc, ir.Constant(ir.IntType(32), k)) for k in range(LANES)]
        return context.make_tuple(builder, signature.return_type, lanes)

    return sig, codegen


lane_sums: Any = intrinsic(_lane_sums)  # njit-callable: lane_sums(a, b, full) -> 8 f32

__all__ = ["LANES", "lane_sums"]
