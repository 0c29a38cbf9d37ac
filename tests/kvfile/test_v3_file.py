"""The v3 (COLIKV3) file: writing, reading, the engine's load rules, conversion and fuzzing.

The engine's rules for v3 (FORMAT.md 1.1-1.3): h[7] = (codec << 8) | bits (0x104 rotated int4,
2..6 PolarQuant), row widths powers of two in 2..512, per layer ``Lc codes, f32 radius, Rc codes,
f32 radius``, Ic rows f32. Row sizes are recomputed here from the facts' formula, independently
of the code under test.
"""
from __future__ import annotations

import struct
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.errors import ColiError, FormatError
from kernels.rows import KV_FORMAT_OF_DTYPE, RecordRows, TqRows
from kernels.tq import TqCodec
from sessionstore.kvfile import KVWriter, convert_file, open_kv, verify_file
from sessionstore.kvfile.header import HEADER_SIZE, Dims, Header, pack_header
from sessionstore.kvfile.layout import pack_records
from tests.support.writer import DIMS, DIMS_IX, gen_f32
from tools.cmd_inspect import inspect_file

V3_DTYPES = ("int4", "polar2", "polar3", "polar4", "polar5", "polar6")


def _facts_row_bytes(n: int, kv_dtype: str) -> int:
    """Code bytes of one row, from the facts' formula (not from kernels.tq)."""
    if kv_dtype == "int4":
        return n // 2
    b = int(kv_dtype[-1])
    return ((n // 2) * b + (n // 2 - 1) * max(b - 1, 1) + 7) // 8


def _facts_record_bytes(dims: Dims, kv_dtype: str) -> int:
    per_layer = _facts_row_bytes(dims.kv_lora, kv_dtype) + 4 + _facts_row_bytes(dims.qk_rope, kv_dtype) + 4
    return 4 + dims.n_layers * per_layer + dims.n_index_layers * dims.index_head_dim * 4


def test_glm52_bytes_per_token_match_the_engine() -> None:
    """GLM-5.2 (78 layers, 512, 64), no Ic: int4 23,092 B; polar2..6 9,052 .. 31,516 B per token."""
    glm = Dims(78, 512, 64, 0, 0, 154880)
    expected = {"int4": 23092, "polar2": 9052, "polar3": 14668, "polar4": 20284, "polar5": 25900,
                "polar6": 31516}
    for kv_dtype, size in expected.items():
        version, tag = KV_FORMAT_OF_DTYPE[kv_dtype]
        assert Header(version, glm, 0, tag).record_bytes == size == _facts_record_bytes(glm, kv_dtype)


@pytest.mark.parametrize("kv_dtype", V3_DTYPES)
@pytest.mark.parametrize("dims", [DIMS, DIMS_IX], ids=["plain", "indexer"])
def test_v3_files_follow_the_engines_load_rules(tmp_path: Path, kv_dtype: str, dims: Dims) -> None:
    path = tmp_path / "kv"
    rows = gen_f32(dims, 0, 7)
    with KVWriter.open(path, dims, kv_dtype=kv_dtype) as w:
        w.append(rows)
    data = path.read_bytes()
    magic, *fields = struct.unpack("<8s8i", data[:HEADER_SIZE])
    codec = TqCodec.from_kv_dtype(kv_dtype)
    assert magic == b"COLIKV3\0"
    assert fields[:6] == list(dims.as_tuple()) and fields[6] == 7
    assert fields[7] == ((1 << 8) | 4 if kv_dtype == "int4" else int(kv_dtype[-1]))
    rec = _facts_record_bytes(dims, kv_dtype)
    assert len(data) == HEADER_SIZE + 7 * rec
    # record 3, layer 1: its Lc codes and radius are the codec's encoding of the f32 row
    lw, rw = _facts_row_bytes(dims.kv_lora, kv_dtype), _facts_row_bytes(dims.qk_rope, kv_dtype)
    at = HEADER_SIZE + 3 * rec + 4 + 1 * (lw + 4 + rw + 4)
    codes, radius = codec.encode_rows(rows.lc[3, 1])
    assert data[at:at + lw] == codes.tobytes()
    assert struct.unpack("<f", data[at + lw:at + lw + 4])[0] == radius
    # the radius is the sequential double-precision L2 norm of the original row, as f32
    ss = 0.0
    for x in rows.lc[3, 1].astype(np.float64):
        ss += x * x
    assert np.float32(radius) == np.float32(np.sqrt(ss))
    # Ic rows are f32, untouched
    if dims.n_index_layers:
        ic_at = HEADER_SIZE + 3 * rec + 4 + dims.n_layers * (lw + 4 + rw + 4)
        assert data[ic_at:ic_at + 4 * dims.index_head_dim] == rows.index[3].astype("<f4").tobytes()


@pytest.mark.parametrize("kv_dtype", ["int4", "polar4", "polar2"])
def test_v3_round_trip_through_writer_and_reader(tmp_path: Path, kv_dtype: str) -> None:
    path = tmp_path / "kv"
    rows = gen_f32(DIMS_IX, 0, 9)
    codec = TqCodec.from_kv_dtype(kv_dtype)
    with KVWriter.open(path, DIMS_IX, kv_dtype=kv_dtype) as w:
        w.append(RecordRows(tokens=rows.tokens[:4], lc=rows.lc[:4], rc=rows.rc[:4], index=rows.index[:4]))
        w.commit()
        # code rows already in the file's encoding are stored exactly as given
        lc_codes, lc_r = codec.encode_rows(rows.lc[4:])
        rc_codes, rc_r = codec.encode_rows(rows.rc[4:])
        w.append(RecordRows(tokens=rows.tokens[4:], lc_codes=lc_codes, lc_scale=lc_r, rc_codes=rc_codes,
                            rc_scale=rc_r, index=rows.index[4:], codec=codec))
    version, tag = KV_FORMAT_OF_DTYPE[kv_dtype]
    assert path.read_bytes() == pack_header(Header(version, DIMS_IX, 9, tag)) + \
        pack_records(version, DIMS_IX, rows, tag).tobytes()
    with KVWriter.open(path, DIMS_IX, kv_dtype=kv_dtype) as w:  # reopens as itself
        assert (w.version, w.nrec, w.pending_upgrade) == (3, 9, False)
    with open_kv(path, tq_tag=tag) as r:
        block = r.layer_rows(1)
        assert isinstance(block, TqRows) and block.codec == codec and block.length == 9
        want = codec.decode_rows(codec.encode_rows(rows.lc[:, 1])[0], codec.encode_rows(rows.lc[:, 1])[1])
        assert np.array_equal(codec.decode_rows(np.ascontiguousarray(block.lc_codes), np.asarray(block.lc_radius)),
                              want)
        assert np.array_equal(r.index_rows(0), rows.index[:, 0])
        err = np.linalg.norm(want - rows.lc[:, 1]) / np.linalg.norm(rows.lc[:, 1])
        assert err < 0.5  # a coarse codec, not noise
    assert verify_file(path).sound


def test_v3_reading_rule_makes_rows_with_unusable_radii_inert(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    with KVWriter.open(path, DIMS, kv_dtype="int4") as w:
        w.append(gen_f32(DIMS, 0, 4))
    rec = Header(3, DIMS, 0, 0x104).record_bytes
    data = bytearray(path.read_bytes())
    radius_at = HEADER_SIZE + 2 * rec + 4 + DIMS.kv_lora // 2  # record 2, layer 0, Lc radius
    for bad in (float("nan"), float("inf"), -1.0, 3.4e38, 3.4028e38):
        data[radius_at:radius_at + 4] = struct.pack("<f", bad)
        path.write_bytes(bytes(data))
        with open_kv(path) as r:
            block = r.layer_rows(0)
            assert isinstance(block, TqRows)
            decoded = block.codec.decode_rows(np.ascontiguousarray(block.lc_codes), np.asarray(block.lc_radius))
            assert np.all(decoded[2] == 0) and np.any(decoded[1] != 0)
        info = inspect_file(str(path))
        assert info["layers"][0]["lc_inert_rows"] == 1


@pytest.mark.parametrize("file_dtype,open_as", [("int4", "polar4"), ("polar4", "polar3"), ("int4", "fp8"),
                                                ("polar4", "f32"), ("fp8", "int4"), ("fp8", "polar4")])
def test_a_writer_keeps_the_files_rows(tmp_path: Path, file_dtype: str, open_as: str) -> None:
    """Only a v1 file is upgraded; any other pairing is refused (the engine 'starts over'), the
    file unchanged and the way out named."""
    path = tmp_path / "kv"
    with KVWriter.open(path, DIMS, kv_dtype=file_dtype) as w:
        w.append(gen_f32(DIMS, 0, 3))
    before = path.read_bytes()
    with pytest.raises(FormatError, match="a writer keeps the file's rows; convert it with `coli-kv convert --to v"):
        KVWriter.open(path, DIMS, kv_dtype=open_as)
    assert path.read_bytes() == before


def test_reader_refuses_a_v3_file_of_another_codec(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    with KVWriter.open(path, DIMS, kv_dtype="polar3") as w:
        w.append(gen_f32(DIMS, 0, 2))
    with pytest.raises(FormatError, match="resumes only its own codec"):
        open_kv(path, tq_tag=0x104)
    with open_kv(path, tq_tag=3) as r:
        assert r.nrec == 2


def test_writers_refuse_headers_we_never_write(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    with KVWriter.open(path, DIMS, kv_dtype="fp8") as w:
        w.append(gen_f32(DIMS, 0, 2))
    data = bytearray(path.read_bytes())
    data[36:40] = struct.pack("<i", 0x574D4B31)  # the forked COLIKV2's watermark
    path.write_bytes(bytes(data))
    (tmp_path / "kv.colisum").unlink()
    with open_kv(path) as r:  # read, with the note
        assert r.nrec == 2 and "tag 0x574d4b31" in r.warnings[0]
    with pytest.raises(FormatError, match="refusing to append to a header this implementation never writes"):
        KVWriter.open(path, DIMS, kv_dtype="fp8")
    assert path.read_bytes() == bytes(data)


@pytest.mark.parametrize("src_dtype", ["f32", "fp8", "int4"])
@pytest.mark.parametrize("dst", [("v3", None, None), ("v3", 4, "polar"), ("v3", 2, None), ("v1", None, None),
                                 ("v2", None, None)])
def test_convert_between_every_tier(tmp_path: Path, src_dtype: str, dst: tuple[str, int | None, str | None]) -> None:
    from sessionstore.kvfile.convert import target_codec

    src = tmp_path / "src"
    rows = gen_f32(DIMS_IX, 0, 6)
    with KVWriter.open(src, DIMS_IX, kv_dtype=src_dtype) as w:
        w.append(rows)
    version = int(dst[0][1])
    codec = target_codec(version, dst[1], dst[2])
    result = convert_file(src, tmp_path / "dst", dst[0], codec=codec)
    with open_kv(src) as r:  # what the output must hold: the source rows, decoded, re-encoded
        stored = r.records.copy()
        src_header = r.header
    src_rows = _rows_of(stored, src_header)
    tag = codec.tag if codec is not None else None
    expected = pack_header(Header(version, DIMS_IX, 6, tag)) + pack_records(version, DIMS_IX, src_rows, tag).tobytes()
    assert (tmp_path / "dst").read_bytes() == expected
    assert result.to_kv_dtype == Header(version, DIMS_IX, 0, tag).kv_dtype
    assert verify_file(tmp_path / "dst").sound


def _rows_of(records: np.ndarray, header: Header) -> RecordRows:
    layers = records["layers"]
    index = records["index"]
    if header.version == 1:
        return RecordRows(tokens=records["token"], lc=layers["lc"], rc=layers["rc"], index=index)
    return RecordRows(tokens=records["token"], lc_codes=np.ascontiguousarray(layers["lc"]),
                      lc_scale=np.ascontiguousarray(layers["lc_scale"]), rc_codes=np.ascontiguousarray(layers["rc"]),
                      rc_scale=np.ascontiguousarray(layers["rc_scale"]), index=index, codec=header.codec)


def test_convert_refuses_v3_options_that_name_no_codec(tmp_path: Path) -> None:
    from sessionstore.kvfile.convert import target_codec

    with pytest.raises(FormatError, match="int4 codec has 4 bits"):
        target_codec(3, 3, "int4")
    with pytest.raises(FormatError, match="apply to --to v3 only"):
        target_codec(2, 4, None)
    assert target_codec(3, None, None) == TqCodec("int4", 4)
    assert target_codec(3, 5, None) == TqCodec("polar", 5)
    src = tmp_path / "src"
    with KVWriter.open(src, Dims(2, 12, 4, 0, 0, 100), kv_dtype="f32") as w:  # kv_lora 12: no v3
        w.append(RecordRows(tokens=np.zeros(1, np.int32), lc=np.ones((1, 2, 12), np.float32),
                            rc=np.ones((1, 2, 4), np.float32)))
    with pytest.raises(FormatError, match="power of two"):
        convert_file(src, tmp_path / "dst", "v3")
    assert not (tmp_path / "dst").exists()


# -- fuzz: v3 headers and rows -----------------------------------------------------------------
def _v3_base(kv_dtype: str, indexer: bool, k: int) -> bytes:
    dims = DIMS_IX if indexer else DIMS
    version, tag = KV_FORMAT_OF_DTYPE[kv_dtype]
    return pack_header(Header(3, dims, k, tag)) + pack_records(3, dims, gen_f32(dims, 0, k), tag).tobytes()


V3_BASES = {(d, ix, k): _v3_base(d, ix, k) for d in ("int4", "polar2", "polar4", "polar6")
            for ix in (False, True) for k in (0, 1, 5)}
SLACK = 2 << 20


@st.composite
def mutated_v3_files(draw: st.DrawFn) -> bytes:
    data = bytearray(V3_BASES[draw(st.sampled_from(sorted(V3_BASES)))])
    for _ in range(draw(st.integers(0, 2))):
        offset = draw(st.sampled_from(range(8, HEADER_SIZE, 4)))
        value = draw(st.one_of(st.sampled_from([0, 1, 2, 3, 4, 6, 7, 0x104, 0x204, 8, 16, 512, 1024, -1, 2**31 - 1]),
                               st.integers(-(2**31), 2**31 - 1)))
        data[offset:offset + 4] = struct.pack("<i", value)
    for _ in range(draw(st.integers(0, 12))):  # garbage codes and radii (NaN, Inf, huge, negative)
        at = draw(st.integers(HEADER_SIZE, max(HEADER_SIZE, len(data) - 1)))
        if at < len(data):
            data[at] = draw(st.integers(0, 255))
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    if cut is not None:
        del data[cut:]
    return bytes(data) + draw(st.binary(max_size=32))


def _exercise_v3(path: Path) -> None:
    try:
        with open_kv(path) as kv:
            for layer in range(kv.dims.n_layers):
                block = kv.layer_rows(layer)
                if isinstance(block, TqRows) and block.length:
                    lc = block.codec.decode_rows(np.ascontiguousarray(block.lc_codes), np.asarray(block.lc_radius))
                    rc = block.codec.decode_rows(np.ascontiguousarray(block.rc_codes), np.asarray(block.rc_radius))
                    assert np.all(np.isfinite(lc)) and np.all(np.isfinite(rc))
    except ColiError:
        pass
    for fn in (lambda: verify_file(path), lambda: inspect_file(str(path), all_tokens=True)):
        try:
            fn()
        except ColiError:
            pass


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_v3_files())
def test_fuzzed_v3_files_raise_only_our_errors(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ".coli_kv"
        path.write_bytes(data)
        tracemalloc.start()
        try:
            _exercise_v3(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < len(data) + SLACK
