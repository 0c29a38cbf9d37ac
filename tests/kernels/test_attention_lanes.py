"""kernels.attention.lanes: the vector form of the attention dot product's eight lane sums is bitwise
the scalar chains it replaced (a rounded multiply then a rounded add per element, no FMA), for every
length and alignment."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from kernels.attention.lanes import LANES, lane_sums


@njit(cache=False)
def _vector_dot(a: np.ndarray, b: np.ndarray) -> np.float32:
    n = a.shape[0]
    full = n - n % LANES
    s0, s1, s2, s3, s4, s5, s6, s7 = lane_sums(a.ctypes.data, b.ctypes.data, full)
    total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for i in range(full, n):
        total += a[i] * b[i]
    return total


def _scalar_dot(a: np.ndarray, b: np.ndarray, fused: bool = False) -> np.float32:
    """The chains as numpy f32 scalars: lane i over i, i + 8, ..., combined as a fixed tree, then the
    tail; ``fused``: each lane step one rounding (what an FMA would give), to show the data tells them apart."""
    n = a.shape[0]
    full = n - n % LANES
    s = [np.float32(0.0)] * LANES
    for i in range(0, full, LANES):
        for lane in range(LANES):
            x, y = a[i + lane], b[i + lane]
            s[lane] = (np.float32(np.float64(s[lane]) + np.float64(x) * np.float64(y)) if fused
                       else np.float32(s[lane] + np.float32(x * y)))
    total = np.float32(np.float32(np.float32(s[0] + s[1]) + np.float32(s[2] + s[3]))
                       + np.float32(np.float32(s[4] + s[5]) + np.float32(s[6] + s[7])))
    for i in range(full, n):
        total = np.float32(total + np.float32(a[i] * b[i]))
    return total


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_lane_sums_are_the_scalar_chains_bitwise(offset: int) -> None:
    rng = np.random.default_rng(offset)
    told_apart = 0
    for n in [0, 1, 7, 8, 9, 15, 16, 17, 31, 64, 80, 83, 130]:
        buf_a = rng.standard_normal(n + offset).astype(np.float32)
        buf_b = rng.standard_normal(n + offset).astype(np.float32)
        buf_a[::3] *= np.float32(1e-4)  # products whose sums round differently if fused or reordered
        a, b = buf_a[offset:], buf_b[offset:]  # unaligned starts
        got, want = _vector_dot(a, b), _scalar_dot(a, b)
        assert np.float32(got).view(np.uint32) == want.view(np.uint32), n
        told_apart += bool(_scalar_dot(a, b, fused=True) != want)
    assert told_apart  # a fused (FMA) chain would have failed this test


