"""The compute, and what it needs to run, importing nothing else of ours: the fp8 e4m3 and v3
4-bit codecs (:mod:`kernels.tq`), absorbed MLA attention over the latent cache (numpy; an optional
cupy mirror in :mod:`kernels.cuda`) and the reference decoders (:mod:`kernels.model`).

Not all of it is pure compute: :mod:`kernels.model` loads checkpoints (``config.json``, safetensors
weights, the tokenizer and chat template files), :mod:`kernels.cuda` reads and compiles its kernel
sources, and :mod:`kernels.jsonfile` is the project's one bounded JSON read. The project-wide
error hierarchy lives here too (:mod:`kernels.errors`), since every other package imports kernels.

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
