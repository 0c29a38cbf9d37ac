"""CUDA mirror of the attention kernels (cupy RawModules over .cu sources compiled by NVRTC).

Importing this package never needs cupy or a GPU. ``kernels.backend.get_backend("cuda")`` is the
entry point for callers; ``compile_all_kernels_to_ptx`` compiles every kernel without a device.
"""
from kernels.cuda.sources import GLM_DIMS, KERNEL_MODULES, KernelDims, compile_all_kernels_to_ptx

__all__ = ["GLM_DIMS", "KERNEL_MODULES", "KernelDims", "compile_all_kernels_to_ptx"]
