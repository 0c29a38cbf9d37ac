"""libm's ``atan2f``/``hypotf`` over float32 blocks, compiled (numba): PolarQuant's encode (see
:mod:`.libm` for why the C library's functions and not numpy's). Apart from :mod:`.libm`, so that
a reader of v3 rows (which decodes through tables) loads no compiled kernel.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, types, void

from kernels.compile_notice import announce_if_cold

__all__ = ["atan2_hypot_f32"]

_BLOCK = types.Array(types.float32, 2, "A")  # [R, count] f32, any strides (the pairs' views)


announce_if_cold(__file__)  # numba compiles the kernels below now unless cached

@njit(void(_BLOCK, _BLOCK, _BLOCK, _BLOCK), cache=True, nogil=True, boundscheck=False)
def _atan2_hypot(y: np.ndarray, x: np.ndarray, angle: np.ndarray, radius: np.ndarray) -> None:  # pragma: no cover
    """angle = atan2f(y, x), radius = hypotf(x, y), element by element (libm's, in float32)."""
    for i in range(y.shape[0]):
        for j in range(y.shape[1]):
            angle[i, j] = math.atan2(y[i, j], x[i, j])
            radius[i, j] = math.hypot(x[i, j], y[i, j])


def atan2_hypot_f32(y: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``atan2f(y, x)``, ``hypotf(x, y)``) of two [R, count] f32 blocks, by the C library."""
    angle = np.empty(y.shape, np.float32)  # [R, count] f32
    radius = np.empty(y.shape, np.float32)  # [R, count] f32
    _atan2_hypot(y, x, angle, radius)
    return angle, radius
