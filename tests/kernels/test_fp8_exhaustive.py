"""Every one of the 2^32 float32 bit patterns against ml_dtypes (about 30 s: marked slow)."""
from __future__ import annotations

import numpy as np
import pytest

from kernels import fp8
from tests.kernels.test_fp8 import bits_to_f32, ml_oracle


@pytest.mark.slow
def test_all_float32_bit_patterns_against_ml_dtypes():
    step = 1 << 24
    offsets = np.arange(step, dtype=np.uint32)  # [16.8M] u32
    for block in range(1 << 8):
        x = bits_to_f32(offsets + np.uint32(block * step))
        assert np.array_equal(fp8.encode(x), ml_oracle(x)), hex(block * step)
