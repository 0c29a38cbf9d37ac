"""An import in two steps: ``receive_bundle`` verifies a bundle into a temp directory and installs
nothing; ``ReceivedBundle.install`` renames it into place (refusing a taken id without replace) or
``discard`` removes it. And the exact size of a raw bundle, known before it is written."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from kernels.errors import CorruptionError, FormatError
from sessionstore.migration import export_session
from sessionstore.migration.exporting import PreparedExport
from sessionstore.migration.migrate import receive_bundle
from sessionstore.sessions import SessionStore
from tests.support.migrate import make_session, session_files


def tmp_entries(root: Path) -> list[str]:
    tmp = root / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []


@pytest.mark.parametrize(("n", "chunk"), [(0, 4 << 10), (1, 4 << 10), (500, 4 << 10), (3000, 1 << 20),
                                          (3000, 4 << 20)])
def test_the_raw_bundle_size_is_known_before_writing(tmp_path: Path, n: int, chunk: int) -> None:
    store = SessionStore(tmp_path / "s")
    make_session(store, "a", n)
    with PreparedExport(store, "a", chunk) as export:
        predicted = export.raw_bundle_bytes()
        out = io.BytesIO()
        export.write(out, compression="none")
    assert predicted == len(out.getvalue())


def bundle_of(store: SessionStore, sid: str) -> bytes:
    out = io.BytesIO()
    export_session(store, sid, out, compression="none", chunk_bytes=64 << 10)
    return out.getvalue()


def test_receive_installs_nothing_until_install(tmp_path: Path) -> None:
    a, b = SessionStore(tmp_path / "a"), SessionStore(tmp_path / "b")
    make_session(a, "s", 700)
    received = receive_bundle(b, io.BytesIO(bundle_of(a, "s")))
    assert b.directory.ids() == [] and tmp_entries(b.root) == [received.tmp.name]
    result = received.install("moved")
    assert result.tokens == 700 and b.directory.ids() == ["moved"] and tmp_entries(b.root) == []
    mine, theirs = session_files(a, "s"), session_files(b, "moved")
    assert mine["kv.coli_kv"] == theirs["kv.coli_kv"]


def test_discard_and_a_refused_install_leave_no_temp_dir(tmp_path: Path) -> None:
    a, b = SessionStore(tmp_path / "a"), SessionStore(tmp_path / "b")
    make_session(a, "s", 300)
    make_session(b, "s", 5, seed=3)
    data = bundle_of(a, "s")
    received = receive_bundle(b, io.BytesIO(data), replace=True)
    received.discard()
    assert tmp_entries(b.root) == [] and b.info("s").tokens == 5
    received = receive_bundle(b, io.BytesIO(data), replace=True)
    with pytest.raises(FormatError, match="already exists"):
        received.install()  # taken, no replace
    assert tmp_entries(b.root) == [] and b.info("s").tokens == 5
    assert receive_bundle(b, io.BytesIO(data), replace=True).install(replace=True).tokens == 300


def test_a_bad_chunk_is_refused_before_anything_lands(tmp_path: Path) -> None:
    a, b = SessionStore(tmp_path / "a"), SessionStore(tmp_path / "b")
    make_session(a, "s", 700)
    data = bytearray(bundle_of(a, "s"))
    data[len(data) // 2] ^= 4
    with pytest.raises(CorruptionError, match="checksum"):
        receive_bundle(b, io.BytesIO(bytes(data)))
    assert b.directory.ids() == [] and tmp_entries(b.root) == []
