"""What a session takes on the store's disk (FORMAT.md 5.9): every regular file of its directory,
read by one scandir; the catalogue's ``bytes`` and the listing show it; the sidecar's bound holds
for what its writer really allocates."""
from __future__ import annotations

import os
from pathlib import Path

from sessionstore.kvfile import KVWriter, sidecar_bound
from sessionstore.sessions import SessionStore
from sessionstore.sessions.disk_usage import session_disk_bytes
from sessionstore.sessions.paths import SIDECAR_NAME
from tests.support.migrate import SMALL_DIMS, make_session, synthetic_rows


def test_every_regular_file_counts_and_a_symlink_or_a_gone_directory_does_not(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    (d / "kv.coli_kv").write_bytes(b"k" * 1000)
    (d / "manifest.json").write_bytes(b"m" * 30)
    (d / "conversation.json").write_bytes(b"c" * 7)
    outside = tmp_path / "big"
    outside.write_bytes(b"o" * 10_000)
    os.symlink(outside, d / "responses.json")  # never part of a session: not followed, not counted
    (d / "sub").mkdir()
    assert session_disk_bytes(d) == 1037
    assert session_disk_bytes(tmp_path / "gone") == 0


def test_the_catalogue_and_the_listing_count_the_whole_directory(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "store")
    make_session(store, "a", 12)
    d = store.session_dir("a")
    whole = sum(f.stat().st_size for f in d.iterdir())
    assert store.catalogue.get("a").bytes == whole > os.path.getsize(store.kv_path("a"))  # type: ignore[union-attr]
    (d / "responses.json").write_bytes(b"r" * 4096)  # a turn's records grow; its commit notes the row
    store.note_session(store.read_manifest("a"), resident=False)
    assert store.catalogue.get("a").bytes == whole + 4096  # type: ignore[union-attr]
    assert store.page(10).entries[0].bytes == whole + 4096 == store.info("a").bytes


def test_the_sidecar_bound_holds_for_what_its_writer_allocates(tmp_path: Path) -> None:
    path = tmp_path / "kv.coli_kv"
    written = 0
    with KVWriter.open(path, SMALL_DIMS, kv_dtype="fp8") as writer:
        for k in (1, 5, 300, 4000, 200):  # the sidecar grows by its headroom as records pass it
            writer.append(synthetic_rows(k, SMALL_DIMS, written, start=written))
            writer.commit()
            written += k
            assert os.path.getsize(tmp_path / SIDECAR_NAME) <= sidecar_bound(written)
    assert sidecar_bound(written) - os.path.getsize(tmp_path / SIDECAR_NAME) < 8 * 4096 + 2 * 4096
