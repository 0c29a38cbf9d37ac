"""The CUDA kernels, run on the CPU by kernels/cuda/emulator.py (runs in CI, no GPU).

The same host code (descriptor packing, split planning, split + reduce launches) and the same
.cu sources as on a GPU; each CUDA thread is a fiber with real barriers and warp collectives,
mma.sync follows the PTX ISA fragment layouts. Checked against the numpy attention:
CUDA_RTOL for "simt" and "mma" (f32-like), CUDA_FAST_RTOL for "mma_fast" (single f16 operands).
What the emulator cannot prove (GPU memory model, real tensor-core rounding, speed) is left to
tests/kernels/test_cuda_attention.py on a device.
"""
from __future__ import annotations

import numpy as np
import pytest

from bench.cuda_batch import batched_decode_device
from kernels.attention import absorbed_attention
from kernels.cuda.attention import absorbed_attention_device, device_rows
from kernels.cuda.emulator import EmulatorRunner, compiler
from kernels.errors import FormatError, ModelMismatchError
from kernels.rows import F32Rows, Fp8Rows
from tests.kernels.attention_cases import (
    CUDA_FAST_RTOL,
    CUDA_RTOL,
    FP8_VS_F32_RTOL,
    latent_rows,
    quantize,
    queries,
    record_array,
    record_view,
    rel_err,
    split_rows,
)

pytestmark = pytest.mark.skipif(compiler() is None, reason="the CUDA emulator needs a C++ compiler (g++)")

KV, ROPE, HEADS = 64, 16, 18  # 18 heads: partial SIMT group, rows g+8 of an mma tile live
SCALE = 0.12
TOL = {"simt": CUDA_RTOL, "mma": CUDA_RTOL, "mma_fast": CUDA_FAST_RTOL}


@pytest.fixture(scope="module")
def runner() -> EmulatorRunner:
    return EmulatorRunner(n_sm=2)


def _cpu(qa: np.ndarray, qr: np.ndarray, blocks, causal: bool = True) -> np.ndarray:
    return absorbed_attention(qa, qr, blocks, SCALE, causal=causal).astype(np.float64)


@pytest.mark.parametrize("kernel", ["simt", "mma", "mma_fast"])
@pytest.mark.parametrize("length,n_q,causal,split", [(1, 1, True, 32), (150, 1, True, 32), (150, 4, True, 64),
                                                     (97, 3, False, 32), (40, 40, True, None)])
def test_fp8_kernels_match_cpu(runner: EmulatorRunner, kernel: str, length: int, n_q: int, causal: bool,
                               split: int | None) -> None:
    rng = np.random.default_rng(length * 7 + n_q)
    lc, rc = latent_rows(rng, length, KV, ROPE)
    fp8 = quantize(lc, rc)
    qa, qr = queries(rng, n_q, HEADS, KV, 0.5), queries(rng, n_q, HEADS, ROPE, 0.5)
    got = absorbed_attention_device(runner, qa, qr, [fp8.rows], SCALE, causal=causal, kernel=kernel,
                                    split_rows=split)
    cpu_fp8 = _cpu(qa, qr, [fp8.rows], causal)
    assert got.shape == (n_q, HEADS, KV)
    assert rel_err(got, cpu_fp8) < TOL[kernel]
    assert rel_err(got, _cpu(qa, qr, [F32Rows(lc, rc)], causal)) < FP8_VS_F32_RTOL  # section 3: CPU f32 vs CUDA fp8


def test_simt_f32_rows_match_cpu_and_split_count_is_exercised(runner: EmulatorRunner) -> None:
    rng = np.random.default_rng(1)
    lc, rc = latent_rows(rng, 130, KV, ROPE)
    qa, qr = queries(rng, 2, HEADS, KV, 0.5), queries(rng, 2, HEADS, ROPE, 0.5)
    runner.launches.clear()
    got = absorbed_attention_device(runner, qa, qr, [F32Rows(lc, rc)], SCALE, kernel="simt", split_rows=16)
    assert runner.launches[0][0] == "mla_split_simt_f32"
    assert runner.launches[0][1][0] == 9  # ceil(130 / 16) splits, merged by the reduce kernel
    assert runner.launches[-1][0] == "mla_reduce"
    assert rel_err(got, _cpu(qa, qr, [F32Rows(lc, rc)])) < CUDA_RTOL


@pytest.mark.parametrize("kernel", ["simt", "mma"])
def test_batched_sessions_of_different_lengths_in_one_launch(runner: EmulatorRunner, kernel: str) -> None:
    rng = np.random.default_rng(2)
    caches, lengths = [], (1, 33, 200, 64, 7)
    for length in lengths:
        caches.append(quantize(*latent_rows(rng, length, KV, ROPE)).rows)
    caches[2] = split_rows(caches[2], [50, 51, 130])  # a session given as several blocks
    qa, qr = queries(rng, len(lengths), HEADS, KV, 0.5), queries(rng, len(lengths), HEADS, ROPE, 0.5)
    runner.launches.clear()
    got = batched_decode_device(runner, qa, qr, caches, SCALE, kernel=kernel, split_rows=32)
    assert [name for name, _, _ in runner.launches if name.startswith("mla_split")] != []
    assert sum(1 for name, _, _ in runner.launches if name.startswith("mla_split")) == 1  # one launch for all
    for b in range(len(lengths)):
        blocks = caches[b] if isinstance(caches[b], list) else [caches[b]]
        assert rel_err(got[b], _cpu(qa[b : b + 1], qr[b : b + 1], blocks)[0]) < TOL[kernel]


def test_glm_head_shapes(runner: EmulatorRunner) -> None:
    rng = np.random.default_rng(3)
    lengths = (70, 130)
    caches = [quantize(*latent_rows(rng, n, 512, 64)).rows for n in lengths]
    qa, qr = queries(rng, 2, 64, 512, 0.1), queries(rng, 2, 64, 64, 0.1)
    for kernel in ("simt", "mma", "mma_fast"):
        got = batched_decode_device(runner, qa, qr, caches, 0.05, kernel=kernel, split_rows=64)
        for b in range(2):
            ref = absorbed_attention(qa[b : b + 1], qr[b : b + 1], [caches[b]], 0.05)[0].astype(np.float64)
            assert rel_err(got[b], ref) < TOL[kernel]


@pytest.mark.parametrize("kernel", ["simt", "mma"])
def test_strided_record_views_are_read_in_place(runner: EmulatorRunner, kernel: str) -> None:
    rng = np.random.default_rng(4)
    fp8 = quantize(*latent_rows(rng, 90, KV, ROPE))
    recs = record_array(fp8.rows.lc_codes, fp8.rows.lc_scale, fp8.rows.rc_codes, fp8.rows.rc_scale, 3, 1)
    strided = record_view(recs, 1)
    dev = device_rows(runner, [strided])
    assert runner.address(dev.lc_codes) == runner.address(strided.lc_codes)  # zero copy
    assert dev.lc_scale.strides == (recs.dtype.itemsize,)
    qa, qr = queries(rng, 2, HEADS, KV, 0.5), queries(rng, 2, HEADS, ROPE, 0.5)
    got = absorbed_attention_device(runner, qa, qr, [strided], SCALE, kernel=kernel, split_rows=32)
    want = absorbed_attention_device(runner, qa, qr, [fp8.rows], SCALE, kernel=kernel, split_rows=32)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("kernel", ["simt", "mma"])
def test_nan_codes_and_inert_scales(runner: EmulatorRunner, kernel: str) -> None:
    rng = np.random.default_rng(5)
    fp8 = quantize(*latent_rows(rng, 80, KV, ROPE))
    codes = fp8.rows.lc_codes.copy()
    codes[3, :7], codes[4, 5], codes[9, :] = 0x7F, 0xFF, 0xFF
    rcodes = fp8.rows.rc_codes.copy()
    rcodes[11, :3] = 0x7F
    lsc, rsc = fp8.rows.lc_scale.copy(), fp8.rows.rc_scale.copy()
    lsc[[20, 21, 22, 23]] = [0.0, -2.0, np.inf, np.nan]
    rsc[[30, 31]] = [np.nan, -0.0]
    rows = Fp8Rows(codes, lsc, rcodes, rsc)
    qa, qr = queries(rng, 3, HEADS, KV, 0.5), queries(rng, 3, HEADS, ROPE, 0.5)
    got = absorbed_attention_device(runner, qa, qr, [rows], SCALE, kernel=kernel, split_rows=32)
    assert np.isfinite(got).all()
    assert rel_err(got, _cpu(qa, qr, [rows])) < TOL[kernel]


def test_heads_not_a_multiple_of_the_cta_group(runner: EmulatorRunner) -> None:
    rng = np.random.default_rng(6)
    fp8 = quantize(*latent_rows(rng, 50, KV, ROPE))
    qa, qr = queries(rng, 1, 20, KV, 0.5), queries(rng, 1, 20, ROPE, 0.5)  # 20 heads: 3 SIMT groups, 1 mma group
    for kernel in ("simt", "mma"):
        got = absorbed_attention_device(runner, qa, qr, [fp8.rows], SCALE, kernel=kernel)
        assert rel_err(got, _cpu(qa, qr, [fp8.rows])) < CUDA_RTOL


def test_simt_handles_widths_that_are_not_multiples_of_a_warp(runner: EmulatorRunner) -> None:
    rng = np.random.default_rng(9)
    fp8 = quantize(*latent_rows(rng, 45, 40, 8))
    qa, qr = queries(rng, 2, 3, 40, 0.5), queries(rng, 2, 3, 8, 0.5)
    got = absorbed_attention_device(runner, qa, qr, [fp8.rows], SCALE, kernel="simt", split_rows=16)
    assert rel_err(got, _cpu(qa, qr, [fp8.rows])) < CUDA_RTOL


def test_long_causal_batches_are_chunked(runner: EmulatorRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.cuda.attention as cuda_attention

    monkeypatch.setattr(cuda_attention, "QUERY_CHUNK", 3)
    rng = np.random.default_rng(8)
    fp8 = quantize(*latent_rows(rng, 60, KV, ROPE))
    qa, qr = queries(rng, 7, HEADS, KV, 0.5), queries(rng, 7, HEADS, ROPE, 0.5)
    runner.launches.clear()
    got = absorbed_attention_device(runner, qa, qr, [fp8.rows], SCALE, kernel="mma", split_rows=32)
    assert sum(1 for name, _, _ in runner.launches if name == "mla_reduce") == 3  # 3 + 3 + 1 queries
    assert rel_err(got, _cpu(qa, qr, [fp8.rows])) < CUDA_RTOL


def test_bad_inputs_raise_our_errors(runner: EmulatorRunner) -> None:
    rng = np.random.default_rng(7)
    lc, rc = latent_rows(rng, 20, KV, ROPE)
    fp8 = quantize(lc, rc)
    qa, qr = queries(rng, 1, HEADS, KV), queries(rng, 1, HEADS, ROPE)
    with pytest.raises(FormatError, match="fp8 rows only"):
        absorbed_attention_device(runner, qa, qr, [F32Rows(lc, rc)], SCALE, kernel="mma")
    with pytest.raises(FormatError, match="f32 or all fp8"):
        absorbed_attention_device(runner, qa, qr, [F32Rows(lc[:5], rc[:5]), *split_rows(fp8.rows, [5])[1:]], SCALE)
    with pytest.raises(FormatError, match="one row kind"):
        batched_decode_device(runner, np.repeat(qa, 2, 0), np.repeat(qr, 2, 0), [F32Rows(lc, rc), fp8.rows], SCALE)
    with pytest.raises(ModelMismatchError):
        absorbed_attention_device(runner, qa[:, :, :8], qr, [fp8.rows], SCALE)
    odd = quantize(*latent_rows(rng, 20, 40, 8))
    with pytest.raises(FormatError, match="kv_lora % 32"):
        absorbed_attention_device(runner, queries(rng, 1, 2, 40), queries(rng, 1, 2, 8), [odd.rows], SCALE,
                                  kernel="mma")
    with pytest.raises(FormatError, match="kernel must be"):
        batched_decode_device(runner, qa, qr, [fp8.rows], SCALE, kernel="warp9")
    with pytest.raises(FormatError, match="causal queries"):
        absorbed_attention_device(runner, np.repeat(qa, 21, 0), np.repeat(qr, 21, 0), [fp8.rows], SCALE)
