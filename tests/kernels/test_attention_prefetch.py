"""A prefetch is a hint: it changes no value and never faults, whatever the address (the rows of a
step's attention are asked for before they are read: kernels.attention.prefetch)."""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels.attention.prefetch import prefetch, prefetch_span


@njit(cache=False)
def _hint_then_sum(a: np.ndarray, addresses: np.ndarray) -> float:  # pragma: no cover - compiled
    for address in addresses:
        prefetch(address)
        prefetch_span(address, 200)
    prefetch_span(a.ctypes.data, a.nbytes)
    prefetch_span(a.ctypes.data, 0)
    return a.sum()


def test_prefetch_changes_nothing_and_never_faults() -> None:
    a = np.arange(1000, dtype=np.float64)
    before = a.copy()
    # null, unmapped, kernel-half and misaligned addresses: a load of any of them would fault
    addresses = np.array([0, 8, 2**47 - 64, -(2**62), a.ctypes.data + 3], dtype=np.int64)
    assert _hint_then_sum(a, addresses) == before.sum()
    assert np.array_equal(a, before)
