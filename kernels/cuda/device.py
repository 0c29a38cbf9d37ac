"""The GPU runner: cupy RawModules compiled with NVRTC from the package's .cu sources.

cupy is optional. ``cuda_status()`` says whether a usable device exists without raising:
cupy-cuda12x imports fine on a machine without a GPU or driver, and the first device call then
raises ``CUDARuntimeError``; that is how a usable device is detected.
"""
from __future__ import annotations

import threading
from typing import Any

from kernels.cuda.sources import INSTALL_HINT, KERNEL_MODULES, KernelDims, base_options, kernel_source
from kernels.errors import BackendUnavailableError

_ENTRY_MODULE = {entry: module for module, entries in KERNEL_MODULES.items() for entry in entries}
_lock = threading.Lock()
_runner: CupyRunner | None = None


def cuda_status() -> tuple[bool, str]:
    """(usable, reason): cupy importable and at least one CUDA device answering."""
    try:
        import cupy  # noqa: F401
        from cupy.cuda import runtime
    except Exception as exc:  # ImportError, or a broken CUDA library: either way no backend
        return False, f"cupy is not importable ({exc}); {INSTALL_HINT}"
    try:
        count = runtime.getDeviceCount()
    except runtime.CUDARuntimeError as exc:
        return False, f"no usable CUDA device ({exc})"
    except Exception as exc:  # driver library missing entirely
        return False, f"no usable CUDA device ({exc})"
    if count < 1:
        return False, "no CUDA device found"
    return True, f"{count} CUDA device(s)"


class CupyRunner:
    """``kernels.cuda.launch.Runner`` on the current CUDA device."""

    def __init__(self) -> None:
        ok, reason = cuda_status()
        if not ok:
            raise BackendUnavailableError(f"CUDA backend unavailable: {reason}")
        import cupy

        self.xp = cupy
        dev = cupy.cuda.Device()
        self.n_sm = int(dev.attributes["MultiProcessorCount"])
        self.device_name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(errors="replace")
        self._modules: dict[tuple[KernelDims, str], Any] = {}
        self._smem: dict[tuple[KernelDims, str], int] = {}

    def address(self, arr: Any) -> int:
        return int(arr.data.ptr)

    def _function(self, dims: KernelDims, entry: str) -> Any:
        module = _ENTRY_MODULE[entry]
        key = (dims, module)
        if key not in self._modules:
            self._modules[key] = self.xp.RawModule(code=kernel_source(module), options=base_options(dims),
                                                   backend="nvrtc")
        return self._modules[key].get_function(entry)

    def launch(self, dims: KernelDims, entry: str, grid: tuple[int, int, int], block: int, args: tuple[Any, ...],
               smem_bytes: int = 0) -> None:
        fn = self._function(dims, entry)
        if smem_bytes > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem_bytes
        fn(grid, (block, 1, 1), args, shared_mem=smem_bytes)

    def smem_bytes(self, dims: KernelDims, entry: str) -> int:
        key = (dims, entry)
        if key not in self._smem:
            out = self.xp.zeros(2, dtype=self.xp.int32)
            self.launch(dims, "mla_mma_smem_bytes", (1, 1, 1), 32, (out,))
            both = out.get()
            self._smem[(dims, "mla_split_mma_exact")] = int(both[0])
            self._smem[(dims, "mla_split_mma_fast")] = int(both[1])
        return self._smem[key]


def get_runner() -> CupyRunner:
    """The process-wide GPU runner (raises BackendUnavailableError with an install hint)."""
    global _runner
    with _lock:
        if _runner is None:
            _runner = CupyRunner()
        return _runner

