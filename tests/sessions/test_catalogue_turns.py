"""The catalogue's row of a session follows its turns (FORMAT.md 5.9): a turn's commits inside it
(every ``commit_every`` records, and a durable stream's per-token ones) leave the row to the turn's
last commit, which writes it once, equal to what the files then say."""
from __future__ import annotations

from pathlib import Path

import pytest

from sessionstore.sessions.catalogue import Catalogue
from sessionstore.sessions.catalogue_entry import entry_from_files
from sessionstore.sessions.session_options import SessionOptions
from sessionstore.sessions.store import SessionStore

PROMPT = list(b"rows follow turns")


@pytest.mark.parametrize("durable_stream", [False, True])
def test_a_turn_writes_its_catalogue_row_once_at_its_last_commit(tmp_path: Path, monkeypatch,
                                                                  durable_stream: bool) -> None:
    store = SessionStore(tmp_path)
    options = SessionOptions(commit_every=4, durable_stream=durable_stream)
    s = store.create("c", "tiny", options=options)
    s.generate(PROMPT, 2)
    notes: list[tuple[str, int]] = []
    note = Catalogue.note

    def counting(self: Catalogue, entry) -> None:
        notes.append((entry.id, entry.committed))
        note(self, entry)

    monkeypatch.setattr(Catalogue, "note", counting)
    commits_before = s.commits.committer.commits
    reply = s.generate(None, 18)  # kv commits every 4 records inside the turn, then its last one
    assert reply.commits >= 5 and s.commits.committer.commits - commits_before >= 5
    assert notes == [("c", s.manifest.committed)]  # one row, written by the turn's last commit
    row = store.catalogue.get("c")
    assert row is not None and row.state == "resident" and row.committed == s.manifest.committed
    s.close()
    assert store.catalogue.get("c").same_files(entry_from_files(store.sessions_root, "c"))
