"""The checksum sidecar: golden bytes, write API, and telling corruption from an out-of-date sidecar."""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kernels.errors import CorruptionError, FormatError, LimitError
from sessionstore.kvfile.header import HEADER_SIZE, Header, pack_header, record_bytes
from sessionstore.kvfile.layout import pack_records
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import (
    SidecarWriter,
    load_sidecar,
    record_checksum,
    sidecar_path,
    write_sidecar_for,
)
from sessionstore.kvfile.sidecar_check import check_records
from tests.kvfile.test_layout_fixtures import (
    ENGINE_DIMS,
    ENGINE_TOKENS,
    INDEXER_DIMS,
    fp8_rows,
    write_kv,
)

REC = record_bytes(2, INDEXER_DIMS)


def _engine_file(tmp_path: Path, nrec: int = 45) -> Path:
    return write_kv(tmp_path / ".coli_kv", 2, INDEXER_DIMS, fp8_rows(INDEXER_DIMS, ENGINE_TOKENS),
                    nrec=nrec)


def _ours(tmp_path: Path, nrec: int = 45) -> Path:
    """A file we wrote: committed records covered by a sidecar."""
    path = _engine_file(tmp_path, nrec)
    with open_kv(path) as kv:
        write_sidecar_for(kv)
    return path


def _set_nrec(path: Path, nrec: int) -> None:
    with open(path, "r+b") as f:
        f.seek(32)
        f.write(struct.pack("<i", nrec))


def test_sidecar_golden_bytes(tmp_path: Path) -> None:
    path = _ours(tmp_path, nrec=45)
    data = path.read_bytes()
    kv_header = data[:HEADER_SIZE]
    static = xxhash.xxh3_64_intdigest(kv_header[:32] + kv_header[36:40])
    body = struct.pack("<8sIIQQQ16s", b"COLISUM1", 1, 1, static, REC, 45, b"\0" * 16)
    entries = b"".join(
        struct.pack("<Q", xxhash.xxh3_64_intdigest(data[HEADER_SIZE + p * REC:HEADER_SIZE + (p + 1) * REC],
                                                   seed=p))
        for p in range(45))
    expected = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + entries
    assert Path(sidecar_path(path)).read_bytes() == expected
    assert sidecar_path(path) == str(path) + ".colisum"


def test_record_checksum_is_seeded_by_position() -> None:
    buf = b"x" * 44
    assert record_checksum(buf, 0) != record_checksum(buf, 1)
    assert record_checksum(memoryview(buf), 3) == xxhash.xxh3_64_intdigest(buf, seed=3)


def test_clean_file_checks_ok(tmp_path: Path) -> None:
    path = _ours(tmp_path)
    with open_kv(path) as kv:
        report = check_records(kv, load_sidecar(path))
    assert (report.status, report.sound, report.vouched, report.checked) == ("ok", True, 45, 45)


@pytest.mark.parametrize("position,offset", [(0, 0), (17, 5), (44, REC - 1)])
def test_flipped_bit_in_a_vouched_record_is_corruption(tmp_path: Path, position: int, offset: int) -> None:
    path = _ours(tmp_path)
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + position * REC + offset] ^= 0x10
    path.write_bytes(bytes(data))
    with open_kv(path) as kv:
        report = check_records(kv, load_sidecar(path))
    assert report.status == "corrupt" and not report.sound
    assert report.mismatched_positions == [position]
    assert f"byte {HEADER_SIZE + position * REC}" in report.messages[0]
    assert "CORRUPTION" in report.messages[0]


def test_flipped_bit_in_header_static_field_is_corruption(tmp_path: Path) -> None:
    path = _ours(tmp_path)
    data = bytearray(path.read_bytes())
    data[28] ^= 0x01  # vocab 1000 -> 1001: parses fine, but the sidecar catches it
    path.write_bytes(bytes(data))
    with open_kv(path) as kv:
        report = check_records(kv, load_sidecar(path))
    assert report.status == "corrupt" and not report.sound


def test_engine_appending_after_us_is_not_covered_not_corrupt(tmp_path: Path) -> None:
    path = _ours(tmp_path, nrec=30)  # we committed 30; the engine then committed up to 45
    _set_nrec(path, 45)
    with open_kv(path) as kv:
        report = check_records(kv, load_sidecar(path))
    assert report.sound and report.status == "not_covered"
    assert (report.vouched, report.not_covered) == (30, 15)
    assert "not covered" in report.messages[-1] and "engine" in report.messages[-1]
    assert "CORRUPTION" not in " ".join(report.messages)


def test_engine_truncate_and_rewrite_is_out_of_date(tmp_path: Path) -> None:
    path = _ours(tmp_path, nrec=45)
    # the engine truncated to 40 and wrote 3 new records 40..42 with other tokens (nrec 43)
    other = fp8_rows(INDEXER_DIMS, np.arange(500, 503, dtype=np.int32), seed=9)
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 40 * REC)
        f.write(pack_records(2, INDEXER_DIMS, other).tobytes())
    _set_nrec(path, 43)
    with open_kv(path) as kv:
        report = check_records(kv, load_sidecar(path))
    assert report.sound and report.status == "out_of_date"
    assert report.out_of_date_from == 40
    assert "out of date from record 40" in report.messages[0]


def test_same_count_rewrite_is_conservatively_corrupt(tmp_path: Path) -> None:
    path = _ours(tmp_path, nrec=45)
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 44 * REC + 3] ^= 1  # nrec unchanged: nothing says another writer was here
    path.write_bytes(bytes(data))
    with open_kv(path) as kv:
        assert check_records(kv, load_sidecar(path)).status == "corrupt"


def test_rewritten_as_other_version_is_out_of_date(tmp_path: Path) -> None:
    path = _ours(tmp_path)
    side = Path(sidecar_path(path)).read_bytes()
    write_kv(path, 1, INDEXER_DIMS, fp8_rows(INDEXER_DIMS, ENGINE_TOKENS))  # engine self-heal etc.
    Path(sidecar_path(path)).write_bytes(side)
    with open_kv(path) as kv:
        report = check_records(kv, load_sidecar(path))
    assert report.sound and report.status == "out_of_date" and report.not_covered == 45


def test_damaged_sidecar_header_raises(tmp_path: Path) -> None:
    path = _ours(tmp_path)
    side = Path(sidecar_path(path))
    data = bytearray(side.read_bytes())
    data[33] ^= 1  # count
    side.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="byte 56: sidecar header check"):
        load_sidecar(path)
    side.write_bytes(b"NOTASUM!" + bytes(data[8:]))
    with pytest.raises(CorruptionError, match="magic"):
        load_sidecar(path)
    side.write_bytes(bytes(data[:20]))
    with pytest.raises(CorruptionError, match="20 bytes"):
        load_sidecar(path)


def test_sidecar_symlink_refused(tmp_path: Path) -> None:
    path = _engine_file(tmp_path)
    (tmp_path / "elsewhere").write_bytes(b"")
    Path(sidecar_path(path)).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FormatError, match="symlink"):
        load_sidecar(path)


def test_cut_sidecar_vouches_only_for_entries_present(tmp_path: Path) -> None:
    path = _ours(tmp_path)
    side = Path(sidecar_path(path))
    side.write_bytes(side.read_bytes()[:64 + 8 * 20 + 3])
    sidecar = load_sidecar(path)
    assert sidecar is not None and (sidecar.count, sidecar.available) == (45, 20)
    with open_kv(path) as kv:
        report = check_records(kv, sidecar)
    assert report.sound and report.vouched == 20 and report.not_covered == 25


def test_absent_sidecar_loads_as_none(tmp_path: Path) -> None:
    assert load_sidecar(_engine_file(tmp_path)) is None


def test_writer_stage_set_count_and_reopen(tmp_path: Path) -> None:
    path = _engine_file(tmp_path)
    data = path.read_bytes()
    header = Header(2, INDEXER_DIMS, 0)
    with SidecarWriter(path, header) as w:
        assert w.count == 0
        assert w.stage(0, data[HEADER_SIZE:HEADER_SIZE + 10 * REC]) == 10
        assert w.stage(10, memoryview(data)[HEADER_SIZE + 10 * REC:HEADER_SIZE + 45 * REC]) == 45
        w.fsync()
        with pytest.raises(LimitError, match="gap"):
            w.stage(46, data[HEADER_SIZE:HEADER_SIZE + REC])
        with pytest.raises(FormatError, match="multiple of the record size"):
            w.stage(0, data[HEADER_SIZE:HEADER_SIZE + REC + 1])
        w.set_count(40)
    with SidecarWriter(path, header.with_nrec(45)) as w:  # nrec is not part of the static hash
        assert w.count == 40
        w.stage(40, data[HEADER_SIZE + 40 * REC:HEADER_SIZE + 45 * REC])
    with open_kv(path) as kv:
        report = check_records(kv, load_sidecar(path))
    assert report.status == "ok" and report.vouched == 45


def test_writer_resets_a_sidecar_of_another_header(tmp_path: Path) -> None:
    path = _ours(tmp_path)
    with SidecarWriter(path, Header(2, ENGINE_DIMS, 0)) as w:
        assert w.count == 0
    sidecar = load_sidecar(path)
    assert sidecar is not None and sidecar.count == 0 and sidecar.record_bytes == record_bytes(2, ENGINE_DIMS)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # no temp left


def test_writer_replaces_a_damaged_sidecar(tmp_path: Path) -> None:
    path = _engine_file(tmp_path)
    Path(sidecar_path(path)).write_bytes(b"garbage" * 20)
    with SidecarWriter(path, Header(2, INDEXER_DIMS, 0)) as w:
        assert w.count == 0
    assert load_sidecar(path).count == 0  # type: ignore[union-attr]


def test_static_hash_ignores_only_nrec(tmp_path: Path) -> None:
    a = pack_header(Header(2, INDEXER_DIMS, 1))
    b = pack_header(Header(2, INDEXER_DIMS, 99))
    from sessionstore.kvfile.sidecar import static_hash

    assert static_hash(a) == static_hash(b)
    assert static_hash(a) != static_hash(pack_header(Header(1, INDEXER_DIMS, 1)))


def test_a_crashed_writers_temp_is_recognised_and_removed(tmp_path: Path) -> None:
    path = _ours(tmp_path)
    stale = Path(sidecar_path(path) + ".tmp")
    stale.write_bytes(b"half a sidecar from a killed process")
    with SidecarWriter(path, Header(2, INDEXER_DIMS, 0)) as w:  # the sidecar itself is fine
        assert w.count == 45
    assert not stale.exists()
    assert sorted(os.listdir(tmp_path)) == [".coli_kv", ".coli_kv.colisum"]


def test_empty_sidecar_counts_as_absent_and_is_recreated(tmp_path: Path) -> None:
    path = _engine_file(tmp_path)
    Path(sidecar_path(path)).write_bytes(b"")  # created, then a crash before the header landed
    assert load_sidecar(path) is None
    with SidecarWriter(path, Header(2, INDEXER_DIMS, 0)) as w:
        assert w.count == 0
    sidecar = load_sidecar(path)
    assert sidecar is not None and sidecar.count == 0
    assert sorted(os.listdir(tmp_path)) == [".coli_kv", ".coli_kv.colisum"]
