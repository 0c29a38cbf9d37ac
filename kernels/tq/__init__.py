"""The ``.coli_kv`` v3 4-bit tier's row codecs (FORMAT.md v3; facts 4): rotated int4 and PolarQuant.

- ``TqCodec(kind, bits)``: tag, ``row_bytes(n)``, ``from_tag``, ``from_kv_dtype``, ``encode_rows``,
  ``decode_rows``, and ``decode_rotated_into`` + ``row_scale`` for attention in the rotated domain.
- ``rotate`` / ``unrotate`` / ``fwht`` / ``row_radius``: the shared rotation (kernels.tq.rotation).
Inside: ``int4`` (Lloyd-Max levels, nibble tables), ``polar`` (angle tree, level grids),
``packing`` (nibbles and the LSB-first bit stream), ``libm`` (cosf/sinf for the decode tables).
"""
from __future__ import annotations

from kernels.tq.codec import INT4_TAG, KV_DTYPES_V3, RADIUS_BOUND, RADIUS_MIN, TqCodec, usable_radius
from kernels.tq.rotation import MAX_WIDTH, SIGNS, check_width, fwht, rotate, row_radius, sign_hash, unrotate

__all__ = [
    "INT4_TAG",
    "KV_DTYPES_V3",
    "MAX_WIDTH",
    "RADIUS_BOUND",
    "RADIUS_MIN",
    "SIGNS",
    "TqCodec",
    "check_width",
    "fwht",
    "rotate",
    "row_radius",
    "sign_hash",
    "unrotate",
    "usable_radius",
]
