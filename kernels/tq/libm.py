"""The platform C library's float32 functions that PolarQuant's bytes depend on (facts 4.3).

The engine encodes with libm's ``atan2f``/``hypotf`` and decodes angles with its ``cosf``/``sinf``.
numpy's own float32 kernels are not libm's: its sin/cos round differently for a share of inputs,
and on AVX-512 machines its arctan2 is a SIMD approximation that differs from glibc's atan2f on
~40% of inputs (hypot happened to agree). So the encode calls ``atan2f``/``hypotf`` from a numba
kernel (:mod:`.libm_kernel`: LLVM emits calls to the C library's symbols; no vector math library
is linked in), and the (small) decode tables call ``cosf``/``sinf`` through ctypes. Without a loadable libm the
tables fall back to float64 cos/sin rounded to float32.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

import numpy as np

__all__ = ["LIBM_SOURCE", "cos_sin_f32"]

def _load() -> tuple[Callable[[float], float], Callable[[float], float]] | None:
    name = ctypes.util.find_library("m") or "libm.so.6"
    try:
        lib = ctypes.CDLL(name)
        cosf, sinf = lib.cosf, lib.sinf
    except (OSError, AttributeError):
        return None
    for fn in (cosf, sinf):
        fn.restype = ctypes.c_float
        fn.argtypes = [ctypes.c_float]
    return cosf, sinf


_FUNCS = _load()
LIBM_SOURCE = "libm cosf/sinf (ctypes)" if _FUNCS is not None else "float64 cos/sin rounded to f32"


def cos_sin_f32(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cosf and sinf of each f32 angle [k] -> two [k] f32 arrays (k is a table size: <= a few hundred)."""
    a = np.asarray(angles, dtype=np.float32).reshape(-1)  # a: [k] f32
    if _FUNCS is None:
        a64 = a.astype(np.float64)
        return np.cos(a64).astype(np.float32), np.sin(a64).astype(np.float32)
    cosf, sinf = _FUNCS
    cos = np.array([cosf(float(v)) for v in a], dtype=np.float32)  # cos: [k] f32
    sin = np.array([sinf(float(v)) for v in a], dtype=np.float32)  # sin: [k] f32
    return cos, sin
