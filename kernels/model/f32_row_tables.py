"""The compiled step's (:mod:`kernels.model.compiled_step`) kernels for f32 (v1) caches: writing
every session's new rows through address tables, and attending each session's selected rows.

The tables are those of :mod:`kernels.attention.row_tables` with f32 rows in the code fields: a
latent block is ``(start, length, lc, lc_stride, 0, 0, rc, rc_stride, 0, 0)`` (a row's floats
contiguous; no scales), a destination ``(lc row, 0, rc row, 0)``
(:func:`kernels.model.row_addresses.latent_table` builds them).

Bitwise the reference step over f32 caches: that one gathers a session's selected f32 rows with
factors 1.0 (``TileGatherer``) and attends them with
:func:`kernels.attention.sparse_step.attend_one`; so does :func:`attend_f32_rows`, from the same
values, each session alone.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit, types, void

from kernels.attention.row_tables import block_of, pointer_to
from kernels.attention.sparse_step import attend_one
from kernels.compile_notice import announce_if_cold

_F32, _I64 = types.float32, types.int64
_A2, _A3 = types.Array(_F32, 2, "C"), types.Array(_F32, 3, "C")
_I1, _I2, _I3 = (types.Array(_I64, n, "C") for n in (1, 2, 3))
_f32_at = pointer_to(_F32)


announce_if_cold(__file__)  # numba compiles the kernels below now unless cached


@njit(void(_I2, _A2, _A2), cache=True, nogil=True, boundscheck=False)
def write_f32_rows(dst: np.ndarray, lc: np.ndarray, rc: np.ndarray) -> None:  # pragma: no cover - compiled
    """Row b of lc [B, K] f32 and rc [B, R] f32 to the addresses dst[b] = (lc row, _, rc row, _)."""
    width, rope = lc.shape[1], rc.shape[1]
    for b in range(dst.shape[0]):
        carray(_f32_at(dst[b, 0]), width)[:] = lc[b]
        carray(_f32_at(dst[b, 2]), rope)[:] = rc[b]


@njit(void(_A3, _A3, _I3, _I2, _I1, _F32, _A3), cache=True, nogil=True, boundscheck=False)
def attend_f32_rows(qa: np.ndarray, qr: np.ndarray, tables: np.ndarray, sel: np.ndarray, counts: np.ndarray,
                    scale: np.float32, ctx: np.ndarray) -> None:  # pragma: no cover - compiled
    """ctx [B, H, K] f32: session b's queries qa [B, H, K], qr [B, H, R] over its rows sel[b, :counts[b]]
    (ascending positions) of its f32 blocks, tables [B, NB, 10], with factors 1.0."""
    width, rope = qa.shape[2], qr.shape[2]
    k_max = sel.shape[1]
    lc_f = np.empty((k_max, width), np.float32)  # lc_f: [k, K] f32, one session's gathered rows
    rc_f = np.empty((k_max, rope), np.float32)  # rc_f: [k, R] f32
    ones = np.ones(k_max, np.float32)  # [k] f32: f32 rows' factors
    scores = np.empty(k_max, np.float32)  # scores: [k] f32 scratch
    for b in range(qa.shape[0]):
        k = counts[b]
        blk = 0
        for j in range(k):
            pos = sel[b, j]
            blk, r = block_of(tables, b, blk, pos)
            lc_f[j] = carray(_f32_at(tables[b, blk, 2] + r * tables[b, blk, 3]), width)
            rc_f[j] = carray(_f32_at(tables[b, blk, 6] + r * tables[b, blk, 7]), rope)
        attend_one(qa[b], qr[b], lc_f[:k], rc_f[:k], ones[:k], ones[:k], scale, scores[:k], ctx[b])


__all__ = ["attend_f32_rows", "write_f32_rows"]
