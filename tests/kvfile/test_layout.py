"""Header and record layout: golden bytes, size arithmetic, every refusal of the parser."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from kernels.errors import FormatError, LimitError
from kernels.rows import RecordRows
from sessionstore.kvfile import header
from sessionstore.kvfile.header import (
    HEADER_SIZE,
    MAX_LAYERS,
    MAX_RECORD_BYTES,
    MAX_VOCAB,
    MAX_WIDTH,
    Dims,
    Header,
    complete_records,
    pack_header,
    parse_header,
    record_bytes,
)
from sessionstore.kvfile.layout import pack_records, record_dtype, sanitize_scales
from tests.kvfile.test_layout_fixtures import (
    ENGINE_DIMS,
    ENGINE_TOKENS,
    INDEXER_DIMS,
    f32_rows,
    fp8_rows,
    struct_header,
    struct_record,
)

GLM = Dims(n_layers=78, kv_lora=512, qk_rope=64, vocab=154880)


def test_header_golden_bytes_hand_written() -> None:
    # COLIKV2, L=2, 8, 4, no indexer, vocab 1000, nrec 45, tag 1: written out byte by byte
    expected = bytes.fromhex(
        "434f4c494b563200" "02000000" "08000000" "04000000" "00000000" "00000000"
        "e8030000" "2d000000" "01000000")
    assert pack_header(Header(2, ENGINE_DIMS, 45)) == expected
    assert parse_header(expected, HEADER_SIZE + 45 * 44) == Header(2, ENGINE_DIMS, 45, 1)


@pytest.mark.parametrize("version,magic,tag", [(1, b"COLIKV1\0", 0), (2, b"COLIKV2\0", 1)])
@pytest.mark.parametrize("dims", [ENGINE_DIMS, INDEXER_DIMS, GLM])
def test_header_matches_struct_pack(version: int, magic: bytes, tag: int, dims: Dims) -> None:
    expected = struct_header(magic, dims, 7, tag)
    assert pack_header(Header(version, dims, 7)) == expected
    parsed = parse_header(expected, 10**9, "f")
    assert (parsed.version, parsed.dims, parsed.nrec, parsed.tag) == (version, dims, 7, tag)


def test_record_sizes_match_the_engine_formulas() -> None:
    assert record_bytes(1, GLM) == 179_716
    assert record_bytes(2, GLM) == 45_556
    for dims in (ENGINE_DIMS, INDEXER_DIMS, GLM, Dims(3, 16, 8, 32, 3, 10)):
        ix = dims.n_index_layers * dims.index_head_dim * 4
        v1 = 4 + dims.n_layers * (dims.kv_lora + dims.qk_rope) * 4 + ix
        v2 = 4 + dims.n_layers * (dims.kv_lora + dims.qk_rope + 8) + ix
        assert record_bytes(1, dims) == record_dtype(1, dims).itemsize == v1
        assert record_bytes(2, dims) == record_dtype(2, dims).itemsize == v2


@pytest.mark.parametrize("dims", [ENGINE_DIMS, INDEXER_DIMS])
def test_v1_records_golden_bytes(dims: Dims) -> None:
    rows = f32_rows(dims, ENGINE_TOKENS)
    packed = pack_records(1, dims, rows).tobytes()
    expected = b"".join(struct_record(1, rows, p, dims) for p in range(rows.length))
    assert packed == expected


@pytest.mark.parametrize("dims", [ENGINE_DIMS, INDEXER_DIMS])
def test_v2_records_golden_bytes_from_codes(dims: Dims) -> None:
    rows = fp8_rows(dims, ENGINE_TOKENS)
    packed = pack_records(2, dims, rows).tobytes()
    expected = b"".join(struct_record(2, rows, p, dims) for p in range(rows.length))
    assert packed == expected


def test_v2_record_hand_written_bytes() -> None:
    dims = Dims(1, 2, 2, 1, 1, 50)
    rows = RecordRows(tokens=np.array([7], np.int32),
                      lc_codes=np.array([[[0x38, 0xB8]]], np.uint8), lc_scale=np.array([[0.5]], np.float32),
                      rc_codes=np.array([[[0x7E, 0x00]]], np.uint8), rc_scale=np.array([[2.0]], np.float32),
                      index=np.array([[[1.0]]], np.float32))
    expected = bytes.fromhex("07000000" "38b8" "0000003f" "7e00" "00000040" "0000803f")
    assert pack_records(2, dims, rows).tobytes() == expected


def test_v2_from_f32_uses_the_row_quantizer() -> None:
    from kernels.fp8 import quantize_rows

    rows = f32_rows(INDEXER_DIMS, ENGINE_TOKENS, seed=3)
    packed = pack_records(2, INDEXER_DIMS, rows)
    lc_codes, lc_scale = quantize_rows(rows.lc)
    rc_codes, rc_scale = quantize_rows(rows.rc)
    want = RecordRows(tokens=rows.tokens, lc_codes=lc_codes, lc_scale=lc_scale, rc_codes=rc_codes,
                      rc_scale=rc_scale, index=rows.index)
    assert packed.tobytes() == b"".join(
        struct_record(2, want, p, INDEXER_DIMS) for p in range(want.length))


def test_pack_records_rejects_wrong_shapes() -> None:
    rows = f32_rows(ENGINE_DIMS, ENGINE_TOKENS)
    with pytest.raises(FormatError, match="lc has shape"):
        pack_records(1, Dims(3, 8, 4, 0, 0, 1000), rows)
    with pytest.raises(FormatError, match="index is missing"):
        pack_records(1, INDEXER_DIMS, rows)
    with pytest.raises(FormatError, match="indexer rows given"):
        pack_records(1, ENGINE_DIMS, f32_rows(INDEXER_DIMS, ENGINE_TOKENS))


def _header(magic: bytes = b"COLIKV2\0", dims: tuple = (2, 8, 4, 0, 0, 1000), nrec: int = 1,
            tag: int = 1) -> bytes:
    return struct.pack("<8s8i", magic, *dims, nrec, tag)


@pytest.mark.parametrize("size", [0, 1, 7, 8, 20, 39])
def test_short_header_refused(size: int) -> None:
    buf = _header()[:size]
    with pytest.raises(FormatError, match="short header"):
        parse_header(buf, size, "short.kv")


def test_unknown_magic_named_with_offset() -> None:
    with pytest.raises(FormatError, match=r"short\.kv: byte 0: unknown magic b'GGUF"):
        parse_header(_header(magic=b"GGUF\0\0\0\0"), 1000, "short.kv")


def test_colidv41_refused_by_name_even_when_short() -> None:
    with pytest.raises(FormatError, match="COLIDV41.*DeepSeek-V4"):
        parse_header(_header(magic=b"COLIDV41"), 1000)
    with pytest.raises(FormatError, match="COLIDV41"):
        parse_header(b"COLIDV41", 8)


@pytest.mark.parametrize("tag,kv_dtype,row_bytes", [(0x104, "int4", (4, 2)), (2, "polar2", (2, 1)),
                                                    (4, "polar4", (4, 2)), (6, "polar6", (5, 3))])
def test_v3_header_names_its_codec(tag: int, kv_dtype: str, row_bytes: tuple[int, int]) -> None:
    header = parse_header(_header(magic=b"COLIKV3\0", tag=tag), 1000)
    assert header.version == 3 and header.notes == ()
    assert header.codec is not None and header.codec.tag == tag and header.kv_dtype == kv_dtype
    # token + 2 layers of (Lc codes, radius, Rc codes, radius), widths 8 and 4
    assert header.record_bytes == 4 + 2 * (row_bytes[0] + 4 + row_bytes[1] + 4)
    assert pack_header(header) == _header(magic=b"COLIKV3\0", tag=tag)


@pytest.mark.parametrize("tag", [0, 1, 7, 0x103, 0x204, 0x105, -1])
def test_v3_tag_naming_no_codec_refused(tag: int) -> None:
    with pytest.raises(FormatError, match="byte 36: v3 format tag"):
        parse_header(_header(magic=b"COLIKV3\0", tag=tag), 1000, "v3.kv")


@pytest.mark.parametrize("dims,name", [((2, 12, 4, 0, 0, 1000), "kv_lora"), ((2, 8, 6, 0, 0, 1000), "qk_rope"),
                                       ((2, 1024, 4, 0, 0, 1000), "kv_lora"), ((2, 8, 1, 0, 0, 1000), "qk_rope")])
def test_v3_widths_must_be_powers_of_two(dims: tuple[int, ...], name: str) -> None:
    with pytest.raises(FormatError, match=f"{name} = .*power of two in 2..512"):
        parse_header(_header(magic=b"COLIKV3\0", dims=dims, tag=0x104), 1000, "v3.kv")


@pytest.mark.parametrize("tag", [0, 2, 0x574D4B31, -1])
def test_v2_with_any_tag_reads_with_a_note(tag: int) -> None:
    """The engine ignores the tag word of v1/v2 files: such a header reads, with a note."""
    header = parse_header(_header(tag=tag), 10_000, "fork.kv")
    assert (header.version, header.tag) == (2, tag)
    assert len(header.notes) == 1 and f"tag {tag:#x} in a COLIKV2" in header.notes[0]
    assert "forked COLIKV2" in header.notes[0]


@pytest.mark.parametrize("tag", [1, 7, 0x104])
def test_v1_with_any_tag_reads_with_a_note(tag: int) -> None:
    header = parse_header(_header(magic=b"COLIKV1\0", tag=tag), 1000)
    assert header.version == 1 and header.tag == tag
    assert "byte 36: tag" in header.notes[0] and "COLIKV1" in header.notes[0]


def test_canonical_headers_carry_no_notes() -> None:
    assert parse_header(_header(tag=1), 10_000).notes == ()
    assert parse_header(_header(magic=b"COLIKV1\0", tag=0), 10_000).notes == ()


def test_v2_cut_at_any_length_reads_its_complete_records() -> None:
    """A copy cut anywhere reads as the engine reads it: the complete records before the cut,
    including lengths whose data part is a whole multiple of nrec (once refused as 'forked')."""
    dims = (2, 8, 4, 0, 0, 1000)
    rec = record_bytes(2, Dims(*dims))  # 44
    for nrec in (2, 3, 5):
        for size in range(HEADER_SIZE, HEADER_SIZE + nrec * rec + 1):
            header = parse_header(_header(dims=dims, nrec=nrec, tag=1), size, "cut.kv")
            assert header.notes == ()
            assert complete_records(header, size) == min(nrec, (size - HEADER_SIZE) // rec)


@pytest.mark.parametrize("index,name,offset", [(0, "n_layers", 8), (1, "kv_lora", 12),
                                               (2, "qk_rope", 16), (5, "vocab", 28)])
def test_zero_or_negative_dims_refused(index: int, name: str, offset: int) -> None:
    for value in (0, -1, -(2**31)):
        dims = [2, 8, 4, 0, 0, 1000]
        dims[index] = value
        with pytest.raises(FormatError, match=f"byte {offset}: {name} = {value}, expected >= 1"):
            parse_header(_header(dims=tuple(dims)), 1000, "neg.kv")


@pytest.mark.parametrize("index,limit", [(0, MAX_LAYERS), (1, MAX_WIDTH), (2, MAX_WIDTH),
                                         (5, MAX_VOCAB)])
def test_huge_dims_refused_with_limit_error(index: int, limit: int) -> None:
    for value in (limit + 1, 2**31 - 1):
        dims = [2, 8, 4, 0, 0, 1000]
        dims[index] = value
        with pytest.raises(LimitError, match=f"exceeds the limit {limit}"):
            parse_header(_header(dims=tuple(dims)), 1000)


def test_record_size_overflow_refused() -> None:
    # every dim within its own limit, but the product overflows an i32 / the record limit
    dims = (MAX_LAYERS, MAX_WIDTH, MAX_WIDTH, MAX_WIDTH, MAX_LAYERS, 1000)
    with pytest.raises(LimitError, match=f"record size .* exceeds the limit {MAX_RECORD_BYTES}"):
        parse_header(_header(dims=dims), 1000)


def test_indexer_dims_of_which_one_is_zero_read_with_a_note() -> None:
    """The engine loads them (no indexer bytes); we read them with a note and never write them."""
    for dims in ((2, 8, 4, 16, 0, 1000), (2, 8, 4, 0, 1, 1000)):
        header = parse_header(_header(dims=dims), 1000)
        assert "no indexer bytes" in header.notes[0]
        assert header.record_bytes == record_bytes(2, Dims(2, 8, 4, 0, 0, 1000))
        with pytest.raises(FormatError, match="both must be 0"):
            pack_header(header)


def test_indexer_layers_cannot_exceed_layers() -> None:
    with pytest.raises(FormatError, match="n_index_layers = 3 exceeds n_layers = 2"):
        parse_header(_header(dims=(2, 8, 4, 16, 3, 1000)), 1000)


@pytest.mark.parametrize("nrec", [-1, -5, -(2**31)])
def test_negative_nrec_reads_as_zero_records(nrec: int) -> None:
    header = parse_header(_header(nrec=nrec), 1000)
    assert header.nrec == 0 and complete_records(header, 1000) == 0
    assert f"byte 32: nrec = {nrec}" in header.notes[0]


def test_nrec_beyond_file_is_clamped_not_refused() -> None:
    header = parse_header(_header(nrec=2**31 - 1), HEADER_SIZE + 3 * 44 + 10)
    assert header.nrec == 2**31 - 1
    assert complete_records(header, HEADER_SIZE + 3 * 44 + 10) == 3
    assert complete_records(header, HEADER_SIZE) == 0


def test_sanitize_scales_reading_rule() -> None:
    stored = np.array([0.5, 0.0, -1.0, np.nan, np.inf, -np.inf, 3.4e38, 1e-30], np.float32)
    assert sanitize_scales(stored).tolist() == pytest.approx([0.5, 0, 0, 0, 0, 0, 0, 1e-30])
    assert sanitize_scales(stored).dtype == np.float32


def test_struct_sizes_asserted() -> None:
    assert header.HEADER_STRUCT.size == HEADER_SIZE == 40
    assert header.NREC_OFFSET == 32
