"""fp8 e4m3 (OCP e4m3fn) codec of ``.coli_kv`` v2 rows, bit-exact to the colibri engine.

Rules (FORMAT.md section 2): decode is a 256-entry table, NaN codes (0x7F, 0xFF) read as +0.0.
Encode of one float32: NaN -> 0x00; |x| > 448 or inf -> sign|0x7E; otherwise round half to even
onto the e4m3 grid (subnormal step 2^-9), the sign bit kept (-0.0 and negative underflow -> 0x80).
The row quantizer scales each row by 448/amax (f32 ops, amax over the non-NaN values) before
encoding; scale = amax/448.

This package's surface, over its four modules, one job each: ``tables`` (the lookup tables),
``codec`` (element encode/decode), ``row_quantizer`` (the row quantizer and dequantizer, the
usable-scale rule) and ``blocks`` (the argument checks and block iteration they share).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np

from kernels.fp8.codec import decode, decode_into, encode, encode_into
from kernels.fp8.scales import USABLE_SCALE_BOUND, usable_scales
from kernels.fp8.tables import DECODE_TABLE, encode_reference, pair_table

if TYPE_CHECKING:  # imported on first use at run time (the module __getattr__ below)
    from kernels.fp8.row_quantizer import (
        FP8_MAX,
        dequantize_rows,
        dequantize_rows_into,
        quantize_rows,
        quantize_rows_into,
    )

# the row quantizer is compiled (numba): loaded on first use, so a reader that only checks scales
# (every file open, the API process of serve --http) loads no compiled kernel
_COMPILED = ("FP8_MAX", "dequantize_rows", "dequantize_rows_into", "quantize_rows", "quantize_rows_into")

__all__ = [
    "DECODE_TABLE",
    "FP8_MAX",
    "USABLE_SCALE_BOUND",
    "usable_scales",
    "PAIR_TABLE",
    "decode",
    "decode_into",
    "dequantize_rows",
    "dequantize_rows_into",
    "encode",
    "encode_into",
    "encode_reference",
    "pair_table",
    "quantize_rows",
    "quantize_rows_into",
]

PAIR_TABLE: np.ndarray  # declared only (no value): the module __getattr__ below builds it on first use


def __getattr__(name: str) -> Any:  # PEP 562: PAIR_TABLE built, the row quantizer imported, on first use
    if name == "PAIR_TABLE":
        return pair_table()
    if name in _COMPILED:
        value = getattr(importlib.import_module("kernels.fp8.row_quantizer"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
