"""Tiles of the latent cache at absolute positions, gathered into contiguous scratch.

Attention walks the cache in tiles of ``tile_rows`` positions that start at multiples of
``tile_rows`` counted from position 0 of the whole cache, not of any block. Each tile is copied
(f32 rows) or decoded (fp8 rows, through the exact lookup table) into preallocated, 64-byte
aligned scratch, so the arithmetic that follows sees the same contiguous bytes however the
rows were split into blocks and whatever their strides were: results are bitwise identical.

fp8 rows are decoded WITHOUT their scales (``table[code]``); the scales are gathered beside
them and hoisted out of the dot products by the caller, as the engine does.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kernels.attention.tables import decode_codes_into, sanitize_scales_into
from kernels.attention.tq import check_tq_blocks, decode_tile
from kernels.errors import FormatError
from kernels.rows import F32Rows, Fp8Rows, LatentRows, TqRows
from kernels.tq import TqCodec

_ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """np.empty whose data pointer is 64-byte aligned (same layout on every call)."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(count * dt.itemsize + _ALIGN, np.uint8)  # raw: [bytes + 64] u8
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start : start + count * dt.itemsize].view(dt).reshape(shape)


@dataclass(frozen=True)
class CacheShape:
    """What a sequence of blocks holds: total rows, widths, and whether any block is fp8."""

    length: int
    kv_lora: int
    rope: int
    any_fp8: bool
    all_fp8: bool
    tq: TqCodec | None = None  # set: every block is v3 rows of this codec (kernels.attention.tq)


def cache_shape(blocks: Sequence[LatentRows], array_type: type = np.ndarray) -> CacheShape:
    """Validate the blocks (kinds, widths, dtypes, lengths) and describe the cache they form.

    ``array_type``: the array class the fields must be (numpy here; cupy for device blocks).
    """
    if len(blocks) == 0:
        raise FormatError("attention: no cache blocks given (need at least one row)")
    if any(isinstance(b, TqRows) for b in blocks):
        length, kv_lora, rope, codec = check_tq_blocks(blocks, array_type)
        if length == 0:
            raise FormatError("attention: the cache blocks hold no rows (need at least one)")
        return CacheShape(length, kv_lora, rope, False, False, codec)
    kv_lora = rope = -1
    total = 0
    n_fp8 = 0
    for i, blk in enumerate(blocks):
        if isinstance(blk, Fp8Rows):
            lc, rc = blk.lc_codes, blk.rc_codes
            _check_dtype(i, "lc_codes", lc, np.uint8, array_type)
            _check_dtype(i, "rc_codes", rc, np.uint8, array_type)
            _check_dtype(i, "lc_scale", blk.lc_scale, np.float32, array_type)
            _check_dtype(i, "rc_scale", blk.rc_scale, np.float32, array_type)
            n_fp8 += 1
        elif isinstance(blk, F32Rows):
            lc, rc = blk.lc, blk.rc
            _check_dtype(i, "lc", lc, np.float32, array_type)
            _check_dtype(i, "rc", rc, np.float32, array_type)
        else:
            raise FormatError(f"attention: block {i} is {type(blk).__name__}, expected F32Rows, Fp8Rows or TqRows")
        if lc.ndim != 2 or rc.ndim != 2 or lc.shape[0] != rc.shape[0]:
            raise FormatError(
                f"attention: block {i}: Lc {lc.shape} and Rc {rc.shape} must be [T, width] with the same T"
            )
        if isinstance(blk, Fp8Rows) and (blk.lc_scale.shape != (lc.shape[0],) or blk.rc_scale.shape != (lc.shape[0],)):
            raise FormatError(
                f"attention: block {i}: scales {blk.lc_scale.shape}/{blk.rc_scale.shape} expected ({lc.shape[0]},)"
            )
        if kv_lora < 0:
            kv_lora, rope = int(lc.shape[1]), int(rc.shape[1])
        elif (lc.shape[1], rc.shape[1]) != (kv_lora, rope):
            raise FormatError(
                f"attention: block {i} widths ({lc.shape[1]}, {rc.shape[1]}) differ from block 0 ({kv_lora}, {rope})"
            )
        total += int(lc.shape[0])
    if total == 0:
        raise FormatError("attention: the cache blocks hold no rows (need at least one)")
    return CacheShape(total, kv_lora, rope, n_fp8 > 0, n_fp8 == len(blocks))


def _check_dtype(i: int, name: str, arr: np.ndarray, want: type, array_type: type = np.ndarray) -> None:
    if not isinstance(arr, array_type) or arr.dtype != np.dtype(want):
        found = getattr(arr, "dtype", type(arr).__name__)
        raise FormatError(f"attention: block {i} field {name}: expected {np.dtype(want)} array, found {found}")


class TileGatherer:
    """Copies/decodes the rows [start, stop) of the cache into contiguous scratch.

    Scratch (allocated once, reused per tile): ``lc`` [tile, kv_lora] f32, ``rc`` [tile, rope] f32,
    ``lsc``/``rsc`` [tile] f32 (1.0 for f32 rows, so a mixed tile computes f32 rows exactly).
    v3 rows (TqRows) are decoded rows (factors 1.0), or with ``tq_rotated`` their unit-scale
    values in the rotated domain with the hoisted factors in ``lsc``/``rsc`` (kernels.attention.tq:
    the caller rotates the queries and unrotates the context).
    """

    def __init__(self, blocks: Sequence[LatentRows], shape: CacheShape, tile_rows: int, *,
                 tq_rotated: bool = False,
                 scratch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """``scratch``: (lc, rc, lsc, rsc) of the caller's to fill instead of new aligned arrays
        (contiguous, f32, shaped as below)."""
        self.tq_rotated = tq_rotated
        self.blocks = list(blocks)
        self.shape = shape
        self.tile_rows = tile_rows
        self.block_starts = [0]
        for b in self.blocks:
            self.block_starts.append(self.block_starts[-1] + b.length)
        if scratch is not None:
            self.lc, self.rc, self.lsc, self.rsc = scratch
            return
        self.lc = aligned_empty((tile_rows, shape.kv_lora), np.float32)  # lc: [tile, kv_lora] f32
        self.rc = aligned_empty((tile_rows, shape.rope), np.float32)  # rc: [tile, rope] f32
        self.lsc = aligned_empty((tile_rows,), np.float32)  # lsc: [tile] f32
        self.rsc = aligned_empty((tile_rows,), np.float32)  # rsc: [tile] f32

    def gather(self, start: int, stop: int) -> bool:
        """Fill scratch rows [0, stop - start); returns True when any row of the tile is fp8 (or v3
        in the rotated domain): then ``lsc``/``rsc`` are factors the caller must apply."""
        any_fp8 = False
        first = bisect_right(self.block_starts, start) - 1  # the block holding row `start`
        for b in range(max(first, 0), len(self.blocks)):
            b0, b1 = self.block_starts[b], self.block_starts[b + 1]
            if b0 >= stop:
                break
            lo, hi = max(start, b0), min(stop, b1)
            if lo >= hi:
                continue  # an empty block
            scaled = self._fill(self.blocks[b], slice(lo - b0, hi - b0), slice(lo - start, hi - start))
            any_fp8 = any_fp8 or scaled
        return any_fp8

    def _fill(self, blk: LatentRows, src: slice | np.ndarray, dst: slice) -> bool:
        """Rows ``src`` of one block (a slice, or ascending row indices) into scratch rows ``dst``:
        f32 rows copied with scale 1.0, fp8 rows decoded beside their sanitised scales, v3 rows
        decoded by their codec. Returns True when the scales must be applied (fp8, rotated v3)."""
        if isinstance(blk, Fp8Rows):
            decode_codes_into(blk.lc_codes[src], self.lc[dst])
            decode_codes_into(blk.rc_codes[src], self.rc[dst])
            sanitize_scales_into(blk.lc_scale[src], self.lsc[dst])
            sanitize_scales_into(blk.rc_scale[src], self.rsc[dst])
            return True
        if isinstance(blk, TqRows):
            decode_tile(blk, src, self.lc[dst], self.rc[dst], self.lsc[dst], self.rsc[dst], rotated=self.tq_rotated)
            return self.tq_rotated
        if isinstance(src, slice):
            self.lc[dst] = blk.lc[src]
            self.rc[dst] = blk.rc[src]
        else:  # only the selected rows, straight into the scratch
            np.take(blk.lc, src, axis=0, out=self.lc[dst], mode="clip")
            np.take(blk.rc, src, axis=0, out=self.rc[dst], mode="clip")
        self.lsc[dst] = 1.0
        self.rsc[dst] = 1.0
        return False

    def gather_at(self, positions: np.ndarray) -> bool:
        """Fill scratch rows [0, n) with the rows at absolute ``positions`` [n] (ascending, n <= tile);
        returns True when any of them is fp8. Only those rows are read: nothing else is copied."""
        pos = np.asarray(positions, dtype=np.int64)  # pos: [n] i64
        n = int(pos.shape[0])
        if pos.ndim != 1 or n > self.tile_rows:
            raise FormatError(f"gather_at: expected at most {self.tile_rows} positions [n], found {pos.shape}")
        if n and (pos[0] < 0 or pos[-1] >= self.shape.length or bool(np.any(pos[1:] <= pos[:-1]))):
            raise FormatError(f"gather_at: positions must ascend strictly inside [0, {self.shape.length})")
        any_fp8 = False
        cuts = np.searchsorted(pos, self.block_starts)  # cuts: [nblocks + 1] i64, block b owns pos[cuts[b]:cuts[b+1]]
        for b, blk in enumerate(self.blocks):
            lo, hi = int(cuts[b]), int(cuts[b + 1])
            if lo >= hi:
                continue
            src = pos[lo:hi] - self.block_starts[b]  # src: [m] i64 rows of this block
            scaled = self._fill(blk, src, slice(lo, hi))
            any_fp8 = any_fp8 or scaled
        return any_fp8
