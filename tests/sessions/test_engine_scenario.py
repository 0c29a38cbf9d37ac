"""The engine's test scenario, golden bytes: 2 layers, latent 8, rope 4, tokens 11..55.

Expected bytes are built here with ``struct.pack`` field by field and an fp8 encoder written
from the format's rules (exact nearest value, ties to the even code) -- independently of
``sessionstore.kvfile.layout`` and ``kernels.fp8`` -- then compared with what KVWriter puts on disk.
Covers: v1 round trip; v1 loaded for fp8 with the file untouched (bytes and mtime); v2 byte-
identical round trip; v2 refused for f32; self-heal (v1 rewritten as v2 on the first fp8
append); each with and without indexer rows.
"""
from __future__ import annotations

import bisect
import math
import os
import struct
from fractions import Fraction

import numpy as np
import pytest

from kernels.errors import FormatError
from kernels.fp8 import quantize_rows
from kernels.rows import RecordRows
from sessionstore.kvfile.header import Dims
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import sidecar_path
from sessionstore.kvfile.writer import KVWriter
from tests.support.writer import assert_sidecar_sound

TOKENS = list(range(11, 56))  # 45 input tokens
PLAIN = Dims(n_layers=2, kv_lora=8, qk_rope=4, index_head_dim=0, n_index_layers=0, vocab=1000)
INDEXED = Dims(n_layers=2, kv_lora=8, qk_rope=4, index_head_dim=4, n_index_layers=2, vocab=1000)
DIMS_CASES = pytest.mark.parametrize("dims", [PLAIN, INDEXED], ids=["plain", "indexer"])

# --- independent fp8 e4m3 (from the rules in the format notes) ---------------------------------
E4M3 = [((1 + (c & 7) / 8) * 2.0 ** (((c >> 3) & 15) - 7)) if (c >> 3) & 15 else (c & 7) * 2.0 ** -9
        for c in range(0x7F)]  # codes 0x00..0x7E, ascending values


def enc(value: float) -> int:
    if math.isnan(value):
        return 0x00
    sign = 0x80 if math.copysign(1.0, value) < 0 else 0x00
    a = abs(value)
    if a > 448.0:
        return sign | 0x7E
    hi = bisect.bisect_left(E4M3, a)  # first code with value >= a
    if hi == 0 or E4M3[hi] == a:
        return sign | hi
    lo = hi - 1
    d_lo, d_hi = Fraction(a) - Fraction(E4M3[lo]), Fraction(E4M3[hi]) - Fraction(a)
    if d_lo != d_hi:
        return sign | (lo if d_lo < d_hi else hi)
    return sign | (lo if lo % 2 == 0 else hi)  # tie: the even code


def quantize_row(row: np.ndarray) -> tuple[bytes, float]:
    """The engine's per-row rule with f32 arithmetic; returns (codes, scale)."""
    finite = [abs(float(v)) for v in row if not math.isnan(float(v))]
    amax = np.float32(max(finite) if finite else 0.0)
    if not amax > np.float32(1e-35) or amax > np.float32(3.4e38):
        return bytes(len(row)), 1.0
    inv = np.float32(448.0) / amax
    codes = bytes(enc(float(np.float32(np.float32(v) * inv))) for v in row)
    return codes, float(amax / np.float32(448.0))


# --- the scenario's rows ---------------------------------------------------------------------
def scenario_rows(dims: Dims, tokens: list[int]) -> RecordRows:
    k, L = len(tokens), dims.n_layers
    p = np.array(tokens, dtype=np.float64)[:, None, None]
    l = np.arange(L, dtype=np.float64)[None, :, None]

    def rows(n: int, phase: float) -> np.ndarray:
        i = np.arange(n, dtype=np.float64)[None, None, :]
        x = np.sin(p * 0.61 + l * 1.7 + i * 0.29 + phase) * (0.5 + (p % 7)) * 10.0 ** ((p % 5) - 2)
        return x.astype(np.float32)  # [k, L, n] f32

    lc, rc = rows(dims.kv_lora, 0.0), rows(dims.qk_rope, 1.3)
    where = {t: j for j, t in enumerate(tokens)}
    if 20 in where:
        rc[where[20], 1] = 0.0  # a zero row: scale 1, codes 0
    if 21 in where:
        lc[where[21], 0, :4] = [1e-38, -1e-38, 0.0, 1e-40]  # engine vector: below 1e-35
        lc[where[21], 0, 4:] = 0.0
    if 30 in where:
        lc[where[30], 0, 2] = np.nan  # ignored by amax, encodes as 0x00
        lc[where[30], 0, 5] = -0.0
    if 31 in where:
        rc[where[31], 1, 0] = np.inf  # amax > 3.4e38: a zero row
    if 33 in where:
        lc[where[33], 1] = [448.0, -17.0, 19.0, 17.1, 15.5, 14.5, 2.0 ** -10, 1.5 * 2.0 ** -10]
    index = None
    if dims.n_index_layers:
        index = np.cos(p[:, :, :1] * 0.3 + np.arange(dims.n_index_layers * dims.index_head_dim)
                       ).astype(np.float32).reshape(k, dims.n_index_layers, dims.index_head_dim)
    return RecordRows(tokens=np.array(tokens, np.int32), lc=lc, rc=rc, index=index)


def header(magic: bytes, dims: Dims, nrec: int, tag: int) -> bytes:
    return magic + struct.pack("<8i", dims.n_layers, dims.kv_lora, dims.qk_rope,
                               dims.index_head_dim, dims.n_index_layers, dims.vocab, nrec, tag)


def f32s(values) -> bytes:
    return b"".join(struct.pack("<f", float(v)) for v in np.asarray(values).ravel())


def v1_records(dims: Dims, rows: RecordRows) -> bytes:
    out = []
    for j in range(rows.length):
        out.append(struct.pack("<i", int(rows.tokens[j])))
        for layer in range(dims.n_layers):
            out.append(f32s(rows.lc[j, layer]) + f32s(rows.rc[j, layer]))
        if dims.n_index_layers:
            out.append(f32s(rows.index[j]))
    return b"".join(out)


def v2_records(dims: Dims, rows: RecordRows) -> bytes:
    out = []
    for j in range(rows.length):
        out.append(struct.pack("<i", int(rows.tokens[j])))
        for layer in range(dims.n_layers):
            lc_codes, lc_scale = quantize_row(rows.lc[j, layer])
            rc_codes, rc_scale = quantize_row(rows.rc[j, layer])
            out.append(lc_codes + struct.pack("<f", lc_scale) + rc_codes + struct.pack("<f", rc_scale))
        if dims.n_index_layers:
            out.append(f32s(rows.index[j]))
    return b"".join(out)


def v1_file(dims: Dims, rows: RecordRows) -> bytes:
    return header(b"COLIKV1\0", dims, rows.length, 0) + v1_records(dims, rows)


def v2_file(dims: Dims, rows: RecordRows) -> bytes:
    return header(b"COLIKV2\0", dims, rows.length, 1) + v2_records(dims, rows)


def rows_from_reader(reader) -> RecordRows:
    """RecordRows straight from the reader's structured records (v2: raw codes and scales)."""
    layers = reader.records["layers"]
    index = reader.records["index"] if reader.dims.n_index_layers else None
    if reader.version == 1:
        return RecordRows(tokens=reader.tokens, lc=layers["lc"], rc=layers["rc"], index=index)
    return RecordRows(tokens=reader.tokens, lc_codes=layers["lc"], lc_scale=layers["lc_scale"],
                      rc_codes=layers["rc"], rc_scale=layers["rc_scale"], index=index)


def test_independent_encoder_matches_the_engine_vectors():
    assert [enc(v) for v in (17.0, 19.0, 17.1, 15.9, 14.5, 15.5)] == [
        enc(16.0), enc(20.0), enc(18.0), enc(16.0), enc(14.0), enc(16.0)]
    assert enc(2.0 ** -10) == 0x00 and enc(1.5 * 2.0 ** -10) == 0x01
    assert enc(-0.0) == 0x80 and enc(float("nan")) == 0 and enc(-1e9) == 0xFE
    assert E4M3[enc(float.fromhex("0x1.fcp-7"))] == 2.0 ** -6


# --- the scenario ----------------------------------------------------------------------------
@DIMS_CASES
def test_v1_round_trip(tmp_path, dims):
    rows = scenario_rows(dims, TOKENS)
    path = str(tmp_path / ".coli_kv")
    with KVWriter.open(path, dims, kv_dtype="f32") as w:
        w.append(scenario_rows(dims, TOKENS[:1]))
        w.commit()
        w.append(scenario_rows(dims, TOKENS[1:30]))
        w.append(scenario_rows(dims, TOKENS[30:]))
    golden = v1_file(dims, rows)
    assert open(path, "rb").read() == golden
    again = str(tmp_path / "again")
    with open_kv(path, expect=dims, fp8_enabled=False) as reader, \
            KVWriter.open(again, dims, kv_dtype="f32") as w:
        assert reader.tokens.tolist() == TOKENS
        w.append(rows_from_reader(reader))
    assert open(again, "rb").read() == golden


@DIMS_CASES
def test_v1_loaded_for_fp8_leaves_the_file_untouched(tmp_path, dims):
    rows = scenario_rows(dims, TOKENS)
    path = str(tmp_path / ".coli_kv")
    with open(path, "wb") as f:  # written by the engine: no sidecar
        f.write(v1_file(dims, rows))
    stamp = os.stat(path).st_mtime_ns
    with KVWriter.open(path, dims, kv_dtype="fp8") as w:
        assert w.pending_upgrade and w.nrec == len(TOKENS)
    with open_kv(path, expect=dims, fp8_enabled=True) as reader:
        ram = [quantize_rows(np.ascontiguousarray(reader.layer_rows(layer).lc))
               for layer in range(dims.n_layers)]  # what the engine holds in RAM
    for layer, (codes, scales) in enumerate(ram):
        for j in range(len(TOKENS)):
            want_codes, want_scale = quantize_row(rows.lc[j, layer])
            assert codes[j].tobytes() == want_codes and scales[j] == np.float32(want_scale)
    assert open(path, "rb").read() == v1_file(dims, rows)
    assert os.stat(path).st_mtime_ns == stamp
    assert not os.path.exists(sidecar_path(path))


@DIMS_CASES
def test_v2_byte_identical_round_trip(tmp_path, dims):
    f32 = scenario_rows(dims, TOKENS)
    golden = v2_file(dims, f32)
    path = str(tmp_path / ".coli_kv")
    with KVWriter.open(path, dims, kv_dtype="fp8") as w:
        w.append(f32)  # f32 rows go through the row quantizer
    assert open(path, "rb").read() == golden
    again = str(tmp_path / "again")
    with open_kv(path, expect=dims) as reader, KVWriter.open(again, dims) as w:
        for start in range(0, len(TOKENS), 7):  # codes + scales as stored, in pieces
            part = rows_from_reader(reader)
            w.append(RecordRows(**{name: None if value is None else value[start:start + 7]
                                   for name, value in part.__dict__.items()}))
    assert open(again, "rb").read() == golden
    assert_sidecar_sound(again)


@DIMS_CASES
def test_v2_refused_for_f32(tmp_path, dims):
    path = str(tmp_path / ".coli_kv")
    golden = v2_file(dims, scenario_rows(dims, TOKENS))
    with open(path, "wb") as f:
        f.write(golden)
    with pytest.raises(FormatError, match="fp8"):
        KVWriter.open(path, dims, kv_dtype="f32")
    with pytest.raises(FormatError, match="fp8"):
        open_kv(path, expect=dims, fp8_enabled=False)
    assert open(path, "rb").read() == golden


@DIMS_CASES
def test_self_heal_v1_becomes_v2_on_first_fp8_append(tmp_path, dims):
    path = str(tmp_path / ".coli_kv")
    with open(path, "wb") as f:
        f.write(v1_file(dims, scenario_rows(dims, TOKENS)))
    with KVWriter.open(path, dims, kv_dtype="fp8") as w:
        w.append(scenario_rows(dims, [56]))  # the next position's f32 rows
        assert w.version == 2
    assert open(path, "rb").read() == v2_file(dims, scenario_rows(dims, TOKENS + [56]))
    assert_sidecar_sound(path)
    with open_kv(path, expect=dims) as reader:
        assert reader.tokens.tolist() == TOKENS + [56]
        if dims.n_index_layers:  # indexer rows stay f32, bit for bit
            assert np.array_equal(reader.index_rows(1),
                                  scenario_rows(dims, TOKENS + [56]).index[:, 1])
