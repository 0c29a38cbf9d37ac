"""Every one of the 2^32 float32 bit patterns against ml_dtypes (about 20 s: marked slow).

The patterns go in chunks of 64K into buffers made once (a chunk and its codes stay in the CPU's cache, and no
page is faulted in per chunk): the same oracle as ``ml_oracle`` (ml_dtypes' RNE cast of the value clipped to
+-448, NaN -> 0x00), written with ``out=`` buffers.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from kernels import fp8
from tests.kernels.test_fp8 import F8, ml_oracle

CHUNK = 1 << 16


@pytest.mark.slow
def test_all_float32_bit_patterns_against_ml_dtypes():
    offsets = np.arange(CHUNK, dtype=np.uint32)  # [C] u32
    bits = np.empty(CHUNK, np.uint32)  # [C] u32: this chunk's patterns
    x = bits.view(np.float32)  # [C] f32: the same bytes as values
    codes = np.empty(CHUNK, np.uint8)  # [C] u8: the codec's codes
    clipped = np.empty(CHUNK, np.float32)  # [C] f32
    ref = np.empty(CHUNK, F8)  # [C] e4m3: the oracle's codes
    ref_codes = ref.view(np.uint8)  # [C] u8
    nan = np.empty(CHUNK, bool)  # [C]
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for base in range(0, 1 << 32, CHUNK):
            np.add(offsets, np.uint32(base), out=bits)
            fp8.encode_into(x, codes)
            np.clip(x, -448, 448, out=clipped)
            np.copyto(ref, clipped, casting="unsafe")  # ml_dtypes' cast, as astype(F8) does
            np.isnan(x, out=nan)
            np.copyto(ref_codes, 0, where=nan)
            if not np.array_equal(codes, ref_codes):
                bad = int(np.flatnonzero(codes != ref_codes)[0])
                pytest.fail(f"pattern {base + bad:#010x}: codec {codes[bad]:#04x}, oracle {ref_codes[bad]:#04x}")
            checked += CHUNK
    assert checked == 1 << 32


def test_the_chunked_oracle_is_ml_oracle():
    """The buffered oracle above gives what ``ml_oracle`` gives, on one chunk of every kind of value."""
    rng = np.random.default_rng(35)
    bits = np.concatenate([rng.integers(0, 1 << 32, CHUNK, dtype=np.uint32),
                           np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x43E00000, 0x43E80000],
                                    np.uint32)])  # [C+7] u32: random, +-0, +-inf, NaN, 448, 464
    x = bits.view(np.float32)
    ref = np.empty(x.size, F8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        np.copyto(ref, np.clip(x, -448, 448), casting="unsafe")
    codes = ref.view(np.uint8)
    codes[np.isnan(x)] = 0
    assert np.array_equal(codes, ml_oracle(x))
