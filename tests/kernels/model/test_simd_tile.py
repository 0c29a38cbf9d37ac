"""The register tiles of the compiled step's products (kernels.model.simd_tile): bitwise the plain
row kernels the reference step uses (rows_times, heads_times: a multiply then an add, k ascending,
no FMA), for every row count and width the tiles split differently (1-4 rows, 16-lane vectors, wide
tiles, the scalar rest, steps of fewer than 4 rows), gathered and scattered rows, and NaN, inf, -0.0
and subnormal inputs; a row's bits whatever shares its tile."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.model.rowwise import column_block, heads_times, rows_times
from kernels.model.simd_tile import TILE_VECTORS, tile_heads, tile_rows, tile_vectors, tile_width


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal, NaN where NaN (its payload and sign are not IEEE's to fix: LLVM may swap an
    add's operands, and x86 keeps the first NaN)."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def _inputs(rng: np.random.Generator, rows: int, depth: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((rows, depth), dtype=np.float32)
    wt = rng.standard_normal((depth, width), dtype=np.float32)
    x.flat[:: 7] *= np.float32(1e-3)  # sums that round differently when contracted or reordered
    if rows > 2:
        x[1, :4] = [np.nan, np.inf, -0.0, np.float32(1e-41)]
        wt[2, :3] = [-np.inf, 0.0, np.float32(-1e-40)]
    return x, wt


@pytest.mark.parametrize(("depth", "width"), [(160, 3072), (96, 192), (160, 80), (160, 8), (37, 300), (64, 16)])
def test_tile_rows_is_rows_times_bitwise(depth: int, width: int) -> None:
    rng = np.random.default_rng(depth * 1000 + width)
    x, wt = _inputs(rng, 11, depth, width)
    want = np.empty((11, width), np.float32)
    rows_times(x, wt, want, column_block(depth, width))
    for rows in (1, 2, 3, 4, 5, 6, 7, 11):  # fewer than 4: the plain loop; else tiles of 4 + a rest of 1-3 rows
        idx = np.arange(rows, dtype=np.int64)
        got = np.full((rows, width), np.nan, np.float32)
        tile_rows(x[:rows], idx, wt, got, idx, column_block(depth, width))
        assert _same_bits(got, want[:rows]), rows
    xi = np.array([9, 0, 0, 4, 10, 3, 1], np.int64)  # gathered rows, a row twice, scattered outputs
    oi = np.array([2, 6, 0, 5, 1, 4, 3], np.int64)
    got = np.full((7, width), np.nan, np.float32)
    tile_rows(x, xi, wt, got, oi, width)
    assert _same_bits(got[oi], want[xi])


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_tile_heads_is_heads_times_bitwise(rows: int) -> None:
    rng = np.random.default_rng(rows)
    for depth, width in ((32, 64), (64, 32), (19, 40)):
        x = rng.standard_normal((rows, 4, depth), dtype=np.float32)
        w = rng.standard_normal((4, depth, width), dtype=np.float32)
        want = np.empty((rows, 4, width), np.float32)
        heads_times(x, w, want)
        got = np.full((rows, 4, width), np.nan, np.float32)
        tile_heads(x, w, got, np.arange(rows, dtype=np.int64))
        assert _same_bits(got, want)


def test_a_tile_holds_what_the_machines_registers_hold() -> None:
    """AVX-512's 32 registers of 16 lanes hold 16 sums of a tile; AVX2's 16 of 8 lanes hold 4 (a
    16-lane sum takes two), and anything else no more; a tile of r rows then holds 16 // r or 4 // r
    vectors (at least one)."""
    assert tile_vectors("+64bit,+avx,+avx2,+fma,-avx512f,-avx512bw") == 4
    assert tile_vectors("+avx2,+avx512f,+avx512bw") == 16
    assert tile_vectors("") == 4
    assert TILE_VECTORS in (4, 16)
    wide = TILE_VECTORS == 16
    assert [tile_width(r, 4) for r in (1, 2, 3, 4)] == ([4, 4, 4, 4] if wide else [4, 2, 1, 1])
    assert tile_width(1, 16) == (16 if wide else 4)
