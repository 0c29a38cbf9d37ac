"""The resume's one pass over the mapping: the writer's checksum check gathers each block's
scales right after hashing it (``require_vouched(gather_scales=True)``), and the rows a session
resumes from carry exactly the scales the reading rules give (inert rows read as 0)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels.errors import CorruptionError
from sessionstore.kvfile import KVWriter, integrity, open_kv, require_vouched
from sessionstore.kvfile import reader as reader_mod
from tests.kvfile.test_layout_fixtures import ENGINE_TOKENS, INDEXER_DIMS, fp8_rows


def _file(tmp_path: Path) -> Path:
    """A v2 file written by our writer (so its sidecar vouches), scales of every unusable kind."""
    rows = fp8_rows(INDEXER_DIMS, ENGINE_TOKENS)
    rows.lc_scale[3, 0] = 0.0
    rows.lc_scale[4, 1] = -2.0
    rows.rc_scale[5, 0] = np.nan
    rows.rc_scale[6, 1] = np.inf
    rows.lc_scale[7, 1] = np.float32(3.4e38)
    rows.rc_scale[44, 0] = np.nan  # the last record
    path = tmp_path / "kv.coli_kv"
    with KVWriter.open(path, INDEXER_DIMS, kv_dtype="fp8", create=True) as writer:
        writer.append(rows)
        writer.commit()
    return path


def _alone(path: Path) -> np.ndarray:
    with open_kv(path) as kv:
        return np.array(kv.sanitized_scales())  # [2, L, n] f32


@pytest.mark.parametrize("block", [1, 4, 7, 64])
def test_scales_gathered_by_the_checksum_pass_equal_the_reading_rule(tmp_path, monkeypatch, block) -> None:
    monkeypatch.setattr(integrity, "GATHER_BLOCK_RECORDS", block)
    path = _file(tmp_path)
    want = _alone(path)
    with open_kv(path) as kv:
        assert require_vouched(kv, kv.nrec, gather_scales=True).checked == kv.nrec
        assert kv.scales_gathered == kv.nrec  # the pass gathered every vouched record
        got = kv.sanitized_scales()
        assert np.array_equal(got, want, equal_nan=False) and not got.flags.writeable
        assert got[0, 0, 3] == 0 and got[1, 0, 5] == 0 and got[1, 0, 44] == 0


@pytest.mark.parametrize("prefix", [0, 1, 13, 45])
def test_a_partial_gather_is_completed_on_first_use(tmp_path, monkeypatch, prefix) -> None:
    monkeypatch.setattr(reader_mod, "SCALE_GATHER_RECORDS", 5)
    path = _file(tmp_path)
    want = _alone(path)
    with open_kv(path) as kv:
        kv.gather_scales(0, prefix)
        kv.gather_scales(prefix + 3, prefix + 9)  # out of order: ignored, copied later in order
        assert np.array_equal(kv.sanitized_scales(), want)
        assert np.array_equal(kv.layer_rows(1, 2, 9).lc_scale, want[0, 1, 2:9])


def test_the_gathering_pass_still_refuses_a_damaged_record(tmp_path) -> None:
    path = _file(tmp_path)
    raw = bytearray(path.read_bytes())
    with open_kv(path) as kv:
        rec = kv.record_bytes
    raw[40 + 20 * rec + 9] ^= 0x10  # a code byte of record 20
    path.write_bytes(bytes(raw))
    with open_kv(path) as kv, pytest.raises(CorruptionError, match="position 20"):
        require_vouched(kv, kv.nrec, gather_scales=True)


def test_a_resumed_writer_hands_over_a_reader_with_its_scales_gathered(tmp_path) -> None:
    path = _file(tmp_path)
    want = _alone(path)
    with KVWriter.open(path, INDEXER_DIMS, kv_dtype="fp8", create=False, vouch=45) as writer:
        reader = writer.take_vouched_reader()
        assert reader is not None and reader.scales_gathered == 45
        blocks = reader.layer_blocks(45)
        for layer in range(INDEXER_DIMS.n_layers):
            assert np.array_equal(blocks[layer][0].lc_scale, want[0, layer])
            assert np.array_equal(blocks[layer][0].rc_scale, want[1, layer])
        reader.close()
