"""The row quantizer ignores every NaN, quiet and signalling, at every row width and position.

The reference below is the format notes' row rule written out as a per-row Python loop over the
raw f32 bit patterns (NaN recognised by its bits, not by a float comparison); single values are
encoded by ``enc_scalar``, the step-by-step rule of test_fp8.py. Neither touches kernels.fp8.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from kernels import fp8
from tests.kernels.test_fp8 import enc_scalar

F32 = np.float32
WIDTHS = range(1, 131)
# One payload per NaN kind: quiet and signalling, both signs. Signalling NaNs are
# 0x7f800001..0x7fbfffff (and their negatives); the payload cycles through that range by position.
KINDS = ("quiet+", "quiet-", "signalling+", "signalling-")


def nan_bits(kind: str, i: int) -> int:
    """A NaN bit pattern of ``kind``, its payload varying with ``i`` (the ends of the range included)."""
    payloads = (0x000001, 0x3FFFFF, 0x2A5A5A, 0x000100 + i)
    payload = payloads[i % len(payloads)]
    quiet = kind.startswith("quiet")
    bits = 0x7F800000 | (0x400000 if quiet else 0) | (payload & 0x3FFFFF)
    if not quiet and bits == 0x7F800000:
        bits |= 1  # payload 0 would be infinity
    return bits | (0x80000000 if kind.endswith("-") else 0)


def is_nan_bits(bits: int) -> bool:
    return (bits & 0x7F800000) == 0x7F800000 and (bits & 0x7FFFFF) != 0


@functools.lru_cache(maxsize=1 << 16)
def _enc_product(value: float, inv: float) -> int:
    """enc(f32(value * inv)) for finite f32 value and inv (cached: rows share most products)."""
    return enc_scalar(float(F32(value) * F32(inv)))


def reference_row(bits: list[int]) -> tuple[list[int], int]:
    """(codes, scale bits) of one row of raw f32 patterns, by the format notes' rule."""
    values = np.array(bits, np.uint32).view(F32).tolist()  # [n] Python floats (exact for an f32)
    amax = 0.0
    for b, v in zip(bits, values, strict=True):
        if not is_nan_bits(b) and abs(v) > amax:
            amax = abs(v)
    amax32 = F32(amax)  # exact: amax is one of the row's f32 values
    if not amax32 > F32(1e-35) or amax32 > F32(3.4e38):
        return [0] * len(bits), int(np.array([1.0], F32).view(np.uint32)[0])
    inv = float(F32(448) / amax32)  # the f32 quotient
    codes = [0 if is_nan_bits(b) else _enc_product(v, inv) for b, v in zip(bits, values, strict=True)]
    scale = np.array([amax32 / F32(448)], F32)
    return codes, int(scale.view(np.uint32)[0])


def base_row(n: int, descending: bool, seed: int) -> np.ndarray:
    """[n] f32 bits: magnitudes falling from the first element (the maximum comes before any NaN
    in the row's tail) or in random order, random signs and spread."""
    rng = np.random.default_rng(seed)
    mags = np.exp(rng.uniform(-3, 3, n)).astype(F32)  # [n] f32
    if descending:
        mags = np.sort(mags)[::-1]
    signs = np.where(rng.random(n) < 0.5, F32(-1), F32(1))
    return (mags * signs).astype(F32).view(np.uint32)  # [n] u32


def nan_rows(n: int) -> np.ndarray:
    """[R, n] u32: the two base rows with one NaN of each kind at each position, then rows with
    two NaNs (first and last), every value NaN, and a NaN beside an infinity."""
    rows = []
    for descending in (True, False):
        base = base_row(n, descending, seed=n)
        for pos in range(n):
            for kind in KINDS:
                row = base.copy()
                row[pos] = nan_bits(kind, pos)
                rows.append(row)
        two = base.copy()
        two[0], two[-1] = nan_bits("signalling+", 1), nan_bits("quiet-", 2)
        rows.append(two)
    rows.append(np.array([nan_bits(KINDS[i % 4], i) for i in range(n)], np.uint32))  # all NaN
    inf_row = base_row(n, True, seed=n + 1000)
    inf_row[-1] = 0x7F800000  # +inf: amax = inf > 3.4e38, a zero row
    if n > 1:
        inf_row[0] = nan_bits("signalling-", 0)
    rows.append(inf_row)
    return np.stack(rows)  # [R, n] u32


@pytest.mark.parametrize("n", WIDTHS)
def test_row_quantizer_ignores_every_nan(n: int) -> None:
    bits = nan_rows(n)  # [R, n] u32
    x = bits.view(F32)  # [R, n] f32
    assert np.array_equal(x.view(np.uint32), bits)  # the signalling payloads reach the kernel intact
    codes, scales = fp8.quantize_rows(x)
    for r, row in enumerate(bits.tolist()):
        want_codes, want_scale = reference_row(row)
        assert codes[r].tolist() == want_codes, (n, r)
        assert int(scales[r:r + 1].view(np.uint32)[0]) == want_scale, (n, r)


@pytest.mark.parametrize("n", [1, 6, 7, 9, 12, 100, 130])
def test_one_row_alone_and_in_a_batch_agree(n: int) -> None:
    """The same rows quantized one call per row, and as a [.., L, n] batch with strides."""
    bits = nan_rows(n)  # [R, n] u32
    codes, scales = fp8.quantize_rows(bits.view(F32))
    for r in range(0, bits.shape[0], 7):
        one_codes, one_scale = fp8.quantize_rows(bits[r].view(F32))
        assert np.array_equal(one_codes, codes[r]) and one_scale.view(np.uint32) == scales[r:r + 1].view(np.uint32)
    even = bits.shape[0] // 2 * 2
    batch = np.repeat(bits[:even].reshape(-1, 2, n), 2, axis=2)[..., ::2]  # [R/2, 2, n] u32, strided
    b_codes, b_scales = fp8.quantize_rows(batch.view(F32))
    assert np.array_equal(b_codes.reshape(even, n), codes[:even])
    assert np.array_equal(b_scales.reshape(-1).view(np.uint32), scales[:even].view(np.uint32))


def test_the_rows_put_nans_after_the_maximum() -> None:
    """The descending rows hold a NaN after the maximum at every width > 1: a reduction that lets
    a NaN reset its running maximum would give those rows another scale than the rule."""
    for n in (2, 6, 12, 100):
        row = base_row(n, True, seed=n).copy()
        mags = np.abs(row.view(F32))  # [n] f32
        row[n - 1] = nan_bits("signalling-", 0)
        _, scale_bits = reference_row(row.tolist())
        assert np.array([scale_bits], np.uint32).view(F32)[0] == mags[0] / F32(448)
        assert n == 2 or mags[1:n - 1].max() < mags[0]
