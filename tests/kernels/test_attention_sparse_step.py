"""The batched sparse decode step (DSA, one position per session): the float64 reference on the
selected rows, bitwise the same whoever shares the batch, any split of a cache into blocks, and
refusals of bad selections."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.attention.sparse_step import batched_sparse_decode
from kernels.errors import FormatError, ModelMismatchError
from kernels.rows import F32Rows, Fp8Rows
from tests.kernels.attention_cases import F32_RTOL, latent_rows, quantize, queries, reference_absorbed, split_rows

KV_LORA, ROPE, HEADS, K, SCALE = 64, 16, 4, 12, 0.11


def _session(rng: np.random.Generator, length: int, fp8: bool, cuts: list[int]) -> tuple[list, np.ndarray, np.ndarray,
                                                                                         np.ndarray]:
    """(blocks, selection [K], reference rows lc, rc of the dequantised cache)."""
    lc, rc = latent_rows(rng, length, KV_LORA, ROPE)
    if fp8:
        cache = quantize(lc, rc)
        rows, lc, rc = cache.rows, cache.lc_deq, cache.rc_deq
    else:
        rows = F32Rows(lc, rc)
    selection = np.sort(rng.choice(length, K, replace=False))
    return split_rows(rows, cuts), selection, lc, rc


@pytest.fixture(scope="module")
def batch() -> tuple[list, list, np.ndarray, np.ndarray, list]:
    rng = np.random.default_rng(21)
    sessions = [_session(rng, n, fp8, cuts) for n, fp8, cuts in
                [(40, True, [13]), (12, True, []), (90, False, [30, 31]), (57, True, [56]), (33, False, [])]]
    qa = queries(rng, len(sessions), HEADS, KV_LORA)  # [B, H, kv_lora]
    qr = queries(rng, len(sessions), HEADS, ROPE)  # [B, H, rope]
    return [s[0] for s in sessions], [s[1] for s in sessions], qa, qr, sessions


def test_each_session_matches_the_float64_reference_on_its_selected_rows(batch: tuple) -> None:
    blocks, selections, qa, qr, sessions = batch
    ctx = batched_sparse_decode(qa, qr, blocks, selections, SCALE)  # [B, H, kv_lora]
    for b, (_, sel, lc, rc) in enumerate(sessions):
        want = reference_absorbed(qa[b : b + 1], qr[b : b + 1], lc[sel], rc[sel], SCALE, causal=False)
        assert np.abs(ctx[b : b + 1] - want).max() <= F32_RTOL * np.abs(want).max()


def test_a_sessions_context_does_not_depend_on_who_shares_the_step(batch: tuple) -> None:
    blocks, selections, qa, qr, _ = batch
    alone = [batched_sparse_decode(qa[b : b + 1], qr[b : b + 1], [blocks[b]], [selections[b]], SCALE)[0]
             for b in range(len(blocks))]
    for order in ([4, 2, 0], [1, 3], [3, 1, 4, 0, 2]):
        got = batched_sparse_decode(qa[order], qr[order], [blocks[b] for b in order], [selections[b] for b in order],
                                    SCALE)
        for row, b in enumerate(order):
            assert np.array_equal(got[row], alone[b]), (order, b)


def test_an_all_fp8_batch_reading_codes_matches_the_decoded_path(batch: tuple) -> None:
    """Sessions 0, 1, 3 are fp8: alone they attend their codes through the decode table; beside an
    f32 session their codes are decoded for the batch first. Both are the same numbers, bitwise."""
    blocks, selections, qa, qr, _ = batch
    fp8_only, mixed = [0, 1, 3], [0, 1, 3, 2]
    codes = batched_sparse_decode(qa[fp8_only], qr[fp8_only], [blocks[b] for b in fp8_only],
                                  [selections[b] for b in fp8_only], SCALE)
    decoded = batched_sparse_decode(qa[mixed], qr[mixed], [blocks[b] for b in mixed],
                                    [selections[b] for b in mixed], SCALE)
    assert np.array_equal(codes, decoded[:3])


def test_the_split_of_a_cache_into_blocks_changes_nothing() -> None:
    rng = np.random.default_rng(4)
    blocks, sel, _, _ = _session(rng, 70, True, [])
    qa, qr = queries(rng, 1, HEADS, KV_LORA), queries(rng, 1, HEADS, ROPE)
    whole = batched_sparse_decode(qa, qr, [blocks], [sel], SCALE)
    for cuts in ([1], [35, 36, 69], [int(sel[3]), int(sel[3]) + 1]):
        split = split_rows(blocks[0], cuts)
        assert np.array_equal(batched_sparse_decode(qa, qr, [split], [sel], SCALE), whole), cuts


def test_read_only_strided_and_mixed_blocks_gather_the_same_rows() -> None:
    """Rows in a file's record layout (strided, mapped read-only), and a block whose fields differ
    in writability, give the context of the same rows held in plain arrays."""
    rng = np.random.default_rng(5)
    blocks, sel, _, _ = _session(rng, 70, True, [])
    rows = blocks[0]
    qa, qr = queries(rng, 1, HEADS, KV_LORA), queries(rng, 1, HEADS, ROPE)
    whole = batched_sparse_decode(qa, qr, [blocks], [sel], SCALE)
    records = np.zeros(70, dtype=[("lsc", "<f4"), ("lc", "u1", KV_LORA), ("rsc", "<f4"), ("rc", "u1", ROPE)])
    for name, field in (("lc", rows.lc_codes), ("rc", rows.rc_codes), ("lsc", rows.lc_scale), ("rsc", rows.rc_scale)):
        records[name] = field
    records.flags.writeable = False  # a read-only mapping
    mapped = Fp8Rows(records["lc"], records["lsc"], records["rc"], records["rsc"])
    mixed = Fp8Rows(rows.lc_codes, records["lsc"], rows.rc_codes, rows.rc_scale)  # one read-only field
    for variant in ([mapped], split_rows(mapped, [20, 50]), [mixed]):
        assert np.array_equal(batched_sparse_decode(qa, qr, [variant], [sel], SCALE), whole)


def test_bad_selections_are_refused(batch: tuple) -> None:
    blocks, selections, qa, qr, _ = batch
    two = (qa[:2], qr[:2], blocks[:2])
    with pytest.raises(FormatError, match="same number"):
        batched_sparse_decode(*two, [selections[0], selections[1][:-1]], SCALE)
    with pytest.raises(FormatError, match="inside"):
        batched_sparse_decode(*two, [selections[0], selections[1] + 100], SCALE)
    with pytest.raises(FormatError, match="ascend"):
        batched_sparse_decode(*two, [selections[0], selections[1][::-1]], SCALE)
    with pytest.raises(FormatError, match="queries"):
        batched_sparse_decode(qa[:1], qr[:1], blocks[:2], selections[:2], SCALE)
    narrow = [F32Rows(np.zeros((20, KV_LORA // 2), np.float32), np.zeros((20, ROPE), np.float32))]
    with pytest.raises(ModelMismatchError):
        batched_sparse_decode(*two[:2], [blocks[0], narrow], selections[:2], SCALE)
