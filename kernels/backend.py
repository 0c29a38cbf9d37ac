"""Pick the compute backend for attention: ``get_backend("cpu" | "cuda")``.

Both backends expose the same entry points:
- ``absorbed_attention(q_abs, q_rope, blocks, softmax_scale, *, causal=True)`` -> ctx [S, H, kv_lora]
- ``mla_attention(q_nope, q_rope, blocks, w_uk, w_uv, softmax_scale, *, causal=True)`` -> [S, H, v_head]
- ``sparse_absorbed_attention(q_abs [S,H,kv_lora], q_rope [S,H,rope], blocks, selection [S,k] i64,
  softmax_scale)`` -> ctx [S, H, kv_lora]: DSA, each query over its selected rows only (both
  backends; a backend without it makes a DSA decoder raise BackendUnavailableError).
- ``batched_sparse_decode(q_abs [B,H,kv_lora], q_rope [B,H,rope], blocks_of, selections, softmax_scale)``
  (CPU only): one DSA decode step of B sessions, batch-invariant; a DSA decoder uses it when the
  backend has it and attends session by session otherwise.
The CUDA backend returns numpy arrays for numpy queries and device arrays for cupy queries.
Asking for "cuda" without cupy or without a usable device raises BackendUnavailableError with
the install hint.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels.attention import absorbed_attention, mla_attention, sparse_absorbed_attention
from kernels.attention.sparse_step import batched_sparse_decode
from kernels.attention.tiles import CacheShape
from kernels.errors import BackendUnavailableError, FormatError
from kernels.rows import LatentRows


class CpuBackend:
    """numpy attention (kernels.attention)."""

    name = "cpu"

    def absorbed_attention(self, q_abs: np.ndarray, q_rope: np.ndarray, blocks: Sequence[LatentRows],
                           softmax_scale: float, *, causal: bool = True) -> np.ndarray:
        return absorbed_attention(q_abs, q_rope, blocks, softmax_scale, causal=causal)

    def mla_attention(self, q_nope: np.ndarray, q_rope: np.ndarray, blocks: Sequence[LatentRows], w_uk: np.ndarray,
                      w_uv: np.ndarray, softmax_scale: float, *, causal: bool = True) -> np.ndarray:
        return mla_attention(q_nope, q_rope, blocks, w_uk, w_uv, softmax_scale, causal=causal)

    def sparse_absorbed_attention(self, q_abs: np.ndarray, q_rope: np.ndarray, blocks: Sequence[LatentRows],
                                  selection: np.ndarray, softmax_scale: float) -> np.ndarray:
        return sparse_absorbed_attention(q_abs, q_rope, blocks, selection, softmax_scale)

    def batched_sparse_decode(self, q_abs: np.ndarray, q_rope: np.ndarray,
                              blocks_of: Sequence[Sequence[LatentRows]], selections: Sequence[np.ndarray],
                              softmax_scale: float, shapes: Sequence[CacheShape] | None = None) -> np.ndarray:
        return batched_sparse_decode(q_abs, q_rope, blocks_of, selections, softmax_scale, shapes)


class CudaBackend:
    """cupy + NVRTC kernels (kernels.cuda). ``kernel``: "simt" (default), "mma" or "mma_fast".

    Rows: f32, fp8 and v3 (int4, PolarQuant 2..6 bits); every kernel reads fp8, f32 and v3 rows
    need "simt" (the tensor-core kernels refuse them with a FormatError naming the kind)."""

    name = "cuda"

    def __init__(self, kernel: str = "simt", runner: Any = None) -> None:
        """``runner``: a ``kernels.cuda.launch.Runner`` (default: the GPU; tests pass the CPU emulator)."""
        from kernels.cuda.device import get_runner
        from kernels.cuda.launch import KERNELS

        if kernel not in KERNELS:
            raise FormatError(f"cuda backend: kernel must be one of {sorted(KERNELS)}, found {kernel!r}")
        self.runner = get_runner() if runner is None else runner
        self.kernel = kernel
        self.device_name = str(getattr(self.runner, "device_name", type(self.runner).__name__))

    def _out(self, like: Any, dev: Any) -> Any:
        return dev if isinstance(like, self.runner.xp.ndarray) else self.runner.xp.asnumpy(dev)

    def absorbed_attention(self, q_abs: Any, q_rope: Any, blocks: Sequence[LatentRows], softmax_scale: float, *,
                           causal: bool = True) -> Any:
        from kernels.cuda.attention import absorbed_attention_device

        dev = absorbed_attention_device(self.runner, q_abs, q_rope, blocks, softmax_scale, causal=causal,
                                        kernel=self.kernel)
        return self._out(q_abs, dev)

    def mla_attention(self, q_nope: Any, q_rope: Any, blocks: Sequence[LatentRows], w_uk: Any, w_uv: Any,
                      softmax_scale: float, *, causal: bool = True) -> Any:
        """Absorbed path on the device (q_nope W_UK, attention, W_UV)."""
        from kernels.cuda.attention import absorbed_attention_device

        xp = self.runner.xp
        qn = xp.asarray(q_nope, dtype=xp.float32)  # [S, H, nope]
        uk, uv = xp.asarray(w_uk, dtype=xp.float32), xp.asarray(w_uv, dtype=xp.float32)
        q_abs = xp.matmul(qn.transpose(1, 0, 2), uk).transpose(1, 0, 2)  # [S, H, kv_lora]
        ctx = absorbed_attention_device(self.runner, q_abs, q_rope, blocks, softmax_scale, causal=causal,
                                        kernel=self.kernel)  # [S, H, kv_lora]
        out = xp.ascontiguousarray(xp.matmul(ctx.transpose(1, 0, 2), uv.transpose(0, 2, 1)).transpose(1, 0, 2))
        return self._out(q_nope, out)

    def sparse_absorbed_attention(self, q_abs: Any, q_rope: Any, blocks: Sequence[LatentRows], selection: Any,
                                  softmax_scale: float) -> Any:
        """DSA: each query over its selected rows, read by index on the device (always the SIMT gather
        kernel, whatever ``kernel`` is: the tensor-core kernels have no gather variant)."""
        from kernels.cuda.sparse import sparse_absorbed_attention_device

        dev = sparse_absorbed_attention_device(self.runner, q_abs, q_rope, blocks, selection, softmax_scale)
        return self._out(q_abs, dev)


def get_backend(name: str = "cpu", **options: Any) -> CpuBackend | CudaBackend:
    """The attention backend by name; "cuda" raises BackendUnavailableError (with the install hint)
    when cupy is missing or no device answers."""
    if name == "cpu":
        return CpuBackend()
    if name == "cuda":
        return CudaBackend(**options)
    raise BackendUnavailableError(f"unknown backend {name!r}: expected 'cpu' or 'cuda'")
