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
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from kernels.cache_stamp import refresh_stale_caches
from kernels.lazy import lazy_members

if os.environ.get("NUMBA_DISABLE_JIT") != "1":  # before any kernel module loads its cached code
    refresh_stale_caches(Path(__file__).resolve().parent, os.environ.get("NUMBA_CACHE_DIR") or None)

if TYPE_CHECKING:  # the surface as a type checker sees it; at run time each name is imported on first use
    from kernels.attention import absorbed_attention, mla_attention
    from kernels.backend import get_backend
    from kernels.errors import ColiError
    from kernels.fp8 import DECODE_TABLE, decode, dequantize_rows, encode, quantize_rows
    from kernels.rows import F32Rows, Fp8Rows, LatentRows, RecordRows

# name -> the module that defines it. Imported on first use (PEP 562), so that ``import kernels.errors``
# (every package of ours does) loads no compiled kernel: a process that never computes (the API
# process of ``serve --http``, a CLI command over files) does not pay for numba and the kernels' cache.
_HOMES = {
    "absorbed_attention": "kernels.attention", "mla_attention": "kernels.attention", "get_backend": "kernels.backend",
    "ColiError": "kernels.errors", "DECODE_TABLE": "kernels.fp8", "decode": "kernels.fp8",
    "dequantize_rows": "kernels.fp8", "encode": "kernels.fp8", "quantize_rows": "kernels.fp8",
    "F32Rows": "kernels.rows", "Fp8Rows": "kernels.rows", "LatentRows": "kernels.rows", "RecordRows": "kernels.rows",
}

__getattr__ = lazy_members(__name__, _HOMES)


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
