"""DSA indexer scores of sixteen keys at once, one key a vector lane: the selection's scoring for the
rows of a step that share their keys (a prompt's chunk scores every key it sees once per row).

:func:`kernels.attention.select_step.score_row` scores one key at a time: its dot products run along
the key (eight lanes of the head dimension, then a tree across them), so each key costs a horizontal
reduction per head. Here the keys are laid across the lanes instead (``keys_t`` [hd, T], a key a
column: :func:`kernels.attention.row_tables.transpose_keys`), and every lane does, in registers,
exactly the scalar sequence ``score_row`` does for its key: the lane sums
``s_j = ((0 + q[j] * k[j]) + q[j + 8] * k[j + 8]) + ...`` for j < 8 over the head dimension's
multiple of 8, the tree ``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))``, the tail
``dot + q[i] * k[i]`` in order, ``relu`` as ``0 if dot <= 0 else dot`` (NaN stays NaN), and
``total + w[h] * relu`` over the heads in order, each a rounded multiply then a rounded add
(``fmul``/``fadd`` without fast-math flags: LLVM may neither contract nor reorder them). So each
score is bitwise ``score_row``'s, and a selection made from them is the same selection.

On glm-mini (4 heads of 32), 700 keys scored for one query: 9.3 us key by key, 4.3 us in lanes (one
thread, this VM); a prompt chunk's rows share one transposition (BENCHMARKS.md, session 27).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.extending import intrinsic

from kernels.compile_notice import announce_if_cold

KEYS = 16  # keys scored by one call of the vector kernel: one f32 vector's lanes
_SUMS = 8  # the lane sums of score_row's dot product (its eight-lane first stage)


def _codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # pragma: no cover - compile-time
    """IR of :func:`score16`: a loop over heads (the running total a phi), in it a loop over the head
    dimension's multiples of 8 (the eight lane sums phis), then the tail loop (the dot a phi)."""
    q_v, w_v, kt_v, kstride_v, nh_v, hd_v, out_v = args
    f32, i64 = ir.FloatType(), ir.IntType(64)
    vt = ir.VectorType(f32, KEYS)
    vptr, fptr = vt.as_pointer(), f32.as_pointer()
    zero = ir.Constant(vt, [0.0] * KEYS)
    splat_mask = ir.Constant(ir.VectorType(ir.IntType(32), KEYS), [0] * KEYS)
    four = ir.Constant(i64, 4)
    full_v = builder.sub(hd_v, builder.srem(hd_v, ir.Constant(i64, _SUMS)))

    def splat(address: Any) -> Any:
        one = builder.insert_element(ir.Constant(vt, ir.Undefined), builder.load(builder.inttoptr(address, fptr)),
                                     ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined), splat_mask)

    def key_row(i: Any) -> Any:  # the 16 keys' element i: row i of keys_t
        return builder.load(builder.inttoptr(builder.add(kt_v, builder.mul(i, kstride_v)), vptr), align=4, typ=vt)

    def q_at(h: Any, i: Any) -> Any:  # q[h, i]'s address
        return builder.add(q_v, builder.mul(builder.add(builder.mul(h, hd_v), i), four))

    entry = builder.basic_block
    h_head, h_body = builder.append_basic_block("heads"), builder.append_basic_block("heads.body")
    i_head, i_body = builder.append_basic_block("sums"), builder.append_basic_block("sums.body")
    t_head, t_body = builder.append_basic_block("tail"), builder.append_basic_block("tail.body")
    h_next, done = builder.append_basic_block("heads.next"), builder.append_basic_block("done")
    builder.branch(h_head)

    builder.position_at_end(h_head)  # for h < nh: total carried
    h = builder.phi(i64)
    total = builder.phi(vt)
    h.add_incoming(ir.Constant(i64, 0), entry)
    total.add_incoming(zero, entry)
    builder.cbranch(builder.icmp_signed("<", h, nh_v), h_body, done)

    builder.position_at_end(h_body)
    builder.branch(i_head)
    builder.position_at_end(i_head)  # for i < full, step 8: the eight lane sums carried
    i = builder.phi(i64)
    sums = [builder.phi(vt) for _ in range(_SUMS)]
    i.add_incoming(ir.Constant(i64, 0), h_body)
    for s in sums:
        s.add_incoming(zero, h_body)
    builder.cbranch(builder.icmp_signed("<", i, full_v), i_body, t_head)
    builder.position_at_end(i_body)
    for j, s in enumerate(sums):
        at = builder.add(i, ir.Constant(i64, j))
        s.add_incoming(builder.fadd(s, builder.fmul(splat(q_at(h, at)), key_row(at))), i_body)
    i.add_incoming(builder.add(i, ir.Constant(i64, _SUMS)), i_body)
    builder.branch(i_head)

    builder.position_at_end(t_head)  # the tree, then for i in [full, hd): dot + q[i] * k[i]
    s = sums
    tree = builder.fadd(builder.fadd(builder.fadd(s[0], s[1]), builder.fadd(s[2], s[3])),
                        builder.fadd(builder.fadd(s[4], s[5]), builder.fadd(s[6], s[7])))
    tail_entry = builder.basic_block
    builder.branch(t_body)
    builder.position_at_end(t_body)
    r = builder.phi(i64)
    dot = builder.phi(vt)
    r.add_incoming(full_v, tail_entry)
    dot.add_incoming(tree, tail_entry)
    more = builder.append_basic_block("tail.more")
    builder.cbranch(builder.icmp_signed("<", r, hd_v), more, h_next)
    builder.position_at_end(more)
    dot.add_incoming(builder.fadd(dot, builder.fmul(splat(q_at(h, r)), key_row(r))), more)
    r.add_incoming(builder.add(r, ir.Constant(i64, 1)), more)
    builder.branch(t_body)

    builder.position_at_end(h_next)  # relu (ordered <=: NaN stays), then total + w[h] * relu
    relu = builder.select(builder.fcmp_ordered("<=", dot, zero), zero, dot)
    w_h = splat(builder.add(w_v, builder.mul(h, four)))
    total.add_incoming(builder.fadd(total, builder.fmul(w_h, relu)), h_next)
    h.add_incoming(builder.add(h, ir.Constant(i64, 1)), h_next)
    builder.branch(h_head)

    builder.position_at_end(done)
    builder.store(total, builder.inttoptr(out_v, vptr), align=4)
    return context.get_dummy_value()


def _score16(typingctx: Any, q: Any, w: Any, kt: Any, kstride: Any, nh: Any, hd: Any,
             out: Any) -> Any:  # pragma: no cover - compile-time
    """out[0:16] = score_row(q, w, key_j) for the 16 keys j whose element i is the f32 at ``kt + i *
    kstride + 4 * j``; q [nh, hd] and w [nh] f32 contiguous at ``q``, ``w`` (all byte addresses)."""
    return types.void(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64,
                      types.int64), _codegen


score16: Any = intrinsic(_score16)  # njit-callable: score16(q, w, kt, kstride, nh, hd, out)


_f32 = types.float32
_F1, _F2 = types.Array(_f32, 1, "C"), types.Array(_f32, 2, "C")
announce_if_cold(__file__)  # numba compiles the kernels below now unless cached


@njit(types.void(_F2, _F1, _F2, types.int64, _F1), cache=True, nogil=True, boundscheck=False)
def score_transposed(q: np.ndarray, w: np.ndarray, keys_t: np.ndarray, n: int,
                     out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[t] = score_row(q, w, key t) for t < n: q [nh, hd], w [nh] f32 (scaled), keys_t [hd, >= n
    rounded up to 16] f32 (key t its column t; columns past n are scored too and left in out, whose
    length is at least n rounded up to 16)."""
    nh, hd = q.shape
    qa, wa, ka, stride, oa = q.ctypes.data, w.ctypes.data, keys_t.ctypes.data, keys_t.strides[0], out.ctypes.data
    for t0 in range(0, n, KEYS):
        score16(qa, wa, ka + 4 * t0, stride, nh, hd, oa + 4 * t0)


__all__ = ["KEYS", "score16", "score_transposed"]
