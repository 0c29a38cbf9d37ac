"""A register-held tile of a batch-invariant product, for :func:`kernels.model.rowwise.rows_times` and the
compiled step's other row products: up to four rows' sums over ``vecs`` x 16 output columns stay in vector
registers for the whole k loop (LLVM IR written here: numba's own loops keep each sum in memory and
reload and store it at every k, so the loop was bound by stores, ~3 multiply-adds a cycle on glm-mini's
lm_head).

Each output element is still ``((0 + x[0] * w[0, n]) + x[1] * w[1, n]) + ...``, k ascending, a rounded
multiply then a rounded add (``fmul`` then ``fadd`` without fast-math flags: LLVM may not contract them
into an FMA nor reorder them), so the bits are those of the plain loop, whichever rows share the tile.
The vectors are generic IR (``<16 x float>``): AVX-512 keeps one in a zmm register, AVX2 splits it in two,
so how many a tile may hold depends on the machine (:data:`TILE_VECTORS`).
"""
from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import binding, ir  # type: ignore[import-untyped]
from numba import carray, njit, types
from numba.extending import intrinsic

from kernels.attention.row_tables import pointer_to

LANES = 16  # output columns of one vector


def tile_vectors(features: str | None = None) -> int:
    """How many 16-lane sums one tile may keep in registers on numba's target (``features``: LLVM's
    ``+avx2,-avx512f,..`` string; by default numba's: ``NUMBA_CPU_FEATURES``, else none where
    ``NUMBA_CPU_NAME`` names a CPU, else the host's): 16 with AVX-512 (32 registers of 16 lanes: the
    rest hold the weight vectors and the broadcast x), else 4 (AVX2 has 16 registers of 8 lanes and
    a 16-lane sum takes two of them). A wider tile spills its sums to the stack at every k: on a
    2-vCPU AVX2 EPYC, 16 rows over a 16384 x 6144 weight in panel order took 110 ms in 4-row x
    4-vector tiles and 58 ms in 4 x 1 (one thread, medians of 3)."""
    if features is None:
        name, chosen = getattr(numba.config, "CPU_NAME", None), getattr(numba.config, "CPU_FEATURES", None)
        if name is not None or chosen is not None:
            features = chosen or ""
        else:
            features = binding.get_host_cpu_features().flatten()
    return 16 if "+avx512f" in features.split(",") else 4


TILE_VECTORS = tile_vectors()


def tile_width(rows: int, widest: int) -> int:
    """The vectors a tile of ``rows`` rows holds: ``widest``, or fewer where :data:`TILE_VECTORS` says."""
    return max(1, min(widest, TILE_VECTORS // rows))


def tile_kernel(rows: int, vecs: int, spread: bool = False, carry: bool = False) -> Any:
    """An njit-callable ``tile(xs, xstep, w, wstride, depth, outs)`` over byte addresses (int64):
    for each of the ``rows`` rows r (``xs``, ``outs``: UniTuple(int64, rows)), out_r[0 : vecs*16] =
    sum over k < depth, ascending, of x_r[k] * w[k, 0 : vecs*16], where x_r[k] is the f32 at
    ``xs[r] + k * xstep`` and w's row k the f32s at ``w + k * wstride`` (contiguous).

    ``spread``: ``tile(xs, xstep, w, wstride, depth, outs, vstride)``, w's vector v of row k at
    ``w + k * wstride + v * vstride`` (a weight in panel order, one 16-column panel per vector);
    out's vectors stay contiguous.

    ``carry``: the sums start from out's values, not from 0 (out_r += ..., each sum's chain carried on:
    a k range cut in blocks, one tile call each, gives the bits of one call over all of k, since the
    f32 stored between the blocks is the register's value and 0 + x[0] * w[0] is the same whether the
    0 is a constant or read back)."""
    addr = types.UniTuple(types.int64, rows)  # type: ignore[no-untyped-call]
    sig = types.none(addr, types.int64, types.int64, types.int64, types.int64, addr, *[types.int64] * spread)
    codegen = _tile_codegen(rows, vecs, spread, carry)
    if spread:
        @intrinsic
        def spread_tile(typingctx: Any, xs: Any, xstep: Any, w: Any, wstride: Any, depth: Any, outs: Any,
                        vstride: Any) -> Any:  # pragma: no cover - compile-time
            return sig, codegen

        return spread_tile

    @intrinsic
    def tile(typingctx: Any, xs: Any, xstep: Any, w: Any, wstride: Any, depth: Any,
             outs: Any) -> Any:  # pragma: no cover - compile-time
        return sig, codegen

    return tile


def _tile_codegen(rows: int, vecs: int, spread: bool, carry: bool) -> Any:
    """The IR of :func:`tile_kernel`'s tile: a k loop whose rows x vecs sums are phi values (registers)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # pragma: no cover - compile-time
        xs_v, xstep_v, w_v, wstride_v, depth_v, outs_v = args[:6]
        f32, i64 = ir.FloatType(), ir.IntType(64)
        vt = ir.VectorType(f32, LANES)
        vptr, fptr = vt.as_pointer(), f32.as_pointer()
        zero = ir.Constant(vt, [0.0] * LANES)
        splat_mask = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        x_at = [builder.extract_value(xs_v, r) for r in range(rows)]
        o_at = [builder.extract_value(outs_v, r) for r in range(rows)]
        w_off = [builder.mul(ir.Constant(i64, v), args[6]) if spread else ir.Constant(i64, 4 * LANES * v)
                 for v in range(vecs)]  # byte offset of w's vector v within its row k
        starts = [[builder.load(builder.inttoptr(builder.add(o_at[r], ir.Constant(i64, 4 * LANES * v)), vptr),
                                align=4, typ=vt) if carry else zero for v in range(vecs)] for r in range(rows)]
        pre = builder.basic_block
        header = builder.append_basic_block("tile.header")
        body = builder.append_basic_block("tile.body")
        done = builder.append_basic_block("tile.done")
        builder.branch(header)
        builder.position_at_end(header)
        k = builder.phi(i64)
        k.add_incoming(ir.Constant(i64, 0), pre)
        accs = [[builder.phi(vt) for _ in range(vecs)] for _ in range(rows)]
        for r in range(rows):
            for v in range(vecs):
                accs[r][v].add_incoming(starts[r][v], pre)
        builder.cbranch(builder.icmp_signed("<", k, depth_v), body, done)
        builder.position_at_end(body)
        w_row = builder.add(w_v, builder.mul(k, wstride_v))
        wv = [builder.load(builder.inttoptr(builder.add(w_row, w_off[v]), vptr), align=4, typ=vt)
              for v in range(vecs)]
        for r in range(rows):
            xv = builder.load(builder.inttoptr(builder.add(x_at[r], builder.mul(k, xstep_v)), fptr),
                              align=4, typ=f32)
            one = builder.insert_element(ir.Constant(vt, ir.Undefined), xv, ir.Constant(ir.IntType(32), 0))
            splat = builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined), splat_mask)
            for v in range(vecs):
                accs[r][v].add_incoming(builder.fadd(accs[r][v], builder.fmul(splat, wv[v])), body)
        k.add_incoming(builder.add(k, ir.Constant(i64, 1)), body)
        builder.branch(header)
        builder.position_at_end(done)
        for r in range(rows):
            for v in range(vecs):
                builder.store(accs[r][v], builder.inttoptr(builder.add(o_at[r], ir.Constant(i64, 4 * LANES * v)),
                                                           vptr), align=4)
        return context.get_dummy_value()

    return codegen



# (rows, vecs): a tile holds rows x vecs vector sums, at most TILE_VECTORS (16 with AVX-512, whose 32
# registers also hold the weight vectors and the broadcast x; 4 on AVX2). These tiles serve weights in
# [K, N] order that stay in cache (W_UK / W_UV by head, widths that are not whole panels). On a 2-vCPU
# AVX2 EPYC, 16 rows over glm-mini's shapes took about half the time in tiles of 4 sums as in 4 x 4
# (q_b 20 -> 10 us, the dense down 65 -> 29-41 us; BENCHMARKS.md, session 24); session 23 saw no gain
# at the step, where the products then hid behind lm_head's strided reads.
# Columns go to the widest tile first, then halves: a tile of few rows needs several vectors, or its one
# chain of adds waits on each add's latency at every k. _V4.._V1: the widths by row count.
def _vecs(rows: int, widest: int, count: int) -> tuple[int, ...]:
    """``count`` tile widths (vectors) for ``rows`` rows: ``widest`` halving, each capped at TILE_VECTORS sums."""
    return tuple(max(1, min(widest >> i, TILE_VECTORS // rows)) for i in range(count))


_V4, _V3, _V2, _V1 = _vecs(4, 4, 2), _vecs(3, 4, 3), _vecs(2, 8, 4), _vecs(1, 16, 5)
_T4 = tuple(tile_kernel(4, v) for v in _V4)  # by row count: the tiles, widest first
_T3 = tuple(tile_kernel(3, v) for v in _V3)
_T2 = tuple(tile_kernel(2, v) for v in _V2)
_T1 = tuple(tile_kernel(1, v) for v in _V1)
_T4W, _T4N = _T4
_T3W, _T3H, _T3N = _T3
_T2W, _T2H, _T2Q, _T2N = _T2
_T1W, _T1H, _T1Q, _T1E, _T1N = _T1
_f32_at = pointer_to(types.float32)
# one signature each (strided x and out: plain rows, a head's): compiled once
_X, _W = types.Array(types.float32, 2, "A"), types.Array(types.float32, 2, "C")
_I, _Q = types.Array(types.int64, 1, "C"), types.UniTuple(types.int64, 4)  # type: ignore[no-untyped-call]


@njit(types.int64(types.int64, _Q, _Q, types.int64, types.int64, types.int64, types.int64, types.int64,
                  types.int64), cache=True, nogil=True, boundscheck=False)
def _tiles(rows: int, xs: Any, os: Any, wa: int, ws: int, xk: int, depth: int, n: int,
           n1: int) -> int:  # pragma: no cover - compiled
    """The vector tiles of ``rows`` (1-4) rows (x and out row addresses ``xs``, ``os``: 4-tuples, the
    first ``rows`` used) over columns [n, n1), widest first: returns the first column they left."""
    if rows == 4:
        while n + _V4[0] * LANES <= n1:
            _T4W(xs, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n, os[1] + 4 * n, os[2] + 4 * n, os[3] + 4 * n))
            n += _V4[0] * LANES
        while n + _V4[1] * LANES <= n1:
            _T4N(xs, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n, os[1] + 4 * n, os[2] + 4 * n, os[3] + 4 * n))
            n += _V4[1] * LANES
    elif rows == 3:
        x3 = (xs[0], xs[1], xs[2])
        while n + _V3[0] * LANES <= n1:
            _T3W(x3, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n, os[1] + 4 * n, os[2] + 4 * n))
            n += _V3[0] * LANES
        if n + _V3[1] * LANES <= n1:
            _T3H(x3, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n, os[1] + 4 * n, os[2] + 4 * n))
            n += _V3[1] * LANES
        if n + _V3[2] * LANES <= n1:
            _T3N(x3, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n, os[1] + 4 * n, os[2] + 4 * n))
            n += _V3[2] * LANES
    elif rows == 2:
        x2 = (xs[0], xs[1])
        while n + _V2[0] * LANES <= n1:
            _T2W(x2, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n, os[1] + 4 * n))
            n += _V2[0] * LANES
        if n + _V2[1] * LANES <= n1:
            _T2H(x2, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n, os[1] + 4 * n))
            n += _V2[1] * LANES
        if n + _V2[2] * LANES <= n1:
            _T2Q(x2, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n, os[1] + 4 * n))
            n += _V2[2] * LANES
        if n + _V2[3] * LANES <= n1:
            _T2N(x2, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n, os[1] + 4 * n))
            n += _V2[3] * LANES
    else:
        x1 = (xs[0],)
        while n + _V1[0] * LANES <= n1:
            _T1W(x1, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n,))
            n += _V1[0] * LANES
        if n + _V1[1] * LANES <= n1:
            _T1H(x1, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n,))
            n += _V1[1] * LANES
        if n + _V1[2] * LANES <= n1:
            _T1Q(x1, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n,))
            n += _V1[2] * LANES
        if n + _V1[3] * LANES <= n1:
            _T1E(x1, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n,))
            n += _V1[3] * LANES
        if n + _V1[4] * LANES <= n1:
            _T1N(x1, xk, wa + 4 * n, ws, depth, (os[0] + 4 * n,))
            n += _V1[4] * LANES
    return n


@njit(types.void(_X, _Q, types.int64, _W, _X, _Q, types.int64, types.int64), cache=True, nogil=True,
      boundscheck=False)
def _rest(x: np.ndarray, r: Any, rows: int, wt: np.ndarray, out: np.ndarray, o: Any, n0: int,
          n1: int) -> None:  # pragma: no cover - compiled
    """The columns [n0, n1) (fewer than 16) of up to four rows (x rows ``r``, out rows ``o``), the plain
    loop: a multiply then an add, k ascending. Each out row is taken as a contiguous view (out is
    strided between rows, contiguous along N), so the compiler vectorises the column loop."""
    oa, os = out.ctypes.data, out.strides[0]
    a0, a1 = carray(_f32_at(oa + o[0] * os), n1), carray(_f32_at(oa + o[1] * os), n1)  # [n1] f32 each
    a2, a3 = carray(_f32_at(oa + o[2] * os), n1), carray(_f32_at(oa + o[3] * os), n1)
    for q in range(rows):
        for n in range(n0, n1):
            out[o[q], n] = 0
    if rows == 4:  # four rows share each weight load
        r0, r1, r2, r3 = r
        for k in range(wt.shape[0]):
            x0, x1, x2, x3 = x[r0, k], x[r1, k], x[r2, k], x[r3, k]
            w_row = wt[k]
            for n in range(n0, n1):
                w = w_row[n]
                a0[n] = a0[n] + x0 * w
                a1[n] = a1[n] + x1 * w
                a2[n] = a2[n] + x2 * w
                a3[n] = a3[n] + x3 * w
        return
    for q in range(rows):
        xr, acc = x[r[q]], carray(_f32_at(oa + o[q] * os), n1)  # acc: [n1] f32
        for k in range(wt.shape[0]):
            xv, w_row = xr[k], wt[k]
            for n in range(n0, n1):
                acc[n] = acc[n] + xv * w_row[n]


@njit(types.void(_X, _I, _W, _X, _I, types.int64), cache=True, nogil=True, boundscheck=False)
def tile_rows(x: np.ndarray, xi: np.ndarray, wt: np.ndarray, out: np.ndarray, oi: np.ndarray,
              block: int) -> None:  # pragma: no cover - compiled
    """out[oi[r]] [N] = x[xi[r]] [K] @ wt [K, N] for each r < len(xi), k ascending per element (bitwise
    :func:`kernels.model.rowwise.rows_times`'s chains): ``block`` columns at a time, up to four rows
    sharing each tile's weight loads; x's and wt's rows contiguous along k and N, out's along N."""
    n_rows = xi.shape[0]
    depth, width = wt.shape
    xa, wa, oa = x.ctypes.data, wt.ctypes.data, out.ctypes.data
    xs, ws, os, xk = x.strides[0], wt.strides[0], out.strides[0], x.strides[1]
    for n0 in range(0, width, block):
        n1 = min(n0 + block, width)
        for b in range(0, n_rows, 4):
            rows = min(4, n_rows - b)
            r = (xi[b], xi[b + min(1, rows - 1)], xi[b + min(2, rows - 1)], xi[b + rows - 1])
            o = (oi[b], oi[b + min(1, rows - 1)], oi[b + min(2, rows - 1)], oi[b + rows - 1])
            n = n0
            if n_rows >= 4:  # a step of fewer rows: the plain loop (each weight row read once, in order)
                n = _tiles(rows, (xa + r[0] * xs, xa + r[1] * xs, xa + r[2] * xs, xa + r[3] * xs),
                           (oa + o[0] * os, oa + o[1] * os, oa + o[2] * os, oa + o[3] * os), wa, ws, xk, depth, n0,
                           n1)
            if n < n1:
                _rest(x, r, rows, wt, out, o, n, n1)


@njit(cache=True, nogil=True, boundscheck=False)
def tile_heads(x: np.ndarray, w: np.ndarray, out: np.ndarray, idx: np.ndarray) -> None:  # pragma: no cover
    """out [n, H, N] = x [n, H, K] @ w [H, K, N] per head, k ascending per element (bitwise
    :func:`kernels.model.rowwise.heads_times`): each head's weights shared by up to four rows'
    tiles; ``idx``: the n row indices 0, 1, .."""
    for h in range(w.shape[0]):
        tile_rows(x[:, h, :], idx, w[h], out[:, h, :], idx, w.shape[2])


__all__ = ["LANES", "TILE_VECTORS", "tile_heads", "tile_kernel", "tile_rows", "tile_vectors", "tile_width"]
