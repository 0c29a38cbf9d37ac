"""TileGatherer.gather_at: the rows at chosen absolute positions, whatever the block split and kind."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.attention.tiles import TileGatherer, cache_shape
from kernels.errors import FormatError
from kernels.rows import F32Rows
from tests.kernels.attention_cases import latent_rows, quantize, record_array, record_view, split_rows

T, KV, ROPE = 97, 32, 8


@pytest.mark.parametrize("cuts", [[], [1], [13, 14, 60], [40, 96]])
@pytest.mark.parametrize("kind", ["f32", "fp8", "fp8-strided", "mixed"])
def test_gather_at_reads_exactly_the_selected_rows(cuts: list[int], kind: str) -> None:
    rng = np.random.default_rng(len(cuts))
    lc, rc = latent_rows(rng, T, KV, ROPE)
    q = quantize(lc, rc)
    if kind == "f32":
        blocks, want_lc, want_rc = split_rows(F32Rows(lc, rc), cuts), lc, rc
    elif kind == "fp8":
        blocks, want_lc, want_rc = split_rows(q.rows, cuts), q.lc_deq, q.rc_deq
    elif kind == "fp8-strided":
        recs = record_array(q.rows.lc_codes, q.rows.lc_scale, q.rows.rc_codes, q.rows.rc_scale, 3, 1)
        blocks, want_lc, want_rc = split_rows(record_view(recs, 1), cuts), q.lc_deq, q.rc_deq
    else:  # fp8 rows up to 50, f32 after
        blocks = [*split_rows(q.rows, [c for c in cuts if c < 50] + [50])[:-1],
                  *split_rows(F32Rows(lc[50:], rc[50:]), [c - 50 for c in cuts if c > 50])]
        want_lc = np.concatenate([q.lc_deq[:50], lc[50:]])
        want_rc = np.concatenate([q.rc_deq[:50], rc[50:]])
    positions = np.sort(rng.choice(T, size=20, replace=False))  # [20] ascending
    gather = TileGatherer(blocks, cache_shape(blocks), 32)
    fp8 = gather.gather_at(positions)
    n = positions.size
    got_lc = gather.lc[:n] * gather.lsc[:n, None]  # [n, kv_lora] f32, scales re-applied
    got_rc = gather.rc[:n] * gather.rsc[:n, None]
    assert np.array_equal(got_lc, want_lc[positions]) and np.array_equal(got_rc, want_rc[positions])
    assert fp8 == (kind != "f32" and (kind != "mixed" or bool(positions.min() < 50)))


def test_gather_at_refuses_bad_positions() -> None:
    lc, rc = latent_rows(np.random.default_rng(0), T, KV, ROPE)
    blocks = [F32Rows(lc, rc)]
    gather = TileGatherer(blocks, cache_shape(blocks), 8)
    for bad in ([3, 3], [5, 2], [-1], [T], list(range(9))):
        with pytest.raises(FormatError, match="gather_at"):
            gather.gather_at(np.array(bad))
