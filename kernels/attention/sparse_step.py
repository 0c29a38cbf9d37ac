"""Sparse absorbed attention for one decode step of B sessions at once (DSA, CPU), batch-invariant.

Every session's query (one position, H heads) attends its own ``k`` selected rows; the math is
that of :mod:`kernels.attention.sparse`, per session b and head h over rows j of ``selection[b]``:
    score_j = ((q_abs . table[Lc8_j]) * Lsc_j + (q_rope . table[Rc8_j]) * Rsc_j) * softmax_scale
    p = softmax_j(score) ;  ctx = sum_j (p_j * Lsc_j) * table[Lc8_j] / sum_j p_j
(f32 and v3 rows are gathered decoded with factors 1.0, which multiply exactly).

Each session's k selected rows (only those: no copy of any cache) are gathered into its slice of
one batch scratch: fp8 sessions as codes; others through a ``TileGatherer`` over the caller's
scratch. Then ONE compiled kernel attends them all: a batch of fp8 sessions only (the usual one)
reads its codes through the decode table as it uses them; a mixed batch has its fp8 codes decoded
for the whole batch first. It fixes
its arithmetic per (session, head) by construction (dot products over eight fixed lanes then a
fixed tree, rows in ascending order, strict IEEE f32), so a session's context is bitwise the same
whoever shares the step and however many do.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import njit, types, void

from kernels.attention.absorbed import as_query, check_query_pair
from kernels.attention.attend_lanes import KEYS, SUMS, WIDE, dots4, weighted_rows1, weighted_rows4
from kernels.attention.lanes import lane_sums
from kernels.attention.tables import decode_codes_into, sanitize_scales_into
from kernels.attention.tiles import CacheShape, TileGatherer, cache_shape
from kernels.compile_notice import announce_if_cold
from kernels.errors import FormatError, ModelMismatchError
from kernels.fp8 import DECODE_TABLE
from kernels.rows import Fp8Rows, LatentRows

_F32 = types.float32
_A1, _A2, _A3 = types.Array(_F32, 1, "C"), types.Array(_F32, 2, "C"), types.Array(_F32, 3, "C")
_U3 = types.Array(types.uint8, 3, "C")
_TABLE = types.Array(_F32, 1, "C", readonly=True)  # DECODE_TABLE [256] f32


announce_if_cold(__file__)  # numba compiles the kernels below now unless cached

@njit(_F32(_A1, _A1), cache=True, nogil=True, boundscheck=False,
      inline="always")
def _dot(a: np.ndarray, b: np.ndarray) -> np.float32:  # pragma: no cover - compiled
    """sum a*b over eight fixed lanes (:func:`kernels.attention.lanes.lane_sums`: one vector's chain),
    combined ((0+1)+(2+3))+((4+5)+(6+7)), then the tail in order."""
    n = a.shape[0]
    full = n - n % 8
    s0, s1, s2, s3, s4, s5, s6, s7 = lane_sums(a.ctypes.data, b.ctypes.data, full)
    total: np.float32 = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for i in range(full, n):
        total += a[i] * b[i]
    return total


@njit(_F32(_A1, _A1, types.int64, _F32), cache=True, nogil=True, boundscheck=False, inline="always")
def _tail(a: np.ndarray, b: np.ndarray, full: int, total: np.float32) -> np.float32:  # pragma: no cover - compiled
    """``total`` (the lanes' tree) plus a[i] * b[i] for i in [full, len) in order: :func:`_dot`'s tail."""
    for i in range(full, a.shape[0]):
        total += a[i] * b[i]
    return total


@njit(void(_A2, _A2, _A2, _A2, _A1, _A1, _F32, _A1, _A2), cache=True, nogil=True, boundscheck=False,
      inline="always")
def attend_one(qa: np.ndarray, qr: np.ndarray, lc: np.ndarray, rc: np.ndarray, lsc: np.ndarray, rsc: np.ndarray,
                scale: np.float32, scores: np.ndarray, ctx: np.ndarray) -> None:  # pragma: no cover - compiled
    """One session: ctx [H, K] from qa [H, K], qr [H, R] over its rows lc [k, K], rc [k, R] and
    their factors lsc, rsc [k]; ``scores`` [k] is scratch.

    Per head: score_j = ((qa . lc_j) * lsc_j + (qr . rc_j) * rsc_j) * scale, each dot :func:`_dot`'s
    (four keys at a time: :func:`kernels.attention.attend_lanes.dots4`, the same lanes and tree);
    p_j = exp(score_j - max), total = sum_j p_j in order; ctx = (sum_j (p_j * lsc_j) * lc_j in row
    order) / total (:func:`kernels.attention.attend_lanes.weighted_rows4` over 64 columns at a time)."""
    heads, width = qa.shape
    rope, k = qr.shape[1], lc.shape[0]
    full_a, full_r = width - width % SUMS, rope - rope % SUMS
    lc_at, ls, rc_at, rs = lc.ctypes.data, lc.strides[0], rc.ctypes.data, rc.strides[0]
    grouped = k - k % KEYS
    for h in range(heads):
        qa_h, qr_h = qa[h], qr[h]
        top = np.float32(-np.inf)
        for j0 in range(0, grouped, KEYS):
            da = dots4(qa.ctypes.data + h * qa.strides[0], lc_at + j0 * ls, ls, full_a)
            dr = dots4(qr.ctypes.data + h * qr.strides[0], rc_at + j0 * rs, rs, full_r)
            for g in range(KEYS):
                j = j0 + g
                v = (_tail(qa_h, lc[j], full_a, da[g]) * lsc[j] + _tail(qr_h, rc[j], full_r, dr[g]) * rsc[j]) * scale
                scores[j] = v
                if v > top:
                    top = v
        for j in range(grouped, k):
            v = (_dot(qa_h, lc[j]) * lsc[j] + _dot(qr_h, rc[j]) * rsc[j]) * scale
            scores[j] = v
            if v > top:
                top = v
        total = np.float32(0.0)
        for j in range(k):
            p = np.float32(np.exp(scores[j] - top))
            total += p
            scores[j] = p * lsc[j]  # scores: [k] now each row's weight
        acc = ctx[h]  # acc: [K] f32
        out, weights, n0 = ctx.ctypes.data + h * ctx.strides[0], scores.ctypes.data, 0
        while n0 + 4 * WIDE <= width:
            weighted_rows4(weights, lc_at + 4 * n0, ls, k, out + 4 * n0)
            n0 += 4 * WIDE
        while n0 + WIDE <= width:
            weighted_rows1(weights, lc_at + 4 * n0, ls, k, out + 4 * n0)
            n0 += WIDE
        for n in range(n0, width):
            s = np.float32(0.0)
            for j in range(k):
                s = s + scores[j] * lc[j, n]
            acc[n] = s
        for n in range(width):
            acc[n] = acc[n] / total


@njit(void(_A3, _A3, _A3, _A3, _A2, _A2, _F32, _A3), cache=True, nogil=True, boundscheck=False)
def _attend_selected(qa: np.ndarray, qr: np.ndarray, lc: np.ndarray, rc: np.ndarray, lsc: np.ndarray,
                     rsc: np.ndarray, scale: np.float32, ctx: np.ndarray) -> None:  # pragma: no cover - compiled
    """ctx [B, H, K] from qa [B, H, K], qr [B, H, R] over rows lc [B, k, K], rc [B, k, R] and their
    factors lsc, rsc [B, k]."""
    scores = np.empty(lc.shape[1], np.float32)
    for b in range(qa.shape[0]):
        attend_one(qa[b], qr[b], lc[b], rc[b], lsc[b], rsc[b], scale, scores, ctx[b])


@njit(void(_A3, _A3, _U3, _U3, _TABLE, _A2, _A2, _F32, _A3), cache=True, nogil=True, boundscheck=False)
def _attend_codes(qa: np.ndarray, qr: np.ndarray, lc: np.ndarray, rc: np.ndarray, table: np.ndarray,
                  lsc: np.ndarray, rsc: np.ndarray, scale: np.float32, ctx: np.ndarray) -> None:  # pragma: no cover
    """``_attend_selected`` over fp8 codes lc [B, k, K], rc [B, k, R] u8: each session's rows are
    decoded through ``table`` [256] f32 (DECODE_TABLE) into a scratch of one session's size just
    before it attends them; the same arithmetic on the same values, bitwise, without a decoded
    copy of the whole batch."""
    n_sessions, k, width = lc.shape
    rope = rc.shape[2]
    scores = np.empty(k, np.float32)
    lc_f = np.empty((k, width), np.float32)  # lc_f: [k, K] f32, one session's decoded rows
    rc_f = np.empty((k, rope), np.float32)  # rc_f: [k, R] f32
    for b in range(n_sessions):
        for j in range(k):
            for n in range(width):
                lc_f[j, n] = table[lc[b, j, n]]
            for n in range(rope):
                rc_f[j, n] = table[rc[b, j, n]]
        attend_one(qa[b], qr[b], lc_f, rc_f, lsc[b], rsc[b], scale, scores, ctx[b])


def _take_signature(readonly: bool) -> Any:
    """One block's fields, strided and read-only or not (a file's mapping); our outputs, contiguous."""
    u8 = types.Array(types.uint8, 2, "A", readonly=readonly)
    f32 = types.Array(_F32, 1, "A", readonly=readonly)
    out8, out32 = types.Array(types.uint8, 2, "C"), types.Array(_F32, 1, "C")
    return void(u8, u8, f32, f32, types.Array(types.int64, 1, "C"), types.int64, out8, out8, out32, out32)


def _take_rows(lc: np.ndarray, rc: np.ndarray, lsc: np.ndarray, rsc: np.ndarray, positions: np.ndarray, start: int,
               out_lc: np.ndarray, out_rc: np.ndarray, out_lsc: np.ndarray,
               out_rsc: np.ndarray) -> None:  # pragma: no cover - compiled
    """The rows of absolute ``positions`` [k] that fall in one fp8 block (its first row at
    ``start``) copied, codes and scales, to the same indices of the outputs [k, ...]."""
    n = lc.shape[0]
    for j in range(positions.shape[0]):
        r = positions[j] - start
        if 0 <= r < n:
            out_lc[j, :] = lc[r, :]
            out_rc[j, :] = rc[r, :]
            out_lsc[j] = lsc[r]
            out_rsc[j] = rsc[r]


# Holds the GIL: a call copies k rows (a few microseconds), less than handing the GIL to another
# thread and waiting to get it back (up to one switch interval) could ever repay.
_TAKE = {ro: njit(_take_signature(ro), cache=True, boundscheck=False)(_take_rows) for ro in (False, True)}


def _checked_selections(selections: Sequence[np.ndarray], lengths: np.ndarray) -> np.ndarray:
    """The selections as [B, k] i64: session b's positions ascend strictly inside [0, lengths[b])
    (its query is its newest row), the same k for all."""
    arrays = [np.asarray(s).reshape(-1) for s in selections]
    k = arrays[0].shape[0]
    if k < 1 or any(a.shape[0] != k or (a.size and a.dtype.kind not in "iu") for a in arrays):
        raise FormatError("batched sparse decode: every session must select the same number k >= 1 of "
                          "integer positions")
    sel = np.stack(arrays).astype(np.int64, copy=False)  # sel: [B, k] i64
    if bool(np.any(sel[:, 0] < 0)) or bool(np.any(sel[:, -1] >= lengths)):
        raise FormatError("batched sparse decode: selected rows must lie inside each session's cache")
    if k > 1 and bool(np.any(sel[:, 1:] <= sel[:, :-1])):
        raise FormatError("batched sparse decode: each session's selected positions must ascend strictly")
    return sel


class _Fp8Codes:
    """The selected fp8 rows of the batch's all-fp8 sessions, gathered as codes and raw scales
    (a few takes per session), then decoded and sanitised for all of them in one pass each,
    exactly as ``TileGatherer`` does row by row."""

    def __init__(self, n: int, k: int, kv_lora: int, rope: int) -> None:
        self.lc = np.empty((n, k, kv_lora), np.uint8)  # lc: [B, k, kv_lora] u8 codes
        self.rc = np.empty((n, k, rope), np.uint8)  # rc: [B, k, rope] u8 codes
        self.lsc = np.empty((n, k), np.float32)  # lsc: [B, k] f32 raw scales
        self.rsc = np.empty((n, k), np.float32)  # rsc: [B, k] f32 raw scales
        self.rows: list[int] = []

    def take(self, b: int, blocks: Sequence[LatentRows], positions: np.ndarray) -> None:
        """Session b's rows at ascending absolute ``positions`` [k] of its fp8 ``blocks``."""
        start = 0
        for blk in blocks:
            assert isinstance(blk, Fp8Rows)  # the caller checked: every block is fp8
            fields = (blk.lc_codes, blk.rc_codes, blk.lc_scale, blk.rc_scale)
            writable = fields[0].flags.writeable
            if all(f.flags.writeable == writable for f in fields[1:]):  # one compiled call for the four fields
                # (one block's views: the usual case)
                _TAKE[not writable](*fields, positions, start, self.lc[b], self.rc[b], self.lsc[b], self.rsc[b])
            else:
                lo, hi = np.searchsorted(positions, [start, start + blk.length])  # this block's share
                outs: tuple[np.ndarray, ...] = (self.lc, self.rc, self.lsc, self.rsc)
                for field, out in zip(fields, outs, strict=True):
                    np.take(field, positions[lo:hi] - start, axis=0, out=out[b, lo:hi], mode="clip")
            start += blk.length
        self.rows.append(b)

    def scales(self) -> tuple[np.ndarray, np.ndarray]:
        """The sanitised scales of every session (all of them fp8): lsc, rsc [B, k] f32."""
        lsc, rsc = np.empty(self.lsc.shape, np.float32), np.empty(self.rsc.shape, np.float32)
        sanitize_scales_into(self.lsc, lsc)
        sanitize_scales_into(self.rsc, rsc)
        return lsc, rsc

    def decode_into(self, lc: np.ndarray, rc: np.ndarray, lsc: np.ndarray, rsc: np.ndarray) -> None:
        """Rows ``self.rows`` of the f32 scratch: table[code] and sanitised scales."""
        if not self.rows:
            return
        n = lc.shape[0]
        rows = slice(None) if len(self.rows) == n else np.asarray(self.rows)
        for codes, out in ((self.lc, lc), (self.rc, rc)):
            if isinstance(rows, slice):
                decode_codes_into(codes.reshape(-1, codes.shape[2]), out.reshape(-1, out.shape[2]))
            else:
                decoded = np.empty((len(self.rows) * codes.shape[1], codes.shape[2]), np.float32)
                decode_codes_into(codes[rows].reshape(-1, codes.shape[2]), decoded)
                out[rows] = decoded.reshape(len(self.rows), codes.shape[1], codes.shape[2])
        for raw, out in ((self.lsc, lsc), (self.rsc, rsc)):
            clean = np.empty(raw[rows].shape, np.float32)
            sanitize_scales_into(raw[rows], clean)
            out[rows] = clean


def batched_sparse_decode(q_abs: np.ndarray, q_rope: np.ndarray, blocks_of: Sequence[Sequence[LatentRows]],
                          selections: Sequence[np.ndarray], softmax_scale: float,
                          shapes: Sequence[CacheShape] | None = None) -> np.ndarray:
    """One decode step of B sessions: q_abs [B, H, kv_lora], q_rope [B, H, rope], session b over
    rows ``selections[b]`` [k] (ascending absolute positions, the same k for all) of its own
    ``blocks_of[b]`` -> ctx [B, H, kv_lora] f32. ``shapes``: ``cache_shape`` of each session's
    blocks when the caller has them (every layer of a decoder cache has the same)."""
    n = len(blocks_of)
    if n == 0 or len(selections) != n or q_abs.shape[0] != n:
        raise FormatError(f"batched sparse decode: {q_abs.shape[0]} queries, {n} caches, {len(selections)} selections")
    if shapes is None or len(shapes) != n:
        shapes = [cache_shape(blocks) for blocks in blocks_of]
    kv_lora, rope = shapes[0].kv_lora, shapes[0].rope
    if any((s.kv_lora, s.rope) != (kv_lora, rope) for s in shapes):
        raise ModelMismatchError("batched sparse decode: the sessions' caches differ in row widths")
    qa = as_query("q_abs", q_abs, kv_lora)  # qa: [B, H, kv_lora] f32
    qr = as_query("q_rope", q_rope, rope)  # qr: [B, H, rope] f32
    check_query_pair("batched sparse decode", qa, qr)
    sel = _checked_selections(selections, np.array([s.length for s in shapes]))  # sel: [B, k] i64
    k = sel.shape[1]
    ctx = np.empty(qa.shape, np.float32)  # ctx: [B, H, kv_lora] f32
    codes = _Fp8Codes(n, k, kv_lora, rope)
    if all(shape.all_fp8 for shape in shapes):  # the usual batch (one kv dtype): attend the codes as gathered
        for b, blocks in enumerate(blocks_of):
            codes.take(b, blocks, sel[b])
        lsc8, rsc8 = codes.scales()  # [B, k] f32 each
        _attend_codes(qa, qr, codes.lc, codes.rc, DECODE_TABLE, lsc8, rsc8, np.float32(softmax_scale), ctx)
        return ctx
    lc = np.empty((n, k, kv_lora), np.float32)  # lc: [B, k, kv_lora] f32 (codes decoded, unscaled)
    rc = np.empty((n, k, rope), np.float32)  # rc: [B, k, rope] f32
    lsc = np.empty((n, k), np.float32)  # lsc: [B, k] f32 row factors (1.0 for f32 and v3 rows)
    rsc = np.empty((n, k), np.float32)  # rsc: [B, k] f32
    for b, (blocks, shape) in enumerate(zip(blocks_of, shapes, strict=True)):
        if shape.all_fp8:
            codes.take(b, blocks, sel[b])
        else:
            TileGatherer(blocks, shape, k, scratch=(lc[b], rc[b], lsc[b], rsc[b])).gather_at(sel[b])
    codes.decode_into(lc, rc, lsc, rsc)
    _attend_selected(qa, qr, lc, rc, lsc, rsc, np.float32(softmax_scale), ctx)
    return ctx


__all__ = ["attend_one", "batched_sparse_decode"]
