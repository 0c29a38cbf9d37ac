"""Every CUDA kernel compiles to PTX with NVRTC on a machine WITHOUT a GPU (runs in CI).

A kernel that does not compile can never land: this test compiles each module for compute_90
at the GLM-5.2 head shapes and at a tiny shape, and checks every declared entry point is in
the PTX. It needs cupy-cuda12x + nvidia-cuda-nvrtc-cu12 (the "cuda" extra, installed in CI);
no device and no driver are touched.
"""
from __future__ import annotations

import pytest

from kernels.cuda import GLM_DIMS, KERNEL_MODULES, KernelDims, compile_all_kernels_to_ptx, sources
from kernels.errors import BackendUnavailableError
from tests.support.extras import needs_cuda_extra


@needs_cuda_extra
@pytest.mark.parametrize("dims", [GLM_DIMS, KernelDims(heads=4, kv_lora=64, rope=16)], ids=["glm", "tiny"])
def test_every_kernel_compiles_to_ptx_without_a_gpu(dims: KernelDims) -> None:
    ptx = compile_all_kernels_to_ptx("compute_90", dims)
    assert set(ptx) == set(KERNEL_MODULES)
    for module, entries in KERNEL_MODULES.items():
        text = ptx[module]
        assert ".target sm_90" in text
        for entry in entries:
            assert f".entry {entry}(" in text, f"{entry} missing from the PTX of {module}"
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx["mla_mma.cu"]
    assert ".local" not in ptx["mla_mma.cu"]  # accumulators stay in registers


def test_sources_are_self_contained_package_data() -> None:
    for module in KERNEL_MODULES:
        text = sources.kernel_source(module)
        assert "#include" not in text  # the common header is spliced in: NVRTC needs no include path
        assert text.count("#define MLA_COMMON_CUH") == 1


@needs_cuda_extra
def test_a_kernel_that_does_not_compile_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sources.read_source
    monkeypatch.setattr(sources, "read_source", lambda name: real(name) + "\nthis is not C++;\n")
    with pytest.raises(sources.KernelCompileError, match="mla_reduce.cu"):
        sources.compile_to_ptx("mla_reduce.cu")


def test_missing_nvrtc_names_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", None)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs", None)
    with pytest.raises(BackendUnavailableError, match=r'pip install -e "\.\[cuda\]"'):
        sources.compile_to_ptx("mla_reduce.cu")
