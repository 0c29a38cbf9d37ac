"""One decode step of B sessions through an attention backend, each session's query over all of
its rows in one call (on CUDA, ONE launch of the split kernel over every session,
:func:`bench.cuda_batch.batched_decode_device`, which the bandwidth bench times). Serving
never asks this of a backend (its step attends layer by layer, :mod:`kernels.model`); the tests
use it to hold the batch launch to the CPU's attention, session by session."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.cuda_batch import batched_decode_device
from kernels.attention import absorbed_attention
from kernels.backend import CpuBackend, CudaBackend
from kernels.errors import FormatError
from kernels.rows import F32Rows, Fp8Rows, LatentRows, TqRows


def batched_decode(backend: CpuBackend | CudaBackend, q_abs: Any, q_rope: Any,
                   caches: Sequence[LatentRows | Sequence[LatentRows]], softmax_scale: float) -> Any:
    """q_abs [B, H, kv_lora], q_rope [B, H, rope], ``caches[b]`` a block or a list of blocks of
    session b -> ctx [B, H, kv_lora] (CUDA: numpy for numpy queries, device for cupy ones)."""
    if isinstance(backend, CpuBackend):
        if len(caches) != len(q_abs) or len(q_rope) != len(q_abs):
            raise FormatError(f"batched_decode: {len(q_abs)} queries for {len(caches)} sessions")
        out = [absorbed_attention(q_abs[b : b + 1], q_rope[b : b + 1],
                                  [c] if isinstance(c, (F32Rows, Fp8Rows, TqRows)) else list(c), softmax_scale)
               for b, c in enumerate(caches)]
        return np.concatenate(out, axis=0)  # [B, H, kv_lora]
    xp = backend.runner.xp
    dev = batched_decode_device(backend.runner, q_abs, q_rope, caches, softmax_scale, kernel=backend.kernel)
    return dev if isinstance(q_abs, xp.ndarray) else xp.asnumpy(dev)
