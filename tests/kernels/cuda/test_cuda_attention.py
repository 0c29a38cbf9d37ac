"""CUDA attention on a real device vs the numpy path (gpu-marked: skipped without a device).

Tolerances (tests/kernels/attention_cases.py): "simt"/"mma" vs CPU fp8 within CUDA_RTOL,
"mma_fast" within CUDA_FAST_RTOL; any CUDA fp8 result vs CPU f32 within FP8_VS_F32_RTOL.
Data: random rows with 30x outliers, GLM-5.2 head shapes, T up to 128k, causal S > 1, a batch
of 16 sessions of different lengths, device-resident record-strided views, and the tiny
reference model generating token-for-token the same as on the CPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from kernels.attention import absorbed_attention, mla_attention
from kernels.backend import get_backend
from kernels.rows import F32Rows, Fp8Rows
from tests.kernels.attention_cases import (
    CUDA_FAST_RTOL,
    CUDA_RTOL,
    FP8_VS_F32_RTOL,
    latent_rows,
    quantize,
    queries,
    rel_err,
    split_rows,
)
from tests.support.batched_decode import batched_decode

pytestmark = pytest.mark.gpu

H, KV, ROPE = 64, 512, 64
SCALE = 1.0 / np.sqrt(192 + 64)
TOL = {"simt": CUDA_RTOL, "mma": CUDA_RTOL, "mma_fast": CUDA_FAST_RTOL}
KERNELS = list(TOL)


def _cpu(qa, qr, blocks, causal=True) -> np.ndarray:
    return absorbed_attention(qa, qr, blocks, SCALE, causal=causal).astype(np.float64)


@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_matches_cpu_f32_and_fp8(kernel: str) -> None:
    rng = np.random.default_rng(10)
    lc, rc = latent_rows(rng, 4096, KV, ROPE)
    fp8 = quantize(lc, rc)
    qa, qr = queries(rng, 1, H, KV, 0.1), queries(rng, 1, H, ROPE, 0.1)
    got = get_backend("cuda", kernel=kernel).absorbed_attention(qa, qr, [fp8.rows], SCALE)
    assert isinstance(got, np.ndarray) and got.shape == (1, H, KV) and got.dtype == np.float32
    assert rel_err(got, _cpu(qa, qr, [fp8.rows])) < TOL[kernel]
    assert rel_err(got, _cpu(qa, qr, [F32Rows(lc, rc)])) < FP8_VS_F32_RTOL


def test_simt_over_f32_rows_matches_cpu() -> None:
    rng = np.random.default_rng(11)
    lc, rc = latent_rows(rng, 3000, KV, ROPE)
    qa, qr = queries(rng, 1, H, KV, 0.1), queries(rng, 1, H, ROPE, 0.1)
    got = get_backend("cuda").absorbed_attention(qa, qr, [F32Rows(lc, rc)], SCALE)
    assert rel_err(got, _cpu(qa, qr, [F32Rows(lc, rc)])) < CUDA_RTOL


@pytest.mark.parametrize("kernel", KERNELS)
def test_long_context_128k(kernel: str) -> None:
    rng = np.random.default_rng(12)
    length = 131_072
    fp8 = quantize(*latent_rows(rng, length, KV, ROPE))
    qa, qr = queries(rng, 1, H, KV, 0.1), queries(rng, 1, H, ROPE, 0.1)
    got = get_backend("cuda", kernel=kernel).absorbed_attention(qa, qr, [fp8.rows], SCALE)
    assert rel_err(got, _cpu(qa, qr, [fp8.rows])) < TOL[kernel]


@pytest.mark.parametrize("kernel", KERNELS)
def test_causal_batch_of_queries(kernel: str) -> None:
    rng = np.random.default_rng(13)
    lc, rc = latent_rows(rng, 2000, KV, ROPE)
    fp8 = quantize(lc, rc)
    qa, qr = queries(rng, 37, H, KV, 0.1), queries(rng, 37, H, ROPE, 0.1)
    got = get_backend("cuda", kernel=kernel).absorbed_attention(qa, qr, split_rows(fp8.rows, [100, 1500]), SCALE)
    assert rel_err(got, _cpu(qa, qr, [fp8.rows])) < TOL[kernel]
    assert rel_err(got, _cpu(qa, qr, [F32Rows(lc, rc)])) < FP8_VS_F32_RTOL


@pytest.mark.parametrize("kernel", KERNELS)
def test_sixteen_sessions_in_one_batch(kernel: str) -> None:
    rng = np.random.default_rng(14)
    lengths = [1, 2, 31, 32, 33, 500, 1024, 4097, 7, 12_000, 64, 65, 3000, 20_000, 129, 256]
    caches = [quantize(*latent_rows(rng, n, KV, ROPE, outliers=b % 2 == 0)).rows for b, n in enumerate(lengths)]
    qa, qr = queries(rng, 16, H, KV, 0.1), queries(rng, 16, H, ROPE, 0.1)
    got = batched_decode(get_backend("cuda", kernel=kernel), qa, qr, caches, SCALE)
    assert got.shape == (16, H, KV)
    for b, rows in enumerate(caches):
        assert rel_err(got[b], _cpu(qa[b : b + 1], qr[b : b + 1], [rows])[0]) < TOL[kernel]


@pytest.mark.parametrize("kernel", ["simt", "mma"])
def test_device_resident_record_views_and_cupy_in_cupy_out(kernel: str) -> None:
    import cupy as cp

    rng = np.random.default_rng(15)
    length, layers, layer = 3000, 78, 5
    rec = 4 + layers * (KV + ROPE + 8)  # 45,556 B: GLM-5.2 v2 record
    fp8 = quantize(*latent_rows(rng, length, KV, ROPE))
    host = np.zeros((length, rec), np.uint8)  # host: [T, rec] u8 records
    off = 4 + layer * (KV + ROPE + 8)
    host[:, off : off + KV] = fp8.rows.lc_codes
    host[:, off + KV : off + KV + 4] = fp8.rows.lc_scale.view(np.uint8).reshape(length, 4)
    host[:, off + KV + 4 : off + KV + 4 + ROPE] = fp8.rows.rc_codes
    host[:, off + KV + 4 + ROPE : off + KV + 8 + ROPE] = fp8.rows.rc_scale.view(np.uint8).reshape(length, 4)
    dev = cp.asarray(host)
    rows = Fp8Rows(
        dev[:, off : off + KV],
        dev[:, off + KV : off + KV + 4].view(cp.float32)[:, 0],
        dev[:, off + KV + 4 : off + KV + 4 + ROPE],
        dev[:, off + KV + 4 + ROPE : off + KV + 8 + ROPE].view(cp.float32)[:, 0],
    )
    assert rows.lc_codes.strides == (rec, 1) and rows.lc_scale.strides == (rec,)
    qa, qr = queries(rng, 2, H, KV, 0.1), queries(rng, 2, H, ROPE, 0.1)
    got = get_backend("cuda", kernel=kernel).absorbed_attention(cp.asarray(qa), cp.asarray(qr), [rows], SCALE)
    assert isinstance(got, cp.ndarray)
    assert rel_err(cp.asnumpy(got), _cpu(qa, qr, [fp8.rows])) < TOL[kernel]


def test_mla_attention_on_device_matches_cpu() -> None:
    rng = np.random.default_rng(16)
    fp8 = quantize(*latent_rows(rng, 900, KV, ROPE))
    w_uk = (rng.standard_normal((H, 192, KV)) * 0.05).astype(np.float32)
    w_uv = (rng.standard_normal((H, 256, KV)) * 0.05).astype(np.float32)
    qn, qr = queries(rng, 4, H, 192, 0.2), queries(rng, 4, H, ROPE, 0.2)
    want = mla_attention(qn, qr, [fp8.rows], w_uk, w_uv, SCALE, path="absorbed").astype(np.float64)
    got = get_backend("cuda").mla_attention(qn, qr, [fp8.rows], w_uk, w_uv, SCALE)
    assert rel_err(got, want) < 10 * CUDA_RTOL  # cuBLAS matmuls around the kernel may use other sum orders


@pytest.mark.parametrize("kv_dtype,kernel", [("f32", "simt"), ("fp8", "simt"), ("fp8", "mma")])
def test_reference_model_generates_the_same_tokens_as_the_cpu(kv_dtype: str, kernel: str) -> None:
    from kernels.model import generate, load_model

    model = load_model("tiny")
    prompt = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
    cpu = generate(model, model.new_cache(kv_dtype, "cpu"), prompt, 32).tokens
    cuda = generate(model, model.new_cache(kv_dtype, get_backend("cuda", kernel=kernel)), prompt, 32).tokens
    assert cuda == cpu
