"""CUDA sparse (DSA) attention, run on the CPU by the emulator: the SIMT gather kernels read each
query's selected rows by index (f32, fp8, v3 int4 and PolarQuant rows) and match the numpy
``sparse_absorbed_attention`` within CUDA_RTOL over block splits, split sizes, causal prefill and
decode, inert rows and selections that cross or repeat the kernel's 16-row tile boundaries.
A selection of every visible row is bitwise the dense kernel's result. The emulated backend also
runs the tiny GLM (DSA) decoder token for token like the CPU.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels.attention import sparse_absorbed_attention
from kernels.backend import CudaBackend
from kernels.cuda.attention import absorbed_attention_device
from kernels.cuda.emulator import EmulatorRunner, compiler
from kernels.cuda.sparse import sparse_absorbed_attention_device
from kernels.errors import FormatError
from kernels.rows import F32Rows, Fp8Rows, LatentRows, TqRows
from kernels.tq import TqCodec
from tests.kernels.attention_cases import CUDA_RTOL, latent_rows, quantize, queries, rel_err, split_rows
from tests.kernels.cuda.test_cuda_tq_emulated import cut, encode

pytestmark = pytest.mark.skipif(compiler() is None, reason="the CUDA emulator needs a C++ compiler (g++)")

T, KV, ROPE, HEADS = 120, 64, 16, 10  # 10 heads: a full and a partial SIMT group
SCALE = 0.11
KINDS = ["f32", "fp8", "int4", "polar4"]


@pytest.fixture(scope="module")
def runner() -> EmulatorRunner:
    return EmulatorRunner(n_sm=2)


@pytest.fixture(scope="module")
def cache() -> dict[str, LatentRows]:
    rng = np.random.default_rng(21)
    lc, rc = latent_rows(rng, T, KV, ROPE)
    return {"f32": F32Rows(lc, rc), "fp8": quantize(lc, rc).rows, "int4": encode(lc, rc),
            "polar4": encode(lc, rc, TqCodec("polar", 4))}


def blocks_of(rows: LatentRows, cuts: list[int]) -> list[LatentRows]:
    if isinstance(rows, TqRows):
        return list(cut(rows, cuts))
    return list(split_rows(rows, cuts))


def random_selection(rng: np.random.Generator, n_q: int, length: int, k: int) -> np.ndarray:
    """[S, k] ascending rows; query s sees rows <= length - n_q + s and always selects its own."""
    out = np.empty((n_q, k), np.int64)
    for s in range(n_q):
        pos = length - n_q + s
        out[s] = np.sort(np.append(rng.choice(pos, size=k - 1, replace=False), pos))
    return out


def boundary_selection(n_q: int, length: int) -> np.ndarray:
    """[S, 34]: pairs and runs across the cache's 16-row tile boundaries (14..17, 30..33, 47/48, 63/64),
    then the 22 rows ending at each query's own row; list positions 16.. start the kernel's second tile."""
    head = [14, 15, 16, 17, 30, 31, 32, 33, 47, 48, 63, 64]
    return np.array([head + list(range(length - n_q + s - 21, length - n_q + s + 1)) for s in range(n_q)], np.int64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_q,k,split,cuts", [(1, 40, 16, []), (1, 33, None, [50]), (3, 16, 16, [16, 17]),
                                              (5, 48, 32, [7, 100]), (2, 1, None, [])])
def test_sparse_matches_cpu(runner: EmulatorRunner, cache: dict[str, LatentRows], kind: str, n_q: int, k: int,
                            split: int | None, cuts: list[int]) -> None:
    rng = np.random.default_rng(n_q * 100 + k)
    sel = random_selection(rng, n_q, T, k)
    qa, qr = queries(rng, n_q, HEADS, KV, 0.5), queries(rng, n_q, HEADS, ROPE, 0.5)
    runner.launches.clear()
    got = sparse_absorbed_attention_device(runner, qa, qr, blocks_of(cache[kind], cuts), sel, SCALE,
                                           split_rows=split)
    assert [e for e, _, _ in runner.launches].count(f"mla_sparse_simt_{kind[:5]}") == 1
    want = sparse_absorbed_attention(qa, qr, [cache[kind]], sel, SCALE).astype(np.float64)
    assert got.shape == (n_q, HEADS, KV) and got.dtype == np.float32
    assert rel_err(got, want) < CUDA_RTOL


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("split", [16, 32, None])
def test_selections_on_and_across_tile_boundaries(runner: EmulatorRunner, cache: dict[str, LatentRows], kind: str,
                                                  split: int | None) -> None:
    rng = np.random.default_rng(3)
    sel = boundary_selection(4, T)
    qa, qr = queries(rng, 4, HEADS, KV, 0.5), queries(rng, 4, HEADS, ROPE, 0.5)
    got = sparse_absorbed_attention_device(runner, qa, qr, blocks_of(cache[kind], [16, 32, 33]), sel, SCALE,
                                           split_rows=split)
    want = sparse_absorbed_attention(qa, qr, [cache[kind]], sel, SCALE).astype(np.float64)
    assert rel_err(got, want) < CUDA_RTOL


@pytest.mark.parametrize("kind", KINDS)
def test_selecting_every_visible_row_is_the_dense_kernel_bitwise(runner: EmulatorRunner,
                                                                 cache: dict[str, LatentRows], kind: str) -> None:
    rng = np.random.default_rng(4)
    qa, qr = queries(rng, 1, HEADS, KV, 0.5), queries(rng, 1, HEADS, ROPE, 0.5)
    every = np.arange(T)[None, :]  # [1, T]: the decode query's whole past
    got = sparse_absorbed_attention_device(runner, qa, qr, [cache[kind]], every, SCALE, split_rows=32)
    dense = absorbed_attention_device(runner, qa, qr, [cache[kind]], SCALE, split_rows=32)
    assert np.array_equal(got, dense)


def test_inert_rows_in_the_selection(runner: EmulatorRunner, cache: dict[str, LatentRows]) -> None:
    fp8 = cache["fp8"]
    assert isinstance(fp8, Fp8Rows)
    lsc = fp8.lc_scale.copy()
    lsc[[10, 11, 12]] = [0.0, np.nan, -1.0]
    codes = fp8.lc_codes.copy()
    codes[13, :5] = 0x7F  # NaN codes read as 0
    rows = Fp8Rows(codes, lsc, fp8.rc_codes, fp8.rc_scale)
    tq = cache["int4"]
    assert isinstance(tq, TqRows)
    rad = tq.lc_radius.copy()
    rad[[10, 11]] = [np.inf, np.nan]
    tq_rows = TqRows(tq.lc_codes, rad, tq.rc_codes, tq.rc_radius, tq.codec, KV, ROPE)
    sel = np.array([[5, 10, 11, 12, 13, 40, 119], [10, 11, 12, 13, 60, 61, 119]])
    sel[0, -1] = 118  # query 0 sits at row 118
    rng = np.random.default_rng(5)
    qa, qr = queries(rng, 2, HEADS, KV, 0.5), queries(rng, 2, HEADS, ROPE, 0.5)
    for blocks in ([rows], [tq_rows]):
        got = sparse_absorbed_attention_device(runner, qa, qr, blocks, sel, SCALE, split_rows=16)
        assert np.isfinite(got).all()
        assert rel_err(got, sparse_absorbed_attention(qa, qr, blocks, sel, SCALE).astype(np.float64)) < CUDA_RTOL


def test_long_causal_batches_are_chunked(runner: EmulatorRunner, cache: dict[str, LatentRows],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.cuda.sparse as cuda_sparse

    monkeypatch.setattr(cuda_sparse, "QUERY_CHUNK", 3)
    rng = np.random.default_rng(6)
    sel = random_selection(rng, 7, T, 20)
    qa, qr = queries(rng, 7, HEADS, KV, 0.5), queries(rng, 7, HEADS, ROPE, 0.5)
    runner.launches.clear()
    got = sparse_absorbed_attention_device(runner, qa, qr, [cache["int4"]], sel, SCALE)
    assert [e for e, _, _ in runner.launches].count("mla_reduce") == 3  # 3 + 3 + 1 queries
    assert rel_err(got, sparse_absorbed_attention(qa, qr, [cache["int4"]], sel, SCALE).astype(np.float64)) < CUDA_RTOL


def test_bad_selections_and_rows_raise_format_error(runner: EmulatorRunner, cache: dict[str, LatentRows]) -> None:
    rng = np.random.default_rng(7)
    qa, qr = queries(rng, 2, HEADS, KV), queries(rng, 2, HEADS, ROPE)
    good = random_selection(rng, 2, T, 8)
    bad = {
        "integers": good.astype(np.float32),
        "ascend strictly": good[:, ::-1].copy(),
        "T - S \\+ s": np.array([[0, 1, 119], [0, 1, 119]]),  # query 0 may not see row 119
    }
    repeated = good.copy()
    repeated[0, 3] = repeated[0, 2]
    bad["ascend strictly "] = repeated
    negative = good.copy()
    negative[1, 0] = -1
    bad["lie in"] = negative
    bad["integers "] = good[:1]  # one row of selection for two queries
    for match, sel in bad.items():
        with pytest.raises(FormatError, match=match.strip()):
            sparse_absorbed_attention_device(runner, qa, qr, [cache["fp8"]], sel, SCALE)
    polar = encode(*latent_rows(rng, T, KV, ROPE), TqCodec("polar", 3))
    with pytest.raises(FormatError, match="block 1 is polar4 .*block 0 is polar3"):
        sparse_absorbed_attention_device(runner, qa, qr, [*cut(polar, [60])[:1], *blocks_of(cache["polar4"], [60])[1:]],
                                         good, SCALE)
    f32 = cache["f32"]
    assert isinstance(f32, F32Rows)
    with pytest.raises(FormatError, match="expected float32"):
        sparse_absorbed_attention_device(runner, qa, qr, [F32Rows(f32.lc.astype(np.float16), f32.rc)], good, SCALE)
    with pytest.raises(FormatError, match="disagree"):
        sparse_absorbed_attention_device(runner, qa, qr[:1], [f32], good, SCALE)


@pytest.mark.parametrize("kv_dtype", ["f32", "fp8", "int4", "polar4"])
def test_emulated_cuda_backend_runs_the_tiny_glm_like_the_cpu(tiny_glm_dir: Path, runner: EmulatorRunner,
                                                              kv_dtype: str) -> None:
    from kernels.model import generate, load_model

    model = load_model(tiny_glm_dir)
    prompt = [1, *range(40, 60)]  # 21 tokens: past index_topk 16, so full layers select rows
    backend = CudaBackend(runner=runner)
    runner.launches.clear()
    cuda = generate(model, model.new_cache(kv_dtype, backend), prompt, 4).tokens
    assert any(e.startswith("mla_sparse_simt_") for e, _, _ in runner.launches)
    cpu = generate(model, model.new_cache(kv_dtype, "cpu"), prompt, 4).tokens
    assert cuda == cpu
