"""Absorbed MLA attention over v3 rows without a dequantised copy (facts 4.2): the rotated domain.

A v3 row decodes as x_hat = unrotate(s * u), where u is the row's unit-scale value in the ROTATED
domain (int4: LEVELS[code]; PolarQuant: the angle tree from 1) and s its hoisted factor
(int4: radius / sqrtf(n); PolarQuant: radius; 0 for an inert row). The rotation is orthogonal
and symmetric, so
    q . x_hat_t = s_t * (rotate(q) . u_t)   and   sum_t w_t x_hat_t = unrotate(sum_t w_t s_t u_t):
attention rotates q_abs (kv_lora wide) and q_rope (rope wide) once per call, scores each tile
against u with s hoisted exactly like the fp8 scale, and unrotates the context once at the end.
Tiles hold u in the codec's ``rotated_order`` (PolarQuant: bit-reversed, what its tree writes
with contiguous loops); q is put in the same order and the context back, once per call.
Tiles are decoded (``decode_tile``) into the attention's bounded scratch, a sub-block of rows at
a time, so temporaries stay small. The same function can also write fully decoded rows (the
engine's decode) for paths that need them (expanded MLA, sparse DSA attention).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernels.errors import FormatError
from kernels.rows import LatentRows, TqRows
from kernels.tq import TqCodec, rotate, unrotate

__all__ = ["check_tq_blocks", "decode_tile", "rotate_queries", "unrotate_context"]

SUB_ROWS = 64  # rows decoded at a time: the polar tree's temporaries stay in L2


def check_tq_blocks(blocks: Sequence[LatentRows], array_type: type = np.ndarray) -> tuple[int, int, int, TqCodec]:
    """Validate v3 blocks (all TqRows, one codec, one pair of widths) -> (T, kv_lora, rope, codec)."""
    first = blocks[0]
    if not all(isinstance(b, TqRows) for b in blocks) or not isinstance(first, TqRows):
        kinds = sorted({type(b).__name__ for b in blocks})
        raise FormatError(f"attention: v3 (TqRows) blocks cannot be mixed with other kinds, found {kinds}")
    codec, kv_lora, rope = first.codec, first.kv_lora, first.qk_rope
    total = 0
    for i, blk in enumerate(blocks):
        assert isinstance(blk, TqRows)
        if blk.codec != codec or (blk.kv_lora, blk.qk_rope) != (kv_lora, rope):
            raise FormatError(f"attention: block {i} is {blk.codec.kv_dtype} ({blk.kv_lora}, {blk.qk_rope}), block 0 "
                              f"is {codec.kv_dtype} ({kv_lora}, {rope})")
        rb_l, rb_r = codec.row_bytes(kv_lora), codec.row_bytes(rope)  # refuses widths that are no power of two
        for name, arr, want, shape in (("lc_codes", blk.lc_codes, np.uint8, (rb_l,)),
                                       ("rc_codes", blk.rc_codes, np.uint8, (rb_r,)),
                                       ("lc_radius", blk.lc_radius, np.float32, ()),
                                       ("rc_radius", blk.rc_radius, np.float32, ())):
            if not isinstance(arr, array_type) or arr.dtype != np.dtype(want):
                found = getattr(arr, "dtype", type(arr).__name__)
                raise FormatError(f"attention: block {i} field {name}: expected {np.dtype(want)} array, found {found}")
            if arr.ndim != 1 + len(shape) or arr.shape[1:] != shape or arr.shape[0] != blk.length:
                raise FormatError(f"attention: block {i} field {name}: expected [{blk.length}, *{list(shape)}] "
                                  f"({codec.kv_dtype}, widths {kv_lora}/{rope}), found {arr.shape}")
        total += blk.length
    return total, kv_lora, rope, codec


def decode_tile(blk: TqRows, src: slice | np.ndarray, lc: np.ndarray, rc: np.ndarray, lsc: np.ndarray,
                rsc: np.ndarray, *, rotated: bool) -> None:
    """Rows ``src`` of ``blk`` into scratch views lc [n, kv_lora], rc [n, rope], lsc/rsc [n] (all f32).

    rotated=True: unit-scale rotated-domain values and their hoisted factors (attention in the
    rotated domain). rotated=False: the engine's decoded rows, factors 1.0.
    """
    codec = blk.codec
    lcode, rcode = blk.lc_codes[src], blk.rc_codes[src]  # [n, rbL] u8, [n, rbR] u8
    lrad, rrad = blk.lc_radius[src], blk.rc_radius[src]  # [n] f32 each
    n = lc.shape[0]
    for a in range(0, n, SUB_ROWS):
        b = min(a + SUB_ROWS, n)
        if rotated:
            codec.decode_rotated_into(lcode[a:b], lc[a:b])
            codec.decode_rotated_into(rcode[a:b], rc[a:b])
        else:
            codec.decode_block_into(lcode[a:b], lrad[a:b], lc[a:b])
            codec.decode_block_into(rcode[a:b], rrad[a:b], rc[a:b])
    if rotated:
        lsc[...] = codec.row_scale(lrad, blk.kv_lora)
        rsc[...] = codec.row_scale(rrad, blk.qk_rope)
    else:
        lsc[...] = 1.0
        rsc[...] = 1.0


def rotate_queries(q: np.ndarray, codec: TqCodec) -> np.ndarray:
    """rotate() over the last axis of q [S, H, w] f32, columns in the codec's ``rotated_order(w)``
    (the order its tiles decode in) -> [S, H, w] f32."""
    rq = rotate(q)
    order = codec.rotated_order(int(q.shape[-1]))
    return rq if order is None else np.ascontiguousarray(rq[..., order])


def unrotate_context(ctx: np.ndarray, codec: TqCodec) -> np.ndarray:
    """The accumulated ctx [.., kv_lora] f32 (columns in ``rotated_order``) back in element order, unrotated."""
    order = codec.rotated_order(int(ctx.shape[-1]))
    if order is not None:
        elems = np.empty_like(ctx)  # elems: [.., kv_lora] f32
        elems[..., order] = ctx
        ctx = elems
    return unrotate(ctx)
