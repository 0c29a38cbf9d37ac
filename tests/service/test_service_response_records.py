"""The responses directory (FORMAT.md 7.3): records round-trip durably, ids that are not ours never
name a path, and a damaged record is a CorruptionError (the server's fault), not a missing one."""
from __future__ import annotations

from pathlib import Path

import pytest

from kernels.errors import CorruptionError
from sessionstore.service.wire.response_records import ResponseRecord, ResponseRecords, new_response_id


def _record() -> ResponseRecord:
    return ResponseRecord(id=new_response_id(), model="m", created_at=1, session="chain-x", tokens=5,
                          digest="0" * 64, messages=[{"role": "user", "content": "hi"}],
                          input=[{"id": "msg_1", "type": "message", "role": "user", "status": "completed",
                                  "content": [{"type": "input_text", "text": "hi"}]}],
                          output_text="yo", output_tokens=[1, 2], status="completed", incomplete_reason=None,
                          usage={"input_tokens": 3}, metadata={"k": "v"}, params={"seed": 1})


def test_records_round_trip_and_delete(tmp_path: Path) -> None:
    records = ResponseRecords(tmp_path)
    rec = _record()
    records.write(rec)
    assert records.read(rec.id) == rec
    assert ResponseRecords(tmp_path).read(rec.id) == rec  # another opening (a restarted server) reads it
    assert not list((tmp_path / "responses").glob(".response-*"))  # no temp file left
    assert records.delete(rec.id) and records.read(rec.id) is None and not records.delete(rec.id)


def test_foreign_ids_and_damaged_records(tmp_path: Path) -> None:
    records = ResponseRecords(tmp_path)
    (tmp_path / "secret.json").write_text("{}")
    for bad in ("../secret", "resp_../../secret", "resp_" + "G" * 48, "", "resp_" + "0" * 47):
        assert records.read(bad) is None and not records.delete(bad)
    assert (tmp_path / "secret.json").exists()
    rec = _record()
    records.write(rec)
    path = tmp_path / "responses" / f"{rec.id}.json"
    path.write_text(path.read_text().replace('"tokens": 5', '"tokens": "5"'))
    with pytest.raises(CorruptionError, match="tokens"):
        records.read(rec.id)
    path.write_text("{not json")
    with pytest.raises(CorruptionError):
        records.read(rec.id)
