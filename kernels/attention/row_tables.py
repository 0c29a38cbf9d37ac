"""A batched step's per-session work over fp8 caches in ONE compiled call per layer, whatever the
batch: writing every session's new rows and indexer keys, DSA selection and sparse attention.

Each session keeps its rows in arrays of its own (a resumed one also reads its file's mapped
rows), so a kernel that serves the whole batch at once reads and writes them through *address
tables* (int64), as a paged engine's block tables do:
- a latent block: ``(start, length, lc, lc_stride, lsc, lsc_stride, rc, rc_stride, rsc, rsc_stride)``,
  the byte address of row 0 of each fp8 field and its row stride (a row's codes contiguous);
- an indexer-key block: ``(start, length, keys, stride)`` (a row's hd f32 contiguous);
- a destination: the byte address of the row a session's new position goes to.
Blocks of length 0 pad a session's table to the batch's widest. The caller keeps every array
alive and unmoved for the call (:class:`kernels.model.step_tables.StepTables` reserves the rows
of the step first), and checks what a table describes; these kernels trust it.

The arithmetic is that of the session-by-session kernels, by construction: a selection's scores
are :func:`kernels.attention.select_step.score_row` and its cut ``engine_topk``; attention
decodes a session's selected rows through ``DECODE_TABLE``, sanitises their scales as the
readers do (``0 < s < 3.4e38`` else 0.0) and calls the same ``attend_one`` as
:func:`kernels.attention.sparse_step.batched_sparse_decode`. So a session's keys, selection and
context are bitwise those of its step alone, whoever shares the batch. Consecutive rows with one
table (a prompt chunk's rows) share work that does not change a bit: their keys are transposed once
and scored sixteen to a vector (:mod:`kernels.attention.score_lanes`), their rows decoded once.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit, types, void
from numba.extending import intrinsic

from kernels.attention.score_lanes import KEYS, score_transposed
from kernels.attention.select_step import engine_topk, score_row
from kernels.attention.sparse_step import attend_one
from kernels.compile_notice import announce_if_cold
from kernels.fp8 import USABLE_SCALE_BOUND

LATENT_FIELDS = 10  # start, length, then (address, row stride) of lc codes, lc scale, rc codes, rc scale
INDEX_FIELDS = 4  # start, length, address, row stride
LANE_ROWS = 4  # a run of this many rows with one table (a chunk's) shares one transposition / decode of its rows


def pointer_to(dtype: Any) -> Any:
    """An njit-callable ``address (int64) -> CPointer(dtype)`` (the step's tables hold addresses)."""

    @intrinsic
    def at(typingctx: Any, address: Any) -> Any:  # pragma: no cover - compile-time
        if not isinstance(address, types.Integer):
            return None
        ptr = types.CPointer(dtype)  # type: ignore[no-untyped-call]

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(address), codegen

    return at


_u8_at = pointer_to(types.uint8)
_f32_at = pointer_to(types.float32)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def block_of(tables: np.ndarray, b: int, blk: int, pos: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """(block, row in it) of session b's position ``pos`` in its tables [B, NB, LATENT_FIELDS], looked for
    from block ``blk`` on (a session's selected positions ascend: its blocks are walked once, in order)."""
    while pos >= tables[b, blk, 0] + tables[b, blk, 1]:
        blk += 1
    return blk, pos - tables[b, blk, 0]
_BOUND = np.float32(USABLE_SCALE_BOUND)

_F32, _I64 = types.float32, types.int64
_A1, _A2, _A3 = (types.Array(_F32, n, "C") for n in (1, 2, 3))
_U2 = types.Array(types.uint8, 2, "C")
_I1, _I2, _I3 = (types.Array(_I64, n, "C") for n in (1, 2, 3))
_TABLE = types.Array(_F32, 1, "C", readonly=True)


announce_if_cold(__file__)  # numba compiles the kernels below now unless cached

@njit(void(_I2, _U2, _A1, _U2, _A1), cache=True, nogil=True, boundscheck=False)
def write_fp8_rows(dst: np.ndarray, lc: np.ndarray, lsc: np.ndarray, rc: np.ndarray,
                   rsc: np.ndarray) -> None:  # pragma: no cover - compiled
    """Row b of lc [B, K] u8, lsc [B] f32, rc [B, R] u8, rsc [B] f32 to the addresses dst[b] =
    (lc row, lsc, rc row, rsc)."""
    width, rope = lc.shape[1], rc.shape[1]
    for b in range(dst.shape[0]):
        carray(_u8_at(dst[b, 0]), width)[:] = lc[b]
        carray(_f32_at(dst[b, 1]), 1)[0] = lsc[b]
        carray(_u8_at(dst[b, 2]), rope)[:] = rc[b]
        carray(_f32_at(dst[b, 3]), 1)[0] = rsc[b]


@njit(void(_I1, _A2), cache=True, nogil=True, boundscheck=False)
def write_keys(dst: np.ndarray, keys: np.ndarray) -> None:  # pragma: no cover - compiled
    """Row b of keys [B, hd] f32 to address dst[b]."""
    for b in range(dst.shape[0]):
        carray(_f32_at(dst[b]), keys.shape[1])[:] = keys[b]


@njit(void(_I2, _I64, _A2), cache=True, nogil=True, boundscheck=False)
def transpose_keys(blocks: np.ndarray, seen: int, keys_t: np.ndarray) -> None:  # pragma: no cover - compiled
    """keys_t [hd, W] f32 (W >= ``seen``, a multiple of 16): column t = the key at position t < ``seen`` from
    a session's key blocks [NB, INDEX_FIELDS] (start, length, address of row 0, row stride in bytes;
    hd f32 contiguous a row); columns [seen, W) zeroed (scored, never read)."""
    hd = keys_t.shape[0]
    for blk in range(blocks.shape[0]):
        start, length, address, stride = blocks[blk, 0], blocks[blk, 1], blocks[blk, 2], blocks[blk, 3]
        for t in range(start, min(start + length, seen)):
            key = carray(_f32_at(address + (t - start) * stride), hd)  # [hd] f32
            for i in range(hd):
                keys_t[i, t] = key[i]
    for i in range(hd):
        for t in range(seen, keys_t.shape[1]):
            keys_t[i, t] = 0.0


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _same_table(tables: np.ndarray, a: int, b: int) -> bool:  # pragma: no cover - compiled
    """Whether rows a and b of tables [B, NB, F] (key or latent blocks) read the same blocks."""
    for blk in range(tables.shape[1]):
        for f in range(tables.shape[2]):
            if tables[a, blk, f] != tables[b, blk, f]:
                return False
    return True


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _takes_all(b: int, n: int, out: np.ndarray, counts: np.ndarray) -> bool:  # pragma: no cover - compiled
    """Row b seeing ``n`` keys, no more than k = out.shape[1]: it takes every one (True); else False."""
    if n > out.shape[1]:
        return False
    for j in range(n):
        out[b, j] = j
    counts[b] = n
    return True


@njit(cache=True, nogil=True, boundscheck=False)
def _select_row(qi: np.ndarray, w: np.ndarray, tables: np.ndarray, visible: np.ndarray, b: int,
                scores: np.ndarray, out: np.ndarray, counts: np.ndarray) -> None:  # pragma: no cover - compiled
    """Row b's selection, its keys scored one by one (``score_row``) into ``scores`` [>= visible[b]]."""
    k, hd, n = out.shape[1], qi.shape[2], visible[b]
    if _takes_all(b, n, out, counts):
        return
    for blk in range(tables.shape[1]):
        start, length, address, stride = tables[b, blk, 0], tables[b, blk, 1], tables[b, blk, 2], tables[b, blk, 3]
        for r in range(min(length, n - start)):
            scores[start + r] = score_row(qi[b], w[b], carray(_f32_at(address + r * stride), hd))
    engine_topk(scores[:n], out[b])
    counts[b] = k


@njit(cache=True, nogil=True, boundscheck=False)
def _select_run(qi: np.ndarray, w: np.ndarray, blocks: np.ndarray, visible: np.ndarray, b0: int, b1: int,
                seen: int, out: np.ndarray, counts: np.ndarray) -> None:  # pragma: no cover - compiled
    """Rows [b0, b1), which share the key blocks [NB, INDEX_FIELDS] and see at most ``seen`` keys: the
    keys laid across lanes once (keys_t [hd, W], W at least ``seen`` rounded up to 16), then each row's
    selection from its scores (``score_transposed``: bitwise ``score_row``'s)."""
    k, hd = out.shape[1], qi.shape[2]
    width = ((seen + KEYS - 1) // KEYS) * KEYS
    # an odd number of 64-byte lines a row: rows a power of two apart in bytes (1,024 keys: 4 KiB) share
    # cache sets, and the 16 keys' hd loads then miss L1 (51 ns a key at 1,024 keys, 5.9 at 1,040)
    keys_t = np.empty((hd, width + KEYS * (1 - (width // KEYS) % 2)), np.float32)  # [hd, W] f32, key t: column t
    transpose_keys(blocks, seen, keys_t)
    scores = np.empty(width, np.float32)  # scores: [width] f32, one row's at a time
    for b in range(b0, b1):
        n = visible[b]
        if _takes_all(b, n, out, counts):
            continue
        score_transposed(qi[b], w[b], keys_t, n, scores)
        engine_topk(scores[:n], out[b])
        counts[b] = k


@njit(void(_A3, _A2, _I3, _I1, _I2, _I1), cache=True, nogil=True, boundscheck=False)
def select_rows(qi: np.ndarray, w: np.ndarray, tables: np.ndarray, visible: np.ndarray, out: np.ndarray,
                counts: np.ndarray) -> None:  # pragma: no cover - compiled
    """Each session's rows to attend: qi [B, nh, hd] f32 and w [B, nh] f32 (already times
    hd ** -0.5) against its keys, tables [B, NB, INDEX_FIELDS]; ``visible`` [B] keys it sees
    (positions [0, visible)). A session seeing more than k = out.shape[1] takes the engine's
    top-k (ascending); one seeing fewer takes all of them. -> out [B, k] i64, counts [B] i64.

    Consecutive rows with one key table (a prompt's chunk: one session's rows) score their keys laid
    across vector lanes once there are :data:`LANE_ROWS` of them (:func:`_select_run`); a lone row
    scores key by key (:func:`_select_row`). Either way each score is ``score_row``'s, bitwise."""
    b, rows = 0, qi.shape[0]
    scores = np.empty(max(int(visible.max()), 1), np.float32)  # scores: [T] f32 scratch of the lone rows
    while b < rows:
        e, seen = b + 1, visible[b]
        while e < rows and _same_table(tables, b, e):
            seen = max(seen, visible[e])
            e += 1
        if e - b >= LANE_ROWS and seen > out.shape[1]:
            _select_run(qi, w, tables[b], visible, b, e, seen, out, counts)
        else:
            for r in range(b, e):
                _select_row(qi, w, tables, visible, r, scores, out, counts)
        b = e


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _decode_into(tables: np.ndarray, b: int, blk: int, r: int, table: np.ndarray, lc: np.ndarray,
                 rc: np.ndarray) -> tuple[np.float32, np.float32]:  # pragma: no cover - compiled
    """Row r of row b's latent block ``blk`` decoded through ``table`` into lc [K], rc [R] f32 -> its
    (lc, rc) scales, sanitised as the readers do (``0 < s < 3.4e38`` else 0.0)."""
    lc8 = carray(_u8_at(tables[b, blk, 2] + r * tables[b, blk, 3]), lc.shape[0])
    rc8 = carray(_u8_at(tables[b, blk, 6] + r * tables[b, blk, 7]), rc.shape[0])
    for n in range(lc.shape[0]):
        lc[n] = table[lc8[n]]
    for n in range(rc.shape[0]):
        rc[n] = table[rc8[n]]
    s = carray(_f32_at(tables[b, blk, 4] + r * tables[b, blk, 5]), 1)[0]
    t = carray(_f32_at(tables[b, blk, 8] + r * tables[b, blk, 9]), 1)[0]
    return (s if (s > 0 and s < _BOUND) else np.float32(0.0)), (t if (t > 0 and t < _BOUND) else np.float32(0.0))


@njit(cache=True, nogil=True, boundscheck=False)
def _attend_row(qa: np.ndarray, qr: np.ndarray, tables: np.ndarray, sel: np.ndarray, counts: np.ndarray,
                table: np.ndarray, scale: np.float32, ctx: np.ndarray, b: int, lc_f: np.ndarray, rc_f: np.ndarray,
                lsc: np.ndarray, rsc: np.ndarray, scores: np.ndarray) -> None:  # pragma: no cover - compiled
    """Row b's context, each of its selected rows decoded into the scratch lc_f [k, K], rc_f [k, R], lsc,
    rsc [k] (``scores`` [k] scratch)."""
    k, blk = counts[b], 0
    for j in range(k):
        blk, r = block_of(tables, b, blk, sel[b, j])
        lsc[j], rsc[j] = _decode_into(tables, b, blk, r, table, lc_f[j], rc_f[j])
    attend_one(qa[b], qr[b], lc_f[:k], rc_f[:k], lsc[:k], rsc[:k], scale, scores[:k], ctx[b])


@njit(cache=True, nogil=True, boundscheck=False)
def _attend_run(qa: np.ndarray, qr: np.ndarray, tables: np.ndarray, sel: np.ndarray, counts: np.ndarray,
                table: np.ndarray, scale: np.float32, ctx: np.ndarray, b0: int, b1: int, seen: int,
                lc_f: np.ndarray, rc_f: np.ndarray, lsc: np.ndarray, rsc: np.ndarray,
                scores: np.ndarray) -> None:  # pragma: no cover - compiled
    """Rows [b0, b1), which share their latent blocks and select among positions < ``seen``: every such
    row decoded once (not once per row that selects it), then each row's context from copies of its
    selected rows into the scratch lc_f, rc_f, lsc, rsc (the same floats, so bitwise
    :func:`_attend_row`'s)."""
    width, rope = qa.shape[2], qr.shape[2]
    lc_all = np.empty((seen, width), np.float32)  # lc_all: [seen, K] f32, each position decoded once
    rc_all = np.empty((seen, rope), np.float32)  # rc_all: [seen, R] f32
    lsc_all = np.zeros(seen, np.float32)  # lsc_all: [seen] f32 sanitised scales
    rsc_all = np.zeros(seen, np.float32)  # rsc_all: [seen] f32
    for blk in range(tables.shape[1]):
        start, length = tables[b0, blk, 0], tables[b0, blk, 1]
        for t in range(start, min(start + length, seen)):
            lsc_all[t], rsc_all[t] = _decode_into(tables, b0, blk, t - start, table, lc_all[t], rc_all[t])
    for b in range(b0, b1):
        k = counts[b]
        for j in range(k):
            pos = sel[b, j]
            lc_f[j] = lc_all[pos]
            rc_f[j] = rc_all[pos]
            lsc[j], rsc[j] = lsc_all[pos], rsc_all[pos]
        attend_one(qa[b], qr[b], lc_f[:k], rc_f[:k], lsc[:k], rsc[:k], scale, scores[:k], ctx[b])


@njit(void(_A3, _A3, _I3, _I2, _I1, _TABLE, _F32, _A3), cache=True, nogil=True, boundscheck=False)
def attend_rows(qa: np.ndarray, qr: np.ndarray, tables: np.ndarray, sel: np.ndarray, counts: np.ndarray,
                table: np.ndarray, scale: np.float32, ctx: np.ndarray) -> None:  # pragma: no cover - compiled
    """ctx [B, H, K] f32: session b's queries qa [B, H, K], qr [B, H, R] over its rows sel[b, :counts[b]]
    (ascending positions) of its fp8 blocks, tables [B, NB, LATENT_FIELDS], decoded through
    ``table`` (DECODE_TABLE [256] f32) with sanitised scales.

    Consecutive rows with one latent table (a prompt's chunk) whose selections together name more rows
    than they see decode each row once (:func:`_attend_run`); others decode their selected rows
    (:func:`_attend_row`). The floats attended are the same either way."""
    width, rope, k_max, rows = qa.shape[2], qr.shape[2], sel.shape[1], qa.shape[0]
    lc_f = np.empty((k_max, width), np.float32)  # lc_f: [k, K] f32, one session's decoded rows
    rc_f = np.empty((k_max, rope), np.float32)  # rc_f: [k, R] f32
    lsc = np.empty(k_max, np.float32)  # lsc: [k] f32 sanitised scales
    rsc = np.empty(k_max, np.float32)  # rsc: [k] f32
    scores = np.empty(k_max, np.float32)  # scores: [k] f32 scratch
    b = 0
    while b < rows:
        e, named, seen = b + 1, counts[b], (sel[b, counts[b] - 1] + 1 if counts[b] else 0)
        while e < rows and _same_table(tables, b, e):
            named += counts[e]
            seen = max(seen, sel[e, counts[e] - 1] + 1 if counts[e] else 0)
            e += 1
        if e - b >= LANE_ROWS and named > seen:
            _attend_run(qa, qr, tables, sel, counts, table, scale, ctx, b, e, seen, lc_f, rc_f, lsc, rsc, scores)
        else:
            for r in range(b, e):
                _attend_row(qa, qr, tables, sel, counts, table, scale, ctx, r, lc_f, rc_f, lsc, rsc, scores)
        b = e


__all__ = ["INDEX_FIELDS", "LANE_ROWS", "LATENT_FIELDS", "attend_rows", "block_of", "pointer_to", "select_rows",
           "transpose_keys", "write_fp8_rows", "write_keys"]
