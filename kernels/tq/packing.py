"""Bit packing of v3 rows: nibbles for int4 (facts 4.2) and the LSB-first stream of PolarQuant (4.3).

Nibbles: byte[i >> 1] holds code i in its LOW nibble when i is even, in its HIGH nibble when odd.
Bit stream: one cursor per row from bit 0; bit k of a field at cursor ``pos`` goes to byte
``(pos + k) >> 3``, bit ``(pos + k) & 7``; unused high bits of the last byte stay 0.

Unpacking reads each field (<= 8 bits, so it spans at most two bytes) from a 16-bit little-endian
window ``byte[p >> 3] | byte[(p >> 3) + 1] << 8`` shifted right by ``p & 7`` and masked.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernels.errors import FormatError

__all__ = ["FieldLayout", "pack_fields", "pack_nibbles", "unpack_fields", "unpack_fields_t", "unpack_nibbles"]


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """codes [..., n] (values 0..15, n even) -> [..., n/2] u8, even element in the low nibble."""
    c = np.asarray(codes, dtype=np.uint8)  # c: [..., n] u8
    if c.shape[-1] % 2:
        raise FormatError(f"pack_nibbles: an even number of codes is needed, found {c.shape[-1]}")
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., m] u8 -> codes [..., 2m] u8 (low nibble first)."""
    p = np.asarray(packed, dtype=np.uint8)  # p: [..., m] u8
    out = np.empty((*p.shape[:-1], 2 * p.shape[-1]), np.uint8)  # out: [..., 2m] u8
    np.bitwise_and(p, 0x0F, out=out[..., 0::2])
    np.right_shift(p, 4, out=out[..., 1::2])
    return out


class FieldLayout:
    """Where each of k fields sits in a packed row: widths, bit offsets, and the window read plan."""

    def __init__(self, widths: Sequence[int]) -> None:
        w = np.asarray(widths, dtype=np.int64)  # w: [k] i64
        if w.ndim != 1 or (w.size and (int(w.min()) < 1 or int(w.max()) > 8)):
            raise FormatError(f"bit packing: field widths must be 1..8, found {list(widths)[:8]}")
        self.widths = w
        self.offsets = np.concatenate([[0], np.cumsum(w)[:-1]]).astype(np.int64) if w.size else w  # [k] i64
        self.total_bits = int(w.sum())
        self.nbytes = (self.total_bits + 7) // 8
        self.byte_index = self.offsets >> 3  # byte_index: [k] i64 (window start)
        self.shift = (self.offsets & 7).astype(np.uint16)  # shift: [k] u16
        self.mask = ((1 << w) - 1).astype(np.uint16)  # mask: [k] u16
        cuts = [0, *(np.flatnonzero(np.diff(w)) + 1).tolist(), int(w.size)] if w.size else [0]
        self.runs = list(zip(cuts[:-1], cuts[1:], strict=True))  # [(j0, j1)] fields of one width
        self.packable = True

    def reordered(self, order: np.ndarray) -> FieldLayout:
        """The same fields read in ``order`` (a permutation of 0..k-1): for unpacking only."""
        out = FieldLayout([])
        out.widths, out.offsets = self.widths[order], self.offsets[order]
        out.byte_index, out.shift, out.mask = self.byte_index[order], self.shift[order], self.mask[order]
        out.total_bits, out.nbytes, out.runs, out.packable = self.total_bits, self.nbytes, [], False
        return out

    @property
    def count(self) -> int:
        return int(self.widths.shape[0])


def pack_fields(values: np.ndarray, layout: FieldLayout) -> np.ndarray:
    """values [R, k] (field j < 2^width_j) -> [R, nbytes] u8, fields back to back LSB-first."""
    v = np.asarray(values)
    if not layout.packable or v.ndim != 2 or v.shape[1] != layout.count:
        raise FormatError(f"pack_fields: expected values [R, {layout.count}], found {v.shape}")
    rows = v.shape[0]
    bits = np.zeros((rows, layout.nbytes * 8), np.uint8)  # bits: [R, nbytes*8] u8 of 0/1
    for j0, j1 in layout.runs:  # fields j0..j1 share one width: their bits are one contiguous range
        width = int(layout.widths[j0])
        k = np.arange(width, dtype=np.uint16)  # k: [w] u16 bit numbers
        b0 = int(layout.offsets[j0])
        fb = (v[:, j0:j1, None].astype(np.uint16) >> k) & 1  # fb: [R, m, w] u16
        bits[:, b0 : b0 + (j1 - j0) * width] = fb.reshape(rows, -1)
    return np.packbits(bits, axis=-1, bitorder="little")  # [R, nbytes] u8


def unpack_fields(packed: np.ndarray, layout: FieldLayout, out: np.ndarray | None = None) -> np.ndarray:
    """[R, nbytes] u8 -> fields [R, k] u16 (the inverse of ``pack_fields``; pad bits ignored)."""
    p = np.asarray(packed)
    if p.dtype != np.uint8 or p.ndim != 2 or p.shape[1] != layout.nbytes:
        raise FormatError(f"unpack_fields: expected u8 [R, {layout.nbytes}], found {p.dtype} {p.shape}")
    rows = p.shape[0]
    win = np.zeros((rows, layout.nbytes + 1), np.uint16)  # win: [R, nbytes + 1] u16 windows
    win[:, : layout.nbytes] = p
    win[:, : layout.nbytes] |= win[:, 1:] << np.uint16(8)
    res = out if out is not None else np.empty((rows, layout.count), np.uint16)  # res: [R, k] u16
    np.take(win, layout.byte_index, axis=1, out=res)
    res >>= layout.shift
    res &= layout.mask
    return res


def unpack_fields_t(packed: np.ndarray, layout: FieldLayout) -> np.ndarray:
    """``unpack_fields`` transposed: [R, nbytes] u8 -> fields [k, R] u16 (rows on the inner axis)."""
    p = np.asarray(packed)
    if p.dtype != np.uint8 or p.ndim != 2 or p.shape[1] != layout.nbytes:
        raise FormatError(f"unpack_fields: expected u8 [R, {layout.nbytes}], found {p.dtype} {p.shape}")
    rows = p.shape[0]
    win = np.empty((layout.nbytes + 1, rows), np.uint16)  # win: [nbytes + 1, R] u16 windows
    win[: layout.nbytes] = p.T
    win[layout.nbytes] = 0
    win[: layout.nbytes] |= win[1:] << np.uint16(8)
    res = np.take(win, layout.byte_index, axis=0)  # res: [k, R] u16
    res >>= layout.shift[:, None]
    res &= layout.mask[:, None]
    return res
