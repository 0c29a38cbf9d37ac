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
context are bitwise those of its step alone, whoever shares the batch.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit, types, void
from numba.extending import intrinsic

from kernels.attention.select_step import engine_topk, score_row
from kernels.attention.sparse_step import attend_one
from kernels.compile_notice import announce_if_cold
from kernels.fp8 import USABLE_SCALE_BOUND

LATENT_FIELDS = 10  # start, length, then (address, row stride) of lc codes, lc scale, rc codes, rc scale
INDEX_FIELDS = 4  # start, length, address, row stride


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


@njit(void(_A3, _A2, _I3, _I1, _I2, _I1), cache=True, nogil=True, boundscheck=False)
def select_rows(qi: np.ndarray, w: np.ndarray, tables: np.ndarray, visible: np.ndarray, out: np.ndarray,
                counts: np.ndarray) -> None:  # pragma: no cover - compiled
    """Each session's rows to attend: qi [B, nh, hd] f32 and w [B, nh] f32 (already times
    hd ** -0.5) against its keys, tables [B, NB, INDEX_FIELDS]; ``visible`` [B] keys it sees
    (positions [0, visible)). A session seeing more than k = out.shape[1] takes the engine's
    top-k (ascending); one seeing fewer takes all of them. -> out [B, k] i64, counts [B] i64."""
    k = out.shape[1]
    hd = qi.shape[2]
    scores = np.empty(max(int(visible.max()), 1), np.float32)  # scores: [T] f32 scratch
    for b in range(qi.shape[0]):
        n = visible[b]
        if n <= k:
            for j in range(n):
                out[b, j] = j
            counts[b] = n
            continue
        for blk in range(tables.shape[1]):
            start, length, address, stride = tables[b, blk, 0], tables[b, blk, 1], tables[b, blk, 2], tables[b, blk, 3]
            for r in range(min(length, n - start)):
                scores[start + r] = score_row(qi[b], w[b], carray(_f32_at(address + r * stride), hd))
        engine_topk(scores[:n], out[b])
        counts[b] = k


@njit(void(_A3, _A3, _I3, _I2, _I1, _TABLE, _F32, _A3), cache=True, nogil=True, boundscheck=False)
def attend_rows(qa: np.ndarray, qr: np.ndarray, tables: np.ndarray, sel: np.ndarray, counts: np.ndarray,
                table: np.ndarray, scale: np.float32, ctx: np.ndarray) -> None:  # pragma: no cover - compiled
    """ctx [B, H, K] f32: session b's queries qa [B, H, K], qr [B, H, R] over its rows sel[b, :counts[b]]
    (ascending positions) of its fp8 blocks, tables [B, NB, LATENT_FIELDS], decoded through
    ``table`` (DECODE_TABLE [256] f32) with sanitised scales."""
    width, rope = qa.shape[2], qr.shape[2]
    k_max = sel.shape[1]
    lc_f = np.empty((k_max, width), np.float32)  # lc_f: [k, K] f32, one session's decoded rows
    rc_f = np.empty((k_max, rope), np.float32)  # rc_f: [k, R] f32
    lsc = np.empty(k_max, np.float32)  # lsc: [k] f32 sanitised scales
    rsc = np.empty(k_max, np.float32)  # rsc: [k] f32
    scores = np.empty(k_max, np.float32)  # scores: [k] f32 scratch
    for b in range(qa.shape[0]):
        k = counts[b]
        blk = 0
        for j in range(k):
            pos = sel[b, j]
            blk, r = block_of(tables, b, blk, pos)
            lc8 = carray(_u8_at(tables[b, blk, 2] + r * tables[b, blk, 3]), width)
            rc8 = carray(_u8_at(tables[b, blk, 6] + r * tables[b, blk, 7]), rope)
            for n in range(width):
                lc_f[j, n] = table[lc8[n]]
            for n in range(rope):
                rc_f[j, n] = table[rc8[n]]
            s = carray(_f32_at(tables[b, blk, 4] + r * tables[b, blk, 5]), 1)[0]
            lsc[j] = s if (s > 0 and s < _BOUND) else np.float32(0.0)
            s = carray(_f32_at(tables[b, blk, 8] + r * tables[b, blk, 9]), 1)[0]
            rsc[j] = s if (s > 0 and s < _BOUND) else np.float32(0.0)
        attend_one(qa[b], qr[b], lc_f[:k], rc_f[:k], lsc[:k], rsc[:k], scale, scores[:k], ctx[b])


__all__ = ["INDEX_FIELDS", "LATENT_FIELDS", "attend_rows", "block_of", "pointer_to", "select_rows", "write_fp8_rows",
           "write_keys"]
