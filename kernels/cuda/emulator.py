"""Run the CUDA attention kernels on the CPU (no GPU, no CUDA toolkit): a test harness.

The kernel sources are compiled as C++ (g++) against ``emu_runtime.h``, which runs each CUDA
thread of a block as a fiber with real barriers, warp shuffles and an mma.sync emulated from
the PTX fragment layouts. ``EmulatorRunner`` plugs into ``kernels.cuda.launch`` exactly where a
GPU runner does, so the host packing, split planning, the split kernels and the reduce kernel
are all checked in CI against the numpy attention. It proves the kernels' logic (indexing,
masking, online softmax, split merge, fragment bookkeeping as the PTX ISA documents it); it
cannot prove GPU-specific behaviour (memory model, real tensor-core rounding, speed).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kernels.cuda.sources import KERNEL_MODULES, KernelDims, kernel_source, mma_supported
from kernels.errors import BackendUnavailableError

_SIGNATURE = re.compile(r"MLA_KERNEL void (\w+)\(([^)]*)\)")
_EMU_SMEM_BYTES = 256 * 1024  # MLA_DYNAMIC_SMEM's static buffer under emulation
_libs: dict[KernelDims, tuple[ctypes.CDLL, dict[str, list[str]]]] = {}


def compiler() -> str | None:
    """The C++ compiler the emulator uses ($CXX or g++), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _signatures(source: str) -> dict[str, list[tuple[str, str]]]:
    sigs: dict[str, list[tuple[str, str]]] = {}
    for name, params in _SIGNATURE.findall(source):
        parts = [p.strip() for p in params.split(",") if p.strip()]
        sigs[name] = [(p[: p.rstrip().rfind(" ")].strip(), p.split()[-1].lstrip("*")) for p in parts]
    return sigs


def _translation_unit(dims: KernelDims) -> tuple[str, dict[str, list[tuple[str, str]]]]:
    here = Path(__file__).with_name("emu_runtime.h")
    modules = [m for m in KERNEL_MODULES if m != "mla_mma.cu" or mma_supported(dims)]  # as a GPU would load them
    body = "\n".join(kernel_source(m) for m in modules)
    sigs = _signatures(body)
    wrappers = []
    for name, params in sigs.items():
        decl = ", ".join(f"{t} {n}" for t, n in params)
        call = ", ".join(n for _, n in params)
        wrappers.append(
            f'extern "C" int emu_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx'
            f'{", " if decl else ""}{decl}) {{\n'
            f"    return emu::launch(gx, gy, gz, bx, [=]() {{ {name}({call}); }});\n}}\n"
        )
    return f'#include "{here}"\n{body}\n' + "\n".join(wrappers), sigs


def _ctype(c_type: str) -> Any:
    if "*" in c_type:
        return ctypes.c_void_p
    return {"float": ctypes.c_float, "int": ctypes.c_int}[c_type]


def _cache_dir() -> Path:
    """A private build cache: $TMPDIR/coli-mla-emu-<uid>, ours and not writable by others, else a fresh one."""
    path = Path(tempfile.gettempdir()) / f"coli-mla-emu-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if path.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return Path(tempfile.mkdtemp(prefix="coli-mla-emu-"))
    return path


def load(dims: KernelDims) -> tuple[ctypes.CDLL, dict[str, list[str]]]:
    """Build (cached by content hash) and load the emulated kernels for ``dims``."""
    if dims in _libs:
        return _libs[dims]
    cxx = compiler()
    if cxx is None:
        raise BackendUnavailableError("the CUDA emulator needs a C++ compiler (g++ or $CXX)")
    source, sigs = _translation_unit(dims)
    # -U_FORTIFY_SOURCE: no __longjmp_chk, which refuses the fibers' jumps between stacks
    flags = ["-std=c++20", "-O2", "-shared", "-fPIC", "-w", "-U_FORTIFY_SOURCE", *dims.defines()]
    key = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:20]
    cache = _cache_dir()
    lib_path = cache / f"{key}.so"
    if not lib_path.exists():
        src = cache / f"{key}.{os.getpid()}.cpp"  # per-process names: concurrent builds never share a file
        src.write_text(source)
        tmp = cache / f"{key}.{os.getpid()}.so"
        done = subprocess.run([cxx, *flags, "-o", str(tmp), str(src)], capture_output=True, text=True, check=False)
        src.unlink(missing_ok=True)
        if done.returncode != 0:
            raise BackendUnavailableError(f"emulator build failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    types = {}
    for name, params in sigs.items():
        fn = getattr(lib, f"emu_{name}")
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_uint] * 4 + [_ctype(t) for t, _ in params]
        types[name] = [t for t, _ in params]
    _libs[dims] = (lib, types)
    return _libs[dims]


class EmulatorRunner:
    """A ``kernels.cuda.launch.Runner`` over host memory: numpy arrays stand in for device arrays."""

    xp = np

    def __init__(self, n_sm: int = 2) -> None:
        self.n_sm = n_sm
        self.launches: list[tuple[str, tuple[int, int, int], int]] = []

    def address(self, arr: np.ndarray) -> int:
        return int(arr.__array_interface__["data"][0])

    def launch(self, dims: KernelDims, entry: str, grid: tuple[int, int, int], block: int, args: tuple[Any, ...],
               smem_bytes: int = 0) -> None:
        if smem_bytes > _EMU_SMEM_BYTES:
            raise BackendUnavailableError(f"{entry}: {smem_bytes} B of shared memory exceed the emulator's buffer")
        lib, _ = load(dims)
        conv: list[ctypes.c_void_p | ctypes.c_float | ctypes.c_int] = []
        for a in args:
            if isinstance(a, np.ndarray):
                conv.append(ctypes.c_void_p(self.address(a)))
            elif isinstance(a, (np.floating, float)):
                conv.append(ctypes.c_float(float(a)))
            else:
                conv.append(ctypes.c_int(int(a)))
        self.launches.append((entry, grid, block))
        if getattr(lib, f"emu_{entry}")(*grid, block, *conv) != 0:
            raise RuntimeError(f"emulated kernel {entry} deadlocked (a barrier not reached by every thread)")

    def smem_bytes(self, dims: KernelDims, entry: str) -> int:
        out = np.zeros(2, np.int32)
        self.launch(dims, "mla_mma_smem_bytes", (1, 1, 1), 32, (out,))
        return int(out[0] if entry.endswith("exact") else out[1])
