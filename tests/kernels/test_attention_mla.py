"""mla_attention: the absorbed and expanded paths agree with each other and with a float64
non-absorbed reference; the cost model picks absorbed for decode and expanded for long prefill."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.attention import attention_flops, choose_path, expanded_attention, mla_attention
from kernels.attention.mla import expanded_tile_rows
from kernels.errors import FormatError, ModelMismatchError
from kernels.rows import F32Rows
from tests.kernels.attention_cases import F32_RTOL, latent_rows, quantize, queries, reference_mla, rel_err, split_rows

KV, ROPE, NOPE, V_HEAD, HEADS = 64, 16, 24, 20, 4
SCALE = 1.0 / np.sqrt(NOPE + ROPE)


def _weights(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    w_uk = (rng.standard_normal((HEADS, NOPE, KV)) * 0.15).astype(np.float32)  # [H, nope, kv_lora]
    w_uv = (rng.standard_normal((HEADS, V_HEAD, KV)) * 0.15).astype(np.float32)  # [H, v_head, kv_lora]
    return w_uk, w_uv


@pytest.mark.parametrize("length,n_q,causal", [(1, 1, True), (500, 1, True), (500, 37, True), (300, 300, True),
                                               (200, 8, False)])
@pytest.mark.parametrize("kind", ["f32", "fp8"])
def test_absorbed_and_expanded_agree_with_reference(length: int, n_q: int, causal: bool, kind: str) -> None:
    rng = np.random.default_rng(length + n_q)
    lc, rc = latent_rows(rng, length, KV, ROPE)
    w_uk, w_uv = _weights(rng)
    qn, qr = queries(rng, n_q, HEADS, NOPE), queries(rng, n_q, HEADS, ROPE)
    if kind == "fp8":
        fp8 = quantize(lc, rc)
        blocks, lc_ref, rc_ref = [fp8.rows], fp8.lc_deq, fp8.rc_deq
    else:
        blocks, lc_ref, rc_ref = [F32Rows(lc, rc)], lc, rc
    ref = reference_mla(qn, qr, lc_ref, rc_ref, w_uk, w_uv, SCALE, causal)
    absorbed = mla_attention(qn, qr, blocks, w_uk, w_uv, SCALE, causal=causal, path="absorbed")
    expanded = mla_attention(qn, qr, blocks, w_uk, w_uv, SCALE, causal=causal, path="expanded")
    assert absorbed.shape == expanded.shape == (n_q, HEADS, V_HEAD)
    assert rel_err(absorbed, ref) < F32_RTOL
    assert rel_err(expanded, ref) < F32_RTOL
    assert rel_err(absorbed, expanded.astype(np.float64)) < F32_RTOL
    auto = mla_attention(qn, qr, blocks, w_uk, w_uv, SCALE, causal=causal)
    picked = absorbed if choose_path(n_q, length, HEADS, KV, ROPE, NOPE, V_HEAD, causal) == "absorbed" else expanded
    assert np.array_equal(auto, picked)


def test_expanded_is_bitwise_invariant_to_block_split() -> None:
    rng = np.random.default_rng(11)
    length = 3 * expanded_tile_rows(HEADS, NOPE, V_HEAD) + 5
    lc, rc = latent_rows(rng, length, KV, ROPE)
    fp8 = quantize(lc, rc)
    w_uk, w_uv = _weights(rng)
    qn, qr = queries(rng, 6, HEADS, NOPE), queries(rng, 6, HEADS, ROPE)
    for rows in (F32Rows(lc, rc), fp8.rows):
        whole = expanded_attention(qn, qr, [rows], w_uk, w_uv, SCALE)
        split = expanded_attention(qn, qr, split_rows(rows, [1, 100, length - 3]), w_uk, w_uv, SCALE)
        assert np.array_equal(whole, split)


def test_cost_model_picks_absorbed_for_decode_and_expanded_for_long_prefill() -> None:
    glm = {"heads": 64, "kv_lora": 512, "rope": 64, "nope": 192, "v_head": 256}
    assert choose_path(1, 131_072, **glm) == "absorbed"
    assert choose_path(16, 4096, **glm) == "absorbed"
    assert choose_path(8192, 8192, **glm) == "expanded"
    absorbed, expanded = attention_flops(8192, 8192, **glm)
    assert expanded < absorbed
    absorbed, expanded = attention_flops(1, 8192, **glm)
    assert absorbed * 100 < expanded


def test_bad_weights_and_path_raise_our_errors() -> None:
    rng = np.random.default_rng(12)
    lc, rc = latent_rows(rng, 10, KV, ROPE)
    w_uk, w_uv = _weights(rng)
    qn, qr = queries(rng, 1, HEADS, NOPE), queries(rng, 1, HEADS, ROPE)
    blocks = [F32Rows(lc, rc)]
    with pytest.raises(ModelMismatchError, match="w_uk"):
        mla_attention(qn, qr, blocks, w_uk[:, :, :10], w_uv, SCALE)
    with pytest.raises(ModelMismatchError, match="w_uv"):
        mla_attention(qn, qr, blocks, w_uk, w_uv[:2], SCALE)
    with pytest.raises(FormatError, match="path"):
        mla_attention(qn, qr, blocks, w_uk, w_uv, SCALE, path="sideways")  # type: ignore[arg-type]
