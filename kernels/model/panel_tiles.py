"""Register tiles over a weight in panel order (:func:`kernels.model.once_product.panel_order`: its
memory [K / .., N / 16 panels, K, 16]): the product :func:`kernels.model.once_product.gather_panels`
runs for GLM-5.2-sized weights, for up to four rows at a time.

A tile holds ``rows x vecs`` vector sums in registers over a k range, its ``vecs`` (up to 4) vectors
taken from ``vecs`` neighbouring panels (:func:`kernels.model.simd_tile.tile_kernel` with ``spread``):
a step of one row runs 4 independent chains of 16-lane adds, not one, while each panel is still read
from memory once per four rows. The tiles carry on out's sums (``carry``), so a caller may cut k into
blocks that stay in L2 while every row passes over them. Each output element's chain is unchanged
(``((0 + x[0] * w[0, n]) + x[1] * w[1, n]) + ...``, k ascending, a rounded multiply then a rounded add),
so the bits are :func:`kernels.model.rowwise.rows_times`'s whichever rows share the tile.
"""
from __future__ import annotations

from typing import Any

from numba import njit, types

from kernels.model.simd_tile import LANES, tile_kernel, tile_width

GROUP = 4  # panels one pass of the rows covers (a k block of them stays in L2 while every row passes)

# (rows, vecs) as in simd_tile (at most its TILE_VECTORS sums a tile), every tile carrying on out's sums
# (a k range in blocks); panels go to the widest tile first. At most 4 vectors (4 panels, 4 streams from
# memory) a tile: one row's tile over 16 panels read 16 streams at once and took 14.4 ms for a 6144 x 12288
# product against 10.3 for two rows' 8-panel tile; over 4 panels 10.5 (one thread, thread CPU, medians of
# 7: memory's ~30 GB/s either way)
_V4 = (tile_width(4, 4), 1)  # the tiles' widths (panels) by row count, widest first, as simd_tile's
_V3 = (tile_width(3, 4), tile_width(3, 2), 1)
_V2 = (tile_width(2, 4), tile_width(2, 2), 1)
_V1 = (tile_width(1, 4), tile_width(1, 2), 1)
_P4W, _P4N = (tile_kernel(4, v, True, True) for v in _V4)
_P3W, _P3H, _P3N = (tile_kernel(3, v, True, True) for v in _V3)
_P2W, _P2H, _P2N = (tile_kernel(2, v, True, True) for v in _V2)
_P1W, _P1H, _P1N = (tile_kernel(1, v, True, True) for v in _V1)
_N4, _N3, _N3H, _N2, _N2H, _N1, _N1H = _V4[0], _V3[0], _V3[1], _V2[0], _V2[1], _V1[0], _V1[1]
# Four rows' tile of one vector a row (AVX2): two pairs of rows in 2 x 2 tiles instead (16 rows over a
# 16384 x 6144 weight 57 ms against 58, 4 rows 27.7 against 30.9 on a 2-vCPU EPYC: two panels, two streams)
_PAIRED = _N4 == 1
_P = types.UniTuple(types.int64, 2)  # type: ignore[no-untyped-call]
_Q = types.UniTuple(types.int64, 4)  # type: ignore[no-untyped-call]


@njit(types.void(_P, _P, types.int64, types.int64, types.int64, types.int64, types.int64, types.int64),
      cache=True, nogil=True, boundscheck=False)
def _pair(x2: Any, o2: Any, wa: int, pstride: int, xk: int, depth: int, count: int,
          ws: int) -> None:  # pragma: no cover - compiled
    """:func:`panel_tiles` of two rows (x and out row addresses ``x2``, ``o2``)."""
    p = 0
    b = 4 * LANES  # out bytes of one vector
    while p + _N2 <= count:
        _P2W(x2, xk, wa + p * pstride, ws, depth, (o2[0] + p * b, o2[1] + p * b), pstride)
        p += _N2
    if p + _N2H <= count:
        _P2H(x2, xk, wa + p * pstride, ws, depth, (o2[0] + p * b, o2[1] + p * b), pstride)
        p += _N2H
    while p < count:
        _P2N(x2, xk, wa + p * pstride, ws, depth, (o2[0] + p * b, o2[1] + p * b), pstride)
        p += 1


@njit(types.void(types.int64, _Q, _Q, types.int64, types.int64, types.int64, types.int64, types.int64,
                 types.int64), cache=True, nogil=True, boundscheck=False)
def panel_tiles(rows: int, xs: Any, os: Any, wa: int, pstride: int, xk: int, depth: int, count: int,
                ws: int) -> None:  # pragma: no cover - compiled
    """out_r[0 : 16 * count] += x_r @ the ``count`` panels from ``wa`` on (each sum's chain carried on
    from out's value, k ascending), for the ``rows`` (1-4) rows whose x and out row addresses are ``xs``,
    ``os`` (4-tuples, the first ``rows`` used; x_r[k] at ``xs[r] + k * xk``, k < ``depth``); a panel's
    row k is 16 f32 at ``+ k * ws``, the next panel ``pstride`` bytes on."""
    p = 0
    b = 4 * LANES  # out bytes of one vector
    if rows == 4 and _PAIRED:
        _pair((xs[0], xs[1]), (os[0], os[1]), wa, pstride, xk, depth, count, ws)
        _pair((xs[2], xs[3]), (os[2], os[3]), wa, pstride, xk, depth, count, ws)
    elif rows == 4:
        while p + _N4 <= count:
            _P4W(xs, xk, wa + p * pstride, ws, depth, (os[0] + p * b, os[1] + p * b, os[2] + p * b, os[3] + p * b),
                 pstride)
            p += _N4
        while p < count:
            _P4N(xs, xk, wa + p * pstride, ws, depth, (os[0] + p * b, os[1] + p * b, os[2] + p * b, os[3] + p * b),
                 pstride)
            p += 1
    elif rows == 3:
        x3 = (xs[0], xs[1], xs[2])
        while p + _N3 <= count:
            _P3W(x3, xk, wa + p * pstride, ws, depth, (os[0] + p * b, os[1] + p * b, os[2] + p * b), pstride)
            p += _N3
        if p + _N3H <= count:
            _P3H(x3, xk, wa + p * pstride, ws, depth, (os[0] + p * b, os[1] + p * b, os[2] + p * b), pstride)
            p += _N3H
        while p < count:
            _P3N(x3, xk, wa + p * pstride, ws, depth, (os[0] + p * b, os[1] + p * b, os[2] + p * b), pstride)
            p += 1
    elif rows == 2:
        _pair((xs[0], xs[1]), (os[0], os[1]), wa, pstride, xk, depth, count, ws)
    else:
        x1 = (xs[0],)
        while p + _N1 <= count:
            _P1W(x1, xk, wa + p * pstride, ws, depth, (os[0] + p * b,), pstride)
            p += _N1
        if p + _N1H <= count:
            _P1H(x1, xk, wa + p * pstride, ws, depth, (os[0] + p * b,), pstride)
            p += _N1H
        while p < count:
            _P1N(x1, xk, wa + p * pstride, ws, depth, (os[0] + p * b,), pstride)
            p += 1


__all__ = ["GROUP", "panel_tiles"]
