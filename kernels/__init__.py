"""Pure compute (no I/O): the fp8 e4m3 codec, absorbed MLA attention over the latent cache
(numpy; optional cupy mirror) and a reference MLA decoder (:mod:`kernels.model`).

The public surface::

    from kernels import encode, decode, quantize_rows, dequantize_rows
    from kernels import absorbed_attention, mla_attention, get_backend
    from kernels import F32Rows, Fp8Rows, RecordRows
"""
from kernels.attention import absorbed_attention, mla_attention
from kernels.backend import get_backend
from kernels.errors import ColiError
from kernels.fp8 import DECODE_TABLE, decode, dequantize_rows, encode, quantize_rows
from kernels.rows import F32Rows, Fp8Rows, LatentRows, RecordRows

__all__ = [
    "DECODE_TABLE",
    "ColiError",
    "F32Rows",
    "Fp8Rows",
    "LatentRows",
    "RecordRows",
    "absorbed_attention",
    "decode",
    "dequantize_rows",
    "encode",
    "get_backend",
    "mla_attention",
    "quantize_rows",
]
