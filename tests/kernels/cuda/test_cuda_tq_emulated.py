"""CUDA attention over v3 rows (TqRows: int4, tag 0x104, and PolarQuant 2..6 bits), run on the CPU
by the emulator (no GPU).

The device path rotates q on the device (mla_rotate.cu; PolarQuant: then into its bit-reversed
storage order), scores unit-scale rotated-domain values with the row factor hoisted (int4: levels,
radius/sqrtf(n); PolarQuant: the angle tree, the radius) and unrotates the context; checked against
the numpy attention over the same TqRows (kernels.attention.tq) within CUDA_RTOL, and against
attention over the decoded rows. The rotation kernel is checked bitwise against kernels.tq.
"""
from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from bench.cuda_batch import batched_decode_device
from kernels.attention import absorbed_attention
from kernels.attention.tq import rotate_queries, unrotate_context
from kernels.cuda import GLM_DIMS, KERNEL_MODULES, KernelDims, compile_all_kernels_to_ptx
from kernels.cuda.attention import absorbed_attention_device, device_rows
from kernels.cuda.emulator import EmulatorRunner, compiler
from kernels.cuda.rotation import from_rotated_domain, rotate_device, to_rotated_domain
from kernels.errors import FormatError
from kernels.rows import F32Rows, TqRows
from kernels.tq import TqCodec, rotate, unrotate
from tests.kernels.attention_cases import CUDA_RTOL, latent_rows, quantize, queries, record_array, rel_err
from tests.support.extras import needs_cuda_extra

needs_emulator = pytest.mark.skipif(compiler() is None, reason="the CUDA emulator needs a C++ compiler (g++)")

KV, ROPE, HEADS = 64, 16, 18  # 18 heads: a partial SIMT group of 8
SCALE = 0.12
INT4 = TqCodec("int4", 4)
POLAR4 = TqCodec("polar", 4)
NEW_ENTRIES = {"mla_simt.cu": ("mla_split_simt_int4", "mla_split_simt_polar", "mla_sparse_simt_f32",
                               "mla_sparse_simt_fp8", "mla_sparse_simt_int4", "mla_sparse_simt_polar"),
               "mla_rotate.cu": ("mla_tq_rotate",)}
CASES = [(1, 1, True, 32, []), (150, 1, True, 32, [40, 41]), (150, 4, True, 16, [100]), (97, 3, False, 32, []),
         (40, 40, True, None, [16, 32])]
CODEC_CASES = [(INT4, *c) for c in CASES] + [
    (TqCodec("polar", bits), *CASES[i]) for bits, i in ((2, 1), (3, 3), (4, 2), (4, 4), (5, 0), (6, 1))
]


def encode(lc: np.ndarray, rc: np.ndarray, codec: TqCodec = INT4) -> TqRows:
    lcode, lrad = codec.encode_rows(lc)
    rcode, rrad = codec.encode_rows(rc)
    return TqRows(lcode, lrad, rcode, rrad, codec, lc.shape[1], rc.shape[1])


def cut(rows: TqRows, cuts: list[int]) -> list[TqRows]:
    edges = [0, *cuts, rows.length]
    return [TqRows(rows.lc_codes[a:b], rows.lc_radius[a:b], rows.rc_codes[a:b], rows.rc_radius[a:b], rows.codec,
                   rows.kv_lora, rows.qk_rope) for a, b in pairwise(edges)]


def decoded(rows: TqRows) -> F32Rows:
    c = rows.codec
    return F32Rows(c.decode_rows(rows.lc_codes, rows.lc_radius, rows.kv_lora),
                   c.decode_rows(rows.rc_codes, rows.rc_radius, rows.qk_rope))


@pytest.fixture(scope="module")
def runner() -> EmulatorRunner:
    return EmulatorRunner(n_sm=2)


@needs_cuda_extra
@pytest.mark.parametrize("dims", [GLM_DIMS, KernelDims(heads=4, kv_lora=64, rope=16)], ids=["glm", "tiny"])
def test_int4_sparse_and_rotate_kernels_compile_with_nvrtc(dims: KernelDims) -> None:
    ptx = compile_all_kernels_to_ptx("compute_90", dims)
    for module, entries in NEW_ENTRIES.items():
        assert set(entries) <= set(KERNEL_MODULES[module])
        for entry in entries:
            assert f".entry {entry}(" in ptx[module], f"{entry} missing from the PTX of {module}"
    assert ".local" not in ptx["mla_rotate.cu"]


@needs_emulator
@pytest.mark.parametrize("width", [2, 8, 16, 64, 512])
def test_rotation_kernel_is_bitwise_the_cpu_rotation(runner: EmulatorRunner, width: int) -> None:
    rng = np.random.default_rng(width)
    x = (rng.standard_normal((3, 5, width)) * rng.uniform(0.01, 50.0, (3, 5, 1))).astype(np.float32)
    dims = KernelDims(5, KV, ROPE)
    assert np.array_equal(rotate_device(runner, dims, x), rotate(x))
    assert np.array_equal(rotate_device(runner, dims, x, inverse=True), unrotate(x))
    for codec in (INT4, POLAR4):  # PolarQuant: into and out of its bit-reversed storage order
        assert np.array_equal(to_rotated_domain(runner, dims, x, codec), rotate_queries(x, codec))
        assert np.array_equal(from_rotated_domain(runner, dims, x, codec), unrotate_context(x, codec))
    with pytest.raises(FormatError, match="power of two"):
        rotate_device(runner, dims, np.zeros((2, 3), np.float32))


@needs_emulator
@pytest.mark.parametrize("codec,length,n_q,causal,split,cuts", CODEC_CASES,
                         ids=[f"{c[0].kv_dtype}-T{c[1]}-S{c[2]}" for c in CODEC_CASES])
def test_v3_rows_match_cpu_over_the_same_rows(runner: EmulatorRunner, codec: TqCodec, length: int, n_q: int,
                                              causal: bool, split: int | None, cuts: list[int]) -> None:
    rng = np.random.default_rng(length * 11 + n_q)
    lc, rc = latent_rows(rng, length, KV, ROPE)
    rows = encode(lc, rc, codec)
    qa, qr = queries(rng, n_q, HEADS, KV, 0.5), queries(rng, n_q, HEADS, ROPE, 0.5)
    runner.launches.clear()
    got = absorbed_attention_device(runner, qa, qr, cut(rows, cuts), SCALE, causal=causal, split_rows=split)
    assert [e for e, _, _ in runner.launches].count(f"mla_split_simt_{codec.kind}") == 1
    assert [e for e, _, _ in runner.launches].count("mla_tq_rotate") == 3  # q_abs, q_rope, then the context
    want = absorbed_attention(qa, qr, [rows], SCALE, causal=causal).astype(np.float64)
    assert got.shape == (n_q, HEADS, KV) and got.dtype == np.float32
    assert rel_err(got, want) < CUDA_RTOL
    over_decoded = absorbed_attention(qa, qr, [decoded(rows)], SCALE, causal=causal).astype(np.float64)
    assert rel_err(got, over_decoded) < CUDA_RTOL
    whole = absorbed_attention_device(runner, qa, qr, [rows], SCALE, causal=causal, split_rows=split)
    assert np.array_equal(got, whole)  # the same bytes on the device however the blocks were cut


@needs_emulator
@pytest.mark.parametrize("codec", [INT4, POLAR4], ids=lambda c: c.kv_dtype)
def test_inert_rows_and_strided_record_views(runner: EmulatorRunner, codec: TqCodec) -> None:
    rng = np.random.default_rng(5)
    lc, rc = latent_rows(rng, 80, KV, ROPE)
    lc[7] = 0.0  # written inert: radius 0
    rows = encode(lc, rc, codec)
    lrad, rrad = rows.lc_radius.copy(), rows.rc_radius.copy()
    lrad[[20, 21, 22, 23]] = [np.nan, -2.0, np.inf, np.float32(3.4e38)]  # read inert
    rrad[[30, 31]] = [np.nan, -1.0]
    recs = record_array(rows.lc_codes, lrad, rows.rc_codes, rrad, 3, 2)  # [T] records, 3 layers
    lay = recs["layers"][:, 2]
    strided = TqRows(lay["lc"], lay["lc_scale"], lay["rc"], lay["rc_scale"], codec, KV, ROPE)
    dev = device_rows(runner, [strided])
    assert isinstance(dev, TqRows) and runner.address(dev.lc_codes) == runner.address(strided.lc_codes)  # in place
    qa, qr = queries(rng, 3, HEADS, KV, 0.5), queries(rng, 3, HEADS, ROPE, 0.5)
    got = absorbed_attention_device(runner, qa, qr, [strided], SCALE, split_rows=32)
    assert np.isfinite(got).all()
    want = absorbed_attention(qa, qr, [TqRows(rows.lc_codes, lrad, rows.rc_codes, rrad, codec, KV, ROPE)], SCALE)
    assert rel_err(got, want.astype(np.float64)) < CUDA_RTOL


@needs_emulator
@pytest.mark.parametrize("codec", [INT4, TqCodec("polar", 3), TqCodec("polar", 6)], ids=lambda c: c.kv_dtype)
def test_batched_decode_at_glm_head_shapes(runner: EmulatorRunner, codec: TqCodec) -> None:
    rng = np.random.default_rng(3)
    caches = [encode(*latent_rows(rng, n, 512, 64), codec) for n in (70, 130)]
    qa, qr = queries(rng, 2, 64, 512, 0.1), queries(rng, 2, 64, 64, 0.1)
    got = batched_decode_device(runner, qa, qr, [caches[0], cut(caches[1], [64])], 0.05, split_rows=64)
    for b in range(2):
        want = absorbed_attention(qa[b : b + 1], qr[b : b + 1], [caches[b]], 0.05)[0].astype(np.float64)
        assert rel_err(got[b], want) < CUDA_RTOL


@needs_emulator
def test_bad_v3_inputs_are_refused(runner: EmulatorRunner) -> None:
    rng = np.random.default_rng(7)
    lc, rc = latent_rows(rng, 20, KV, ROPE)
    rows = encode(lc, rc)
    polar = encode(lc, rc, POLAR4)
    qa, qr = queries(rng, 1, HEADS, KV), queries(rng, 1, HEADS, ROPE)
    with pytest.raises(FormatError, match="kernel='simt' for int4 rows"):
        absorbed_attention_device(runner, qa, qr, [rows], SCALE, kernel="mma")
    with pytest.raises(FormatError, match="kernel='simt' for polar rows"):
        absorbed_attention_device(runner, qa, qr, [polar], SCALE, kernel="mma_fast")
    with pytest.raises(FormatError, match=r"one row kind .*found \['int4', 'polar4'\]"):
        batched_decode_device(runner, np.repeat(qa, 2, 0), np.repeat(qr, 2, 0), [rows, polar], SCALE)
    with pytest.raises(FormatError, match=r"found \['polar3', 'polar4'\]"):
        batched_decode_device(runner, np.repeat(qa, 2, 0), np.repeat(qr, 2, 0),
                              [encode(lc, rc, TqCodec("polar", 3)), polar], SCALE)
    with pytest.raises(FormatError, match="block 1 is polar4"):
        absorbed_attention_device(runner, qa, qr, [*cut(rows, [5])[:1], *cut(polar, [5])[1:]], SCALE)
    with pytest.raises(FormatError, match="cannot be mixed"):
        absorbed_attention_device(runner, qa, qr, [*cut(rows, [5])[:1], quantize(lc[5:], rc[5:]).rows], SCALE)
    with pytest.raises(FormatError, match="one row kind"):
        batched_decode_device(runner, np.repeat(qa, 2, 0), np.repeat(qr, 2, 0), [rows, quantize(lc, rc).rows], SCALE)
    bad = TqRows(rows.lc_codes, rows.lc_radius.astype(np.float64), rows.rc_codes, rows.rc_radius, INT4, KV, ROPE)
    with pytest.raises(FormatError, match="lc_radius: expected float32"):
        absorbed_attention_device(runner, qa, qr, [bad], SCALE)
