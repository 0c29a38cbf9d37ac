"""Bundles streamed through a real server: an upload is imported as it arrives (its temp directory
appears while the body is still coming), a cut one leaves no session and no temp directory, one
over the limit is refused before its body ended, a corrupted chunk is refused with nothing
installed; a download over loopback carries the bundle uncompressed with its exact length, and a
failing export cuts the body short of it; downloads their clients left strand nothing (the server
still serves and stops)."""
from __future__ import annotations

import io
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from sessionstore.migration import export_session, import_bundle
from sessionstore.migration.exporting import PreparedExport
from sessionstore.sessions import SessionStore
from sessionstore.sessions.fingerprint import model_fingerprint
from tests.service.serverkit import ServerProc
from tests.support.migrate import make_session

pytest.importorskip("uvicorn", reason="the service extra (starlette, uvicorn) runs the servers")

RECORDS = 40_000  # f32 records of the synthetic dims: a bundle of ~19 MB
MIB = 1 << 20


def tmp_entries(root: Path) -> list[str]:
    tmp = root / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []


def wait_until(what: str, ok: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.02)


def tiny_bundle(tmp_path: Path, chunk_bytes: int = MIB) -> bytes:
    """A bundle (raw chunks) of a session of the tiny model, ~19 MB."""
    store = SessionStore(tmp_path / "src")
    make_session(store, "mv", RECORDS, kv_dtype="f32", fingerprint=model_fingerprint("tiny"), model_name="tiny")
    out = io.BytesIO()
    export_session(store, "mv", out, compression="none", chunk_bytes=chunk_bytes)
    return out.getvalue()


class ChunkedPut:
    """A PUT of a chunked body written by hand on a raw socket: part of a body, then a cut or a
    wait for the answer (httpx would finish the body first)."""

    def __init__(self, url: str, path: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.sock.sendall(f"PUT {path} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())

    def send(self, data: bytes, piece: int = 256 << 10) -> None:
        for i in range(0, len(data), piece):
            part = data[i:i + piece]
            self.sock.sendall(b"%x\r\n" % len(part) + part + b"\r\n")

    def answer(self) -> tuple[bytes, bytes]:
        """The response's status line + headers, and its body (read to its content-length)."""
        got = b""
        while b"\r\n\r\n" not in got:
            more = self.sock.recv(65536)
            if not more:
                raise AssertionError(f"the server closed without an answer: {got!r}")
            got += more
        head, body = got.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            more = self.sock.recv(65536)
            if not more:
                break
            body += more
        return head, body

    def close(self) -> None:
        self.sock.close()


def test_an_upload_streams_into_its_temp_dir_and_a_cut_leaves_nothing(tmp_path: Path) -> None:
    bundle = tiny_bundle(tmp_path)
    with ServerProc(tmp_path / "b", "tiny") as b:
        put = ChunkedPut(b.url, "/v1/sessions/mv/bundle")
        put.send(bundle[:6 * MIB])
        # written as it arrives, no spool: the kv file appears in the temp directory mid-body (the
        # directory is made first, so wait for the file itself, not just the directory)
        wait_until("the receiver's kv file appears in its temp directory",
                   lambda: any((b.root / "tmp" / e / "kv.coli_kv").is_file() for e in tmp_entries(b.root)))
        assert len(tmp_entries(b.root)) == 1
        put.close()  # the client vanishes mid-body
        wait_until("the cut upload's temp directory is removed", lambda: tmp_entries(b.root) == [])
        assert b.get("/v1/sessions/mv").status_code == 404
        whole = httpx.put(b.url + "/v1/sessions/mv/bundle", content=bundle, timeout=60)  # still serving
        assert whole.status_code == 200, whole.text
        assert whole.json()["committed"] == RECORDS and tmp_entries(b.root) == []
        assert b.stop() == 0


def test_an_upload_over_the_limit_is_refused_while_it_streams(tmp_path: Path) -> None:
    bundle = tiny_bundle(tmp_path)
    limit = 4 * MIB
    with ServerProc(tmp_path / "b", "tiny", "--max-bundle-bytes", str(limit)) as b:
        put = ChunkedPut(b.url, "/v1/sessions/mv/bundle")
        put.send(bundle[:limit + MIB])  # the body is not finished: the answer comes anyway
        head, body = put.answer()
        put.close()
        assert head.startswith(b"HTTP/1.1 413"), head
        assert json.loads(body)["error"]["code"] == "body_too_large"
        wait_until("the refused upload's temp directory is removed", lambda: tmp_entries(b.root) == [])
        assert b.get("/v1/sessions/mv").status_code == 404
        assert b.stop() == 0


def test_a_corrupted_chunk_is_refused_and_nothing_is_installed(tmp_path: Path) -> None:
    bundle = bytearray(tiny_bundle(tmp_path))
    with ServerProc(tmp_path / "b", "tiny") as b:
        bad = bytearray(bundle)
        bad[len(bad) // 2] ^= 0x10  # inside a kv chunk's payload, megabytes into the body
        refused = httpx.put(b.url + "/v1/sessions/mv/bundle", content=bytes(bad), timeout=60)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "bundle_invalid" and "checksum" in error["message"]
        assert b.get("/v1/sessions/mv").status_code == 404 and tmp_entries(b.root) == []
        good = httpx.put(b.url + "/v1/sessions/mv/bundle", content=bytes(bundle), timeout=60)
        assert good.status_code == 200 and good.json()["committed"] == RECORDS
        assert b.stop() == 0


def test_a_loopback_download_is_raw_with_its_exact_length(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "a")
    make_session(store, "mv", 3000, kv_dtype="fp8", fingerprint=model_fingerprint("tiny"), model_name="tiny")
    with PreparedExport(store, "mv") as export:
        expected = export.raw_bundle_bytes()
    with ServerProc(store.root, "tiny") as a:
        got = a.get("/v1/sessions/mv/bundle")
        assert got.status_code == 200
        assert got.headers["x-coli-bundle-compression"] == "none"
        assert int(got.headers["content-length"]) == len(got.content) == expected
        asked = a.get("/v1/sessions/mv/bundle?compress=1")  # a level: compressed where it shrinks
        assert asked.status_code == 200 and "content-length" not in asked.headers
        assert asked.headers["x-coli-bundle-compression"] == "1"
        for n, body in enumerate((got.content, asked.content)):
            result = import_bundle(SessionStore(tmp_path / f"local{n}"), io.BytesIO(body))
            assert result.tokens == 3000
        bogus = a.get("/v1/sessions/mv/bundle?compress=fast")
        assert bogus.status_code == 400 and bogus.json()["error"]["param"] == "compress"
        assert a.stop() == 0


def test_a_failing_export_cuts_the_download_short_of_its_length(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "a")
    make_session(store, "big", RECORDS, kv_dtype="f32", fingerprint=model_fingerprint("tiny"), model_name="tiny")
    kv = store.kv_path("big")
    data = bytearray(kv.read_bytes())
    data[len(data) - 100] ^= 1  # the last record: the response has started when export notices
    kv.write_bytes(bytes(data))
    with ServerProc(store.root, "tiny") as a:
        with httpx.stream("GET", a.url + "/v1/sessions/big/bundle", timeout=60) as response:
            assert response.status_code == 200
            declared = int(response.headers["content-length"])
            with pytest.raises(httpx.RemoteProtocolError):
                for _ in response.iter_raw():
                    pass
            assert response.num_bytes_downloaded < declared
        assert a.get("/healthz").status_code == 200
        assert a.stop() == 0


def test_downloads_their_clients_left_keep_the_server_serving_and_stoppable(tmp_path: Path) -> None:
    """Clients that read the first bytes of a compressed download (the export slower than the
    socket) and leave: the server still serves a whole download and stops on SIGTERM at once."""
    store = SessionStore(tmp_path / "a")
    make_session(store, "big", RECORDS, kv_dtype="f32", fingerprint=model_fingerprint("tiny"), model_name="tiny")
    with ServerProc(store.root, "tiny") as a:
        host, port = a.url.removeprefix("http://").rsplit(":", 1)
        for _ in range(8):
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(f"GET /v1/sessions/big/bundle?compress=19 HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
                time.sleep(0.2)
        whole = a.get("/v1/sessions/big/bundle")
        assert whole.status_code == 200 and len(whole.content) == int(whole.headers["content-length"])
        t0 = time.monotonic()
        assert a.stop() == 0
        assert time.monotonic() - t0 < 30
