"""The tier record (FORMAT.md 5.10): defaults without a file, round trip, atomic replace, damage
named, and the catalogue reading it (an offloaded stub is listed as offloaded, never missing; a
commit's note keeps the tier columns)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernels.errors import FormatError, LimitError
from sessionstore.sessions import SessionStore
from sessionstore.sessions.catalogue import Catalogue
from sessionstore.sessions.catalogue_schema import CATALOGUE_NAME
from sessionstore.sessions.paths import KV_NAME
from sessionstore.sessions.tier_record import (
    TIER_NAME,
    Offloaded,
    TierChange,
    TierRecord,
    check_retention,
    is_offloaded,
    read_tier,
    write_tier,
)
from tests.support.migrate import make_session

MARK = Offloaded("s3://bucket/fleet", "fleet/bundles/a/g1-x.colibundle", 12345, 7, "2026-01-01T00:00:00.000000Z")


def test_defaults_round_trip_and_change(tmp_path: Path) -> None:
    assert read_tier(tmp_path) == TierRecord()
    rec = TierRecord(3600, True, MARK)
    write_tier(tmp_path, rec)
    assert read_tier(tmp_path) == rec and is_offloaded(tmp_path)
    assert MARK.location == "s3://bucket/fleet/bundles/a/g1-x.colibundle"
    assert [p.name for p in tmp_path.iterdir()] == [TIER_NAME]  # no temp file left
    assert TierChange(True, None).apply(rec) == TierRecord(None, True, MARK)
    assert TierChange(pinned=False).apply(rec) == TierRecord(3600, False, MARK)
    assert not TierChange() and TierChange(pinned=False)
    assert rec.restored() == TierRecord(3600, True, None)


@pytest.mark.parametrize("text, what", [
    ("{", "not valid JSON"),
    ('{"schema": "other"}', "not a tier record"),
    ('{"schema": "coli-session-tier", "version": 9}', "version 9"),
    ('{"schema": "coli-session-tier", "version": 1, "pinned": "yes"}', "pinned"),
    ('{"schema": "coli-session-tier", "version": 1, "retention_seconds": 0}', "retention_seconds"),
    ('{"schema": "coli-session-tier", "version": 1, "offloaded": {"url": "s3://b"}}', "lacks"),
    ('{"schema": "coli-session-tier", "version": 1, "offloaded": {"url": "file:///x", "bundle": "k", '
     '"bytes": 1, "tokens": 1, "at": "t"}}', "s3://"),
])
def test_a_damaged_record_is_refused_naming_the_file(tmp_path: Path, text: str, what: str) -> None:
    (tmp_path / TIER_NAME).write_text(text)
    with pytest.raises(FormatError, match=what) as err:
        read_tier(tmp_path)
    assert TIER_NAME in str(err.value)
    assert not is_offloaded(tmp_path)


def test_a_symlinked_or_huge_record_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("{}")
    os.symlink(tmp_path / "elsewhere", tmp_path / TIER_NAME)
    with pytest.raises(FormatError, match="symlink"):
        read_tier(tmp_path)
    os.unlink(tmp_path / TIER_NAME)
    (tmp_path / TIER_NAME).write_bytes(b" " * (65 << 10))
    with pytest.raises(FormatError, match="larger"):
        read_tier(tmp_path)


def test_check_retention_bounds() -> None:
    assert check_retention(None) is None and check_retention(1) == 1
    for bad in (0, -5, 10**12):
        with pytest.raises(LimitError):
            check_retention(bad)
    for bad in (True, 1.5, "60"):
        with pytest.raises(FormatError):
            check_retention(bad)


def test_the_catalogue_lists_an_offloaded_stub_and_keeps_tier_columns_across_notes(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "root")
    make_session(store, "a", 5)
    make_session(store, "b", 3)
    d = store.session_dir("a")
    write_tier(d, TierRecord(60, True))
    store.catalogue.note_tier("a", TierRecord(60, True))
    store.note_session(store.read_manifest("a"), resident=True)  # a commit's note: the tier columns stay
    row = store.catalogue.get("a")
    assert row is not None and (row.retention_s, row.pinned, row.state) == (60, True, "resident")

    size = os.lstat(d / KV_NAME).st_size
    mark = Offloaded("s3://bucket/p", "p/bundles/a/g1.colibundle", size, 5, "2026-01-01T00:00:00.000000Z")
    with store.catalogue.changing("a"):
        write_tier(d, TierRecord(60, True, mark))
        os.unlink(d / KV_NAME)
    row = store.catalogue.get("a")
    assert row is not None and (row.state, row.bytes, row.location) == ("offloaded", size, mark.location)
    assert store.catalogue.bytes_by_state()["offloaded"] == size

    # the files are the truth: a catalogue rebuilt from them lists the same
    store.catalogue.close()
    os.unlink(tmp_path / "root" / CATALOGUE_NAME)
    again = Catalogue(tmp_path / "root", store.sessions_root)
    assert again.opened == "rebuilt"
    rows = {e.id: e for e in again.entries()}
    assert (rows["a"].state, rows["a"].retention_s, rows["a"].pinned) == ("offloaded", 60, True)
    assert (rows["b"].state, rows["b"].retention_s, rows["b"].pinned) == ("suspended", None, False)
    page = again.page(10)
    assert [e.state for e in page.entries] == ["offloaded", "suspended"]
