"""The compiled step's (:mod:`kernels.model.compiled_step`) kernels for v3 (4-bit) caches: each new
row encoded by its codec (rotated int4, or PolarQuant of 2..6 bits), and each session's selected
rows decoded and attended, in compiled code.

The tables are those of :mod:`kernels.attention.row_tables` with v3 rows in the fp8 fields (a row's
code bytes contiguous, its f32 radius where the fp8 scale sits), so the rows are written by its
``write_fp8_rows``. A codec is handed to the kernels as :func:`codec_params` of each row width.

Bitwise the reference step over v3 caches, by doing its arithmetic in its order, element by element:
the encode is :meth:`kernels.tq.TqCodec.encode_rows` (the radius summed in float64 in index order,
the sign flip and the f32 Walsh-Hadamard stages of :mod:`kernels.tq.rotation`, int4's nearest
level with its threshold count and full-scan fallback, PolarQuant's libm ``atan2f``/``hypotf`` tree
and grid, LSB-first packing); the decode is ``decode_block_into`` (the reading rule on radii,
levels times ``radius / sqrtf(n)`` or the cosf/sinf tree, unrotate, inert rows exact zeros), with
factors 1.0 as the reference's ``TileGatherer`` hands them to
:func:`kernels.attention.sparse_step.attend_one`.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit, types

from kernels.attention.row_tables import block_of, pointer_to
from kernels.attention.sparse_step import attend_one
from kernels.compile_notice import announce_if_cold
from kernels.tq import RADIUS_BOUND, RADIUS_MIN, SIGNS, TqCodec
from kernels.tq.int4 import LEVELS
from kernels.tq.polar import PI, polar_layout

INT4, POLAR = 0, 1  # codec kinds as the kernels take them
_F32 = types.float32


_u8_at, _f32_at = pointer_to(types.uint8), pointer_to(_F32)


def codec_params(codec: TqCodec, n: int) -> tuple[np.ndarray, ...]:
    """What the kernels need of ``codec`` at row width ``n``: (kind [3] i64 (INT4/POLAR, bits, row
    bytes), consts [4] f32 (1/sqrtf(n), sqrtf(n), pi, 0.5/pi as f32), signs [n] f32, levels [16]
    f32, fields [n-1, 3] i64 (bit offset, width, table base of each PolarQuant angle), tree [nl, 3]
    i64 (first field, count, width of each level), grid [nl, 2] f32 (lo, span), cos, sin [K] f32).
    int4 gets one-row placeholders for the PolarQuant arrays (one compiled signature for both)."""
    sq = np.sqrt(np.float32(n))
    consts = np.array([np.float32(1.0) / sq, sq, PI, np.float32(0.5) / PI], np.float32)
    signs = np.array(SIGNS[:n], np.float32)  # [n] f32, writable (one array type for every codec)
    levels = np.array(LEVELS, np.float32)  # [16] f32
    if codec.kind == "int4":
        return (np.array([INT4, 4, codec.row_bytes(n)], np.int64), consts, signs, levels, np.zeros((1, 3), np.int64),
                np.zeros((1, 3), np.int64), np.zeros((1, 2), np.float32), np.zeros(1, np.float32),
                np.zeros(1, np.float32))
    layout = polar_layout(n, codec.bits)
    fields = np.stack([layout.fields.offsets, layout.fields.widths, layout.field_base.astype(np.int64)], axis=1)
    tree = np.array([[lv.start, lv.count, lv.width] for lv in layout.levels], np.int64)  # [nl, 3]
    grid = np.array([[lv.lo, lv.span] for lv in layout.levels], np.float32)  # [nl, 2]
    return (np.array([POLAR, codec.bits, codec.row_bytes(n)], np.int64), consts, signs, levels,
            np.ascontiguousarray(fields, np.int64),
            tree, grid, np.array(layout.cos_table, np.float32), np.array(layout.sin_table, np.float32))


def no_codec() -> tuple[np.ndarray, ...]:
    """Placeholders of :func:`codec_params`' types (row bytes 0) for a step whose caches are not v3."""
    return (np.zeros(3, np.int64), np.zeros(4, np.float32), np.zeros(1, np.float32), np.zeros(16, np.float32),
            np.zeros((1, 3), np.int64), np.zeros((1, 3), np.int64), np.zeros((1, 2), np.float32),
            np.zeros(1, np.float32), np.zeros(1, np.float32))


announce_if_cold(__file__)  # numba compiles the kernels below with the compiled step (its first call) unless cached

_BOUND, _MIN = np.float32(RADIUS_BOUND), np.float32(RADIUS_MIN)


@njit(cache=True, nogil=True, boundscheck=False)
def _fwht(a: np.ndarray, tmp: np.ndarray, inv_sqrt: np.float32) -> np.ndarray:  # pragma: no cover - compiled
    """kernels.tq.rotation.fwht of a [n] f32 (ping-pong with tmp [n]); returns the array holding it."""
    n = a.shape[0]
    src, dst = a, tmp
    length = 1
    while length < n:
        for blk in range(0, n, 2 * length):
            for i in range(length):
                u, v = src[blk + i], src[blk + length + i]
                dst[blk + i] = u + v
                dst[blk + length + i] = u - v
        src, dst = dst, src
        length *= 2
    for i in range(n):
        src[i] = src[i] * inv_sqrt
    return src


@njit(cache=True, nogil=True, boundscheck=False)
def _radius(x: np.ndarray) -> np.float32:  # pragma: no cover - compiled
    """kernels.tq.rotation.row_radius of one row: sequential float64 sum of squares, sqrt, to f32."""
    total = 0.0
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        total += v * v
    return np.float32(np.sqrt(total))


@njit(cache=True, nogil=True, boundscheck=False)
def _nearest(z: np.float32, levels: np.ndarray) -> int:  # pragma: no cover - compiled
    """kernels.tq.int4.nearest_levels of one element (its full scan where |z| > 1e4 or NaN)."""
    if abs(z) <= np.float32(1e4):
        code = 0
        for k in range(1, 15):
            if z >= levels[k]:
                code += 1
        if abs(z - levels[code + 1]) < abs(z - levels[code]):
            code += 1
        return code
    best, code = abs(z - levels[0]), 0
    for k in range(1, 16):
        dist = abs(z - levels[k])
        if dist < best:
            best, code = dist, k
    return code


@njit(cache=True, nogil=True, boundscheck=False)
def encode_tq_rows(x: np.ndarray, p: Any, codes: np.ndarray, radius: np.ndarray) -> None:  # pragma: no cover
    """Rows x [B, n] f32 -> codes [B, rb] u8 and radius [B] f32 (inert rows: zeros), each row as
    ``TqCodec.encode_rows`` encodes it; ``p``: :func:`codec_params` of width n."""
    kind_bits, consts, signs, levels, fields, tree, grid, _, _ = p
    n = x.shape[1]
    rot, tmp, ang = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float32)
    ra, rb = np.empty(n, np.float32), np.empty(n, np.float32)  # a level's radii and the next's
    q = np.empty(max(n - 1, 1), np.int64)  # q: [n-1] PolarQuant angle codes
    for b in range(x.shape[0]):
        codes[b, :] = 0
        radius[b] = 0
        rad = _radius(x[b])
        if not (np.isfinite(rad) and rad >= _MIN):
            continue
        radius[b] = rad
        for i in range(n):
            rot[i] = x[b, i] * signs[i]
        y = _fwht(rot, tmp, consts[0])  # y: [n] f32, the rotated row
        if kind_bits[0] == INT4:
            invstd = consts[1] / rad
            for i in range(0, n, 2):
                lo = _nearest(y[i] * invstd, levels)
                hi = _nearest(y[i + 1] * invstd, levels)
                codes[b, i >> 1] = np.uint8(lo | (hi << 4))
            continue
        r, other = ra, rb
        r[:] = y
        for lv in range(tree.shape[0]):
            start, count, width = tree[lv, 0], tree[lv, 1], tree[lv, 2]
            steps = np.float32(1 << width)
            for j in range(count):
                even, odd = r[2 * j], r[2 * j + 1]
                ang[j] = math.atan2(odd, even)
                other[j] = math.hypot(even, odd)
            for j in range(count):
                if lv == 0:
                    t = ((ang[j] + consts[2]) * consts[3]) * steps
                else:
                    t = ((ang[j] - grid[lv, 0]) / grid[lv, 1]) * steps
                t = np.float32(np.floor(t))
                t = t if t >= 0 else np.float32(0)  # NaN and negatives -> 0
                t = min(t, steps - np.float32(1))
                q[start + j] = np.int64(t)
            r, other = other, r
        for f in range(n - 1):
            off, width = fields[f, 0], fields[f, 1]
            for k in range(width):
                if (q[f] >> k) & 1:
                    bit = off + k
                    codes[b, bit >> 3] |= np.uint8(1 << (bit & 7))


@njit(cache=True, nogil=True, boundscheck=False)
def decode_tq_row(src: Any, r: np.float32, p: Any, out: np.ndarray, tmp: np.ndarray,
                cur: np.ndarray) -> None:  # pragma: no cover - compiled
    """One row's code bytes ``src`` [rb] u8 and stored radius r -> out [n] f32, as
    ``TqCodec.decode_block_into`` decodes it (inert rows exact zeros)."""
    kind_bits, consts, signs, levels, fields, tree, _, cos, sin = p
    n = out.shape[0]
    ok = r >= 0 and r < _BOUND
    rad = r if ok else np.float32(0.0)
    if rad == 0:
        out[:] = 0
        return
    if kind_bits[0] == INT4:
        std = rad / consts[1]
        for i in range(0, n, 2):
            byte = src[i >> 1]
            out[i] = levels[byte & 15] * std
            out[i + 1] = levels[byte >> 4] * std
    else:
        cur[0] = rad
        for lv in range(tree.shape[0] - 1, -1, -1):
            start, count = tree[lv, 0], tree[lv, 1]
            for j in range(count):
                f = start + j
                off, width = fields[f, 0], fields[f, 1]
                code = 0
                for k in range(width):
                    bit = off + k
                    code |= ((src[bit >> 3] >> (bit & 7)) & 1) << k
                idx = fields[f, 2] + code
                out[2 * j] = cur[j] * cos[idx]
                out[2 * j + 1] = cur[j] * sin[idx]
            cur[: 2 * count] = out[: 2 * count]
    y = _fwht(out, tmp, consts[0])
    for i in range(n):
        out[i] = y[i] * signs[i]


@njit(cache=True, nogil=True, boundscheck=False)
def attend_tq_rows(qa: np.ndarray, qr: np.ndarray, tables: np.ndarray, sel: np.ndarray, counts: np.ndarray,
                   scale: np.float32, ctx: np.ndarray, lp: Any, rp: Any) -> None:  # pragma: no cover - compiled
    """ctx [B, H, K] f32: session b's queries qa [B, H, K], qr [B, H, R] over its rows sel[b, :counts[b]]
    (ascending positions) of its v3 blocks, tables [B, NB, 10], decoded with ``lp`` / ``rp``
    (:func:`codec_params` of widths K and R), factors 1.0."""
    width, rope = qa.shape[2], qr.shape[2]
    lbytes, rbytes = lp[0][2], rp[0][2]
    k_max = sel.shape[1]
    lc_f = np.empty((k_max, width), np.float32)  # lc_f: [k, K] f32, one session's decoded rows
    rc_f = np.empty((k_max, rope), np.float32)  # rc_f: [k, R] f32
    ones = np.ones(k_max, np.float32)  # [k] f32: decoded rows' factors
    scores = np.empty(k_max, np.float32)  # scores: [k] f32 scratch
    tmp, cur = np.empty(max(width, rope), np.float32), np.empty(max(width, rope), np.float32)
    for b in range(qa.shape[0]):
        k = counts[b]
        blk = 0
        for j in range(k):
            pos = sel[b, j]
            blk, r = block_of(tables, b, blk, pos)
            lrad = carray(_f32_at(tables[b, blk, 4] + r * tables[b, blk, 5]), 1)[0]
            rrad = carray(_f32_at(tables[b, blk, 8] + r * tables[b, blk, 9]), 1)[0]
            decode_tq_row(carray(_u8_at(tables[b, blk, 2] + r * tables[b, blk, 3]), lbytes), lrad, lp, lc_f[j],
                        tmp[:width], cur[:width])
            decode_tq_row(carray(_u8_at(tables[b, blk, 6] + r * tables[b, blk, 7]), rbytes), rrad, rp, rc_f[j],
                        tmp[:rope], cur[:rope])
        attend_one(qa[b], qr[b], lc_f[:k], rc_f[:k], ones[:k], ones[:k], scale, scores[:k], ctx[b])


__all__ = ["INT4", "POLAR", "attend_tq_rows", "codec_params", "decode_tq_row", "encode_tq_rows", "no_codec"]
