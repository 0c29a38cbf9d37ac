"""The CUDA C sources of the attention kernels (package data) and their NVRTC compilation.

Kernels are plain ``.cu`` files beside this module; ``mla_common.cuh`` is spliced in where a
source includes it, so NVRTC, cupy's RawModule and the CPU emulator all see one self-contained
text. Dimensions are compile-time macros (MLA_HEADS, MLA_KV, MLA_ROPE).

``compile_all_kernels_to_ptx`` needs NO GPU: it drives NVRTC through cupy's bindings
(``cupy_backends.cuda.libs.nvrtc``: createProgram / compileProgram / getPTX), which load the
nvidia-cuda-nvrtc library without touching a device or the driver. cupy's higher-level
``compile_using_nvrtc`` asks the runtime for the current device first, so it is not used here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kernels.errors import BackendUnavailableError, ColiError

INSTALL_HINT = 'install the CUDA extra: pip install -e ".[cuda]" (cupy-cuda12x + nvidia-cuda-nvrtc-cu12)'
COMMON_HEADER = "mla_common.cuh"
# module file -> kernel entry points it defines (extern "C" names)
KERNEL_MODULES: dict[str, tuple[str, ...]] = {
    "mla_simt.cu": ("mla_split_simt_fp8", "mla_split_simt_f32", "mla_split_simt_int4", "mla_split_simt_polar",
                    "mla_sparse_simt_f32", "mla_sparse_simt_fp8", "mla_sparse_simt_int4", "mla_sparse_simt_polar"),
    "mla_mma.cu": ("mla_split_mma_exact", "mla_split_mma_fast", "mla_mma_smem_bytes"),
    "mla_reduce.cu": ("mla_reduce",),
    "mla_rotate.cu": ("mla_tq_rotate",),
}
_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"\s*$', re.MULTILINE)


class KernelCompileError(ColiError):
    """NVRTC rejected a kernel source (the log names the file and line)."""


@dataclass(frozen=True)
class KernelDims:
    """The compile-time shape of one kernel build: heads, kv_lora, rope."""

    heads: int
    kv_lora: int
    rope: int

    def defines(self) -> tuple[str, ...]:
        return (f"-DMLA_HEADS={self.heads}", f"-DMLA_KV={self.kv_lora}", f"-DMLA_ROPE={self.rope}")


def mma_supported(dims: KernelDims) -> bool:
    """The tensor-core module's shape rule (mla_mma.cu): kv_lora % 32 == 0 and rope % 16 == 0."""
    return dims.kv_lora % 32 == 0 and dims.rope % 16 == 0


GLM_DIMS = KernelDims(heads=64, kv_lora=512, rope=64)  # GLM-5.2 / DeepSeek-V3 head shapes


def read_source(name: str) -> str:
    """The text of the packaged kernel source ``name`` (the one place sources are read; a test
    patches it to hand the compiler a broken source)."""
    return resources.files("kernels.cuda").joinpath(name).read_text(encoding="utf-8")


def kernel_source(module: str) -> str:
    """The self-contained source of one kernel module (its local includes spliced in once)."""
    seen: set[str] = set()

    def splice(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _INCLUDE.sub(splice, read_source(name))

    return _INCLUDE.sub(splice, read_source(module))


def base_options(dims: KernelDims) -> tuple[str, ...]:
    return (*dims.defines(), "--std=c++17")


def _nvrtc() -> Any:  # cupy's NVRTC binding module (untyped)
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:  # cupy absent, or its NVRTC library cannot load
        raise BackendUnavailableError(f"NVRTC is not available ({exc}); {INSTALL_HINT}") from exc
    return nvrtc


def compile_to_ptx(module: str, dims: KernelDims = GLM_DIMS, arch: str = "compute_90") -> str:
    """Compile one kernel module to PTX with NVRTC (no device needed); raises KernelCompileError."""
    nvrtc = _nvrtc()
    source = kernel_source(module)
    prog = nvrtc.createProgram(source, module, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, (*base_options(dims), f"-arch={arch}"))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise KernelCompileError(f"NVRTC failed on kernels/cuda/{module} for {dims}: {exc}\n{log}") from exc
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode("utf-8") if isinstance(ptx, bytes) else str(ptx)


def compile_all_kernels_to_ptx(arch: str = "compute_90", dims: KernelDims = GLM_DIMS) -> dict[str, str]:
    """Every kernel module compiled to PTX: {module file name: PTX text}. No GPU needed."""
    return {module: compile_to_ptx(module, dims, arch) for module in KERNEL_MODULES}
