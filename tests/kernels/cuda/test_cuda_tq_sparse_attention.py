"""CUDA attention over v3 rows (int4, PolarQuant) and sparse (DSA) attention on a real device vs the
numpy path (gpu-marked: skipped without a device). GLM-5.2 head shapes; CUDA_RTOL against the CPU
over the same rows (v3: the rotated-domain attention; sparse: kernels.attention.sparse).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels.attention import absorbed_attention, sparse_absorbed_attention
from kernels.backend import get_backend
from kernels.rows import F32Rows, LatentRows
from kernels.tq import TqCodec
from tests.kernels.attention_cases import CUDA_RTOL, latent_rows, quantize, queries, rel_err
from tests.kernels.cuda.test_cuda_tq_emulated import cut, encode
from tests.support.batched_decode import batched_decode

pytestmark = pytest.mark.gpu

H, KV, ROPE = 64, 512, 64
SCALE = 1.0 / np.sqrt(192 + 64)


def _selection(rng: np.random.Generator, n_q: int, length: int, k: int) -> np.ndarray:
    out = np.empty((n_q, k), np.int64)  # out: [S, k] ascending, query s at row length - n_q + s
    for s in range(n_q):
        pos = length - n_q + s
        out[s] = np.sort(np.append(rng.choice(pos, size=k - 1, replace=False), pos))
    return out


CODECS = [TqCodec("int4", 4), TqCodec("polar", 4), TqCodec("polar", 2)]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.kv_dtype)
@pytest.mark.parametrize("length,n_q", [(4096, 1), (2000, 37), (65_536, 1)])
def test_v3_rows_match_cpu(codec: TqCodec, length: int, n_q: int) -> None:
    rng = np.random.default_rng(length + n_q)
    rows = encode(*latent_rows(rng, length, KV, ROPE), codec)
    qa, qr = queries(rng, n_q, H, KV, 0.1), queries(rng, n_q, H, ROPE, 0.1)
    got = get_backend("cuda").absorbed_attention(qa, qr, cut(rows, [length // 3]), SCALE)
    assert isinstance(got, np.ndarray) and got.shape == (n_q, H, KV) and got.dtype == np.float32
    assert rel_err(got, absorbed_attention(qa, qr, [rows], SCALE).astype(np.float64)) < CUDA_RTOL


def test_int4_batched_decode_and_cupy_in_cupy_out() -> None:
    import cupy as cp

    rng = np.random.default_rng(3)
    caches = [encode(*latent_rows(rng, n, KV, ROPE)) for n in (1, 33, 5000, 700)]
    qa, qr = queries(rng, 4, H, KV, 0.1), queries(rng, 4, H, ROPE, 0.1)
    got = batched_decode(get_backend("cuda"), cp.asarray(qa), cp.asarray(qr), caches, SCALE)
    assert isinstance(got, cp.ndarray)
    for b, rows in enumerate(caches):
        want = absorbed_attention(qa[b : b + 1], qr[b : b + 1], [rows], SCALE)[0].astype(np.float64)
        assert rel_err(cp.asnumpy(got[b]), want) < CUDA_RTOL


@pytest.mark.parametrize("kind", ["f32", "fp8", "int4", "polar4"])
@pytest.mark.parametrize("length,n_q,k", [(8192, 1, 2048), (3000, 9, 512)])
def test_sparse_matches_cpu(kind: str, length: int, n_q: int, k: int) -> None:
    rng = np.random.default_rng(length + k)
    lc, rc = latent_rows(rng, length, KV, ROPE)
    rows: LatentRows = {"f32": F32Rows(lc, rc), "fp8": quantize(lc, rc).rows, "int4": encode(lc, rc),
                        "polar4": encode(lc, rc, TqCodec("polar", 4))}[kind]
    sel = _selection(rng, n_q, length, k)
    qa, qr = queries(rng, n_q, H, KV, 0.1), queries(rng, n_q, H, ROPE, 0.1)
    got = get_backend("cuda").sparse_absorbed_attention(qa, qr, [rows], sel, SCALE)
    assert rel_err(got, sparse_absorbed_attention(qa, qr, [rows], sel, SCALE).astype(np.float64)) < CUDA_RTOL


@pytest.mark.parametrize("kv_dtype", ["f32", "fp8", "int4", "polar4"])
def test_tiny_glm_generates_the_same_tokens_as_the_cpu(tiny_glm_dir: Path, kv_dtype: str) -> None:
    from kernels.model import generate, load_model

    model = load_model(tiny_glm_dir)
    prompt = [1, *range(40, 70)]  # past index_topk: the full layers select rows
    cpu = generate(model, model.new_cache(kv_dtype, "cpu"), prompt, 24).tokens
    cuda = generate(model, model.new_cache(kv_dtype, get_backend("cuda")), prompt, 24).tokens
    assert cuda == cpu
