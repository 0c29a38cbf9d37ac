"""The two halves of :func:`kernels.attention.sparse_step.attend_one` as vector code that keeps its bits.

``attend_one`` spends its time in two chains that a plain numba loop leaves latency-bound: a key's
dot product (:func:`kernels.attention.lanes.lane_sums`: one ``<8 x float>`` chain, eight dependent
multiply-adds for a 64-wide row, then a tree) and the context's running sum over the selected rows
(``acc[n] + w_j * row_j[n]`` for each j in turn, kept in memory between rows). Both are written here
as LLVM IR that runs several independent chains at once, each one exactly the scalar sequence it
replaces (``fmul`` then ``fadd`` without fast-math flags: no FMA contraction, no reordering):

- :func:`dots4`: four keys' dot products with one query, each lane i of key g summing
  ``((0 + a[i] * b_g[i]) + a[i + 8] * b_g[i + 8]) + ...`` over the multiple of 8, then the tree
  ``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))`` (what ``lane_sums`` and its caller do for
  one key);
- :func:`weighted_rows`: ``out[n] = (((0 + w_0 * r_0[n]) + w_1 * r_1[n]) + ...)`` over the rows in
  order, for a run of columns held in registers (4 vectors of 16, or 1), the rows read once.

On glm-mini's shapes (4 heads, 64 + 16 wide, 32 rows) one ``attend_one`` took 2.3-2.7 us with the
loops it had and takes ~1.6 us with these (BENCHMARKS.md, session 29), the same floats.
"""
from __future__ import annotations

from typing import Any

from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.extending import intrinsic

KEYS = 4  # keys of one dots4 call
SUMS = 8  # lanes of a dot product's first stage (lane_sums')
WIDE = 16  # f32 lanes of one vector of weighted_rows
_F32, _I64 = ir.FloatType(), ir.IntType(64)


def _load(builder: Any, address: Any, vt: Any) -> Any:
    return builder.load(builder.inttoptr(address, vt.as_pointer()), align=4, typ=vt)


def _counted_loop(builder: Any, name: str, limit: Any, vt: Any,
                  carried: int) -> tuple[Any, list[Any], Any, Any, Any]:
    """A loop's head: a counter from 0 while < ``limit`` and ``carried`` vectors ``vt`` from zero,
    as phis (the body adds their next values and branches back to the head). Returns (counter,
    vectors, head block, body block, exit block), the builder left at the body."""
    entry = builder.basic_block
    head, body, done = (builder.append_basic_block(f"{name}.{part}") for part in ("head", "body", "done"))
    builder.branch(head)
    builder.position_at_end(head)
    counter = builder.phi(_I64)
    counter.add_incoming(ir.Constant(_I64, 0), entry)
    sums = [builder.phi(vt) for _ in range(carried)]
    for s in sums:
        s.add_incoming(ir.Constant(vt, [0.0] * vt.count), entry)
    builder.cbranch(builder.icmp_signed("<", counter, limit), body, done)
    builder.position_at_end(body)
    return counter, sums, head, body, done


def _dots_codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # pragma: no cover
    """IR of :func:`dots4`: one loop over the multiples of 8, four ``<8 x float>`` sums carried."""
    a_v, b_v, stride_v, full_v = args
    vt = ir.VectorType(_F32, SUMS)
    i, sums, head, body, done = _counted_loop(builder, "dots", full_v, vt, KEYS)
    offset = builder.mul(i, ir.Constant(_I64, 4))
    a = _load(builder, builder.add(a_v, offset), vt)
    for g, s in enumerate(sums):
        row = builder.add(b_v, builder.mul(stride_v, ir.Constant(_I64, g)))
        s.add_incoming(builder.fadd(s, builder.fmul(a, _load(builder, builder.add(row, offset), vt))), body)
    i.add_incoming(builder.add(i, ir.Constant(_I64, SUMS)), body)
    builder.branch(head)
    builder.position_at_end(done)
    totals = []
    for s in sums:
        lane = [builder.extract_element(s, ir.Constant(ir.IntType(32), n)) for n in range(SUMS)]
        totals.append(builder.fadd(builder.fadd(builder.fadd(lane[0], lane[1]), builder.fadd(lane[2], lane[3])),
                                   builder.fadd(builder.fadd(lane[4], lane[5]), builder.fadd(lane[6], lane[7]))))
    return context.make_tuple(builder, signature.return_type, totals)


def _dots4(typingctx: Any, a: Any, b: Any, stride: Any, full: Any) -> Any:  # pragma: no cover - compile-time
    """(d0, d1, d2, d3) f32: key g's dot product with the query over its first ``full`` elements (a
    multiple of 8), lanes then tree; the query at byte address ``a``, key g at ``b + g * stride``."""
    return types.UniTuple(types.float32, KEYS)(a, b, stride, full), _dots_codegen  # type: ignore[no-untyped-call]


def _rows_codegen(vectors: int) -> Any:
    """IR of a weighted sum of rows over ``vectors`` x 16 columns: a loop over the rows, the
    ``vectors`` sums carried in registers and stored once at the end."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # pragma: no cover
        w_v, rows_v, stride_v, k_v, out_v = args
        vt = ir.VectorType(_F32, WIDE)
        j, sums, head, body, done = _counted_loop(builder, "rows", k_v, vt, vectors)
        weight = builder.load(builder.inttoptr(builder.add(w_v, builder.mul(j, ir.Constant(_I64, 4))),
                                               _F32.as_pointer()))
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(vt, ir.Undefined), weight,
                                                              ir.Constant(ir.IntType(32), 0)),
                                       ir.Constant(vt, ir.Undefined),
                                       ir.Constant(ir.VectorType(ir.IntType(32), WIDE), [0] * WIDE))
        row = builder.add(rows_v, builder.mul(j, stride_v))
        for v, s in enumerate(sums):
            got = _load(builder, builder.add(row, ir.Constant(_I64, 4 * WIDE * v)), vt)
            s.add_incoming(builder.fadd(s, builder.fmul(splat, got)), body)
        j.add_incoming(builder.add(j, ir.Constant(_I64, 1)), body)
        builder.branch(head)
        builder.position_at_end(done)
        for v, s in enumerate(sums):
            address = builder.add(out_v, ir.Constant(_I64, 4 * WIDE * v))
            builder.store(s, builder.inttoptr(address, vt.as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


def _rows_typer(vectors: int) -> Any:
    def typer(typingctx: Any, w: Any, rows: Any, stride: Any, k: Any, out: Any) -> Any:  # pragma: no cover
        """out[0 : 16 * vectors] = sum over j < k, in order, of w[j] * row_j[0 : 16 * vectors]; w the
        f32 run at byte address ``w``, row j at ``rows + j * stride``, out at ``out``."""
        return types.void(w, rows, stride, k, out), _rows_codegen(vectors)

    return typer


dots4: Any = intrinsic(_dots4)  # njit-callable: dots4(a, b, stride, full) -> 4 f32
weighted_rows4: Any = intrinsic(_rows_typer(4))  # njit-callable: 64 columns
weighted_rows1: Any = intrinsic(_rows_typer(1))  # njit-callable: 16 columns

__all__ = ["KEYS", "SUMS", "WIDE", "dots4", "weighted_rows1", "weighted_rows4"]
