"""`coli-kv export ... http://HOST:PORT` and `coli-kv import http://HOST:PORT/ID` against real
`coli-kv serve --http` processes: a session made on server A moves to server B and continues
there token-exact; a server's session imports into a local root; every failure (unreachable, 401,
404, 409, 413, a bundle refused by verification, a connection cut mid-stream by killing the
server) is one stderr line naming the URL, a non-zero exit, and nothing installed anywhere."""
from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernels.errors import FormatError
from kernels.model.sampling import Sampler
from sessionstore.migration.http_transport import BundleUrl, with_session
from sessionstore.sessions import SessionStore, reference_turns
from tests.service.serverkit import ServerProc
from tests.support.migrate import make_session, tree_state
from tools.coli_kv import main

pytest.importorskip("uvicorn", reason="the service extra (starlette, uvicorn) runs the servers")
pytest.importorskip("tokenizers", reason="the text extra (tokenizers) reads glm-mini's tokenizer")

KEY = "s3cret-key"
BIG = 40_000  # records of a synthetic f32 session: a bundle of ~19 MB, still moving when cut


def one_error_line(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def spool_entries(root: Path) -> list[str]:
    tmp = root / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []


class Relay:
    """A TCP relay in front of a real server. ``cut_after`` bytes in one direction (``up``: to the
    server), then ``on_cut`` (kills the server) and both sides closed; or ``flip`` the byte
    ``flip`` bytes into the body of the first PUT."""

    def __init__(self, server_url: str, *, up: bool, cut_after: int | None = None,
                 on_cut: Callable[[], Any] | None = None, flip: int | None = None) -> None:
        self.target = ("127.0.0.1", int(server_url.rsplit(":", 1)[1]))
        self.up, self.cut_after, self.on_cut, self.flip = up, cut_after, on_cut, flip
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.moved = 0  # bytes forwarded in the watched direction
        self.cut = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        seen = bytearray()
        try:
            while not self.cut.is_set():
                data = bytearray(src.recv(1 << 16))
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if up != self.up:
                    dst.sendall(data)
                    continue
                if self.flip is not None:
                    start = len(seen)
                    seen += data
                    put = seen.find(b"PUT ")
                    body = seen.find(b"\r\n\r\n", put) + 4 if put >= 0 and b"\r\n\r\n" in seen[put:] else -1
                    if body > 3 and start <= body + self.flip < len(seen):
                        data[body + self.flip - start] ^= 0x40
                        self.flip = None
                if self.cut_after is not None and self.moved + len(data) >= self.cut_after:
                    dst.sendall(data[:self.cut_after - self.moved])
                    self.moved = self.cut_after
                    self._cut()
                    return
                dst.sendall(data)
                self.moved += len(data)
        except OSError:
            return

    def _cut(self) -> None:
        self.cut.set()
        if self.on_cut is not None:
            self.on_cut()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()
        if not self.cut.is_set():
            self._cut()


def test_url_shapes() -> None:
    assert BundleUrl.parse("http://h:1/mv") == BundleUrl("http://h:1", "mv")
    assert BundleUrl.parse("HTTPS://h:1/v1/sessions/mv/bundle") == BundleUrl("https://h:1", "mv")
    assert BundleUrl.parse("https://h/v1/sessions/mv").bundle_url == "https://h/v1/sessions/mv/bundle"
    assert with_session("http://h:1", "mv") == with_session("http://h:1/", "mv") == "http://h:1/mv"
    assert with_session("http://h:1/other", "mv") == "http://h:1/other"
    for bad, why in [("http://h:1", "name one session"), ("http://h:1/a/b", "name one session"),
                     ("http://u:p@h:1/mv", "no credentials"), ("http://h:1/mv?x=1", "no query"),
                     ("http://h:99999/mv", "out of range"), ("http://h:1/..", "invalid session id")]:
        with pytest.raises(FormatError) as info:
            BundleUrl.parse(bad)
        assert str(info.value).startswith(bad) and why in str(info.value)


def test_without_httpx_one_line_names_the_extra(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "httpx", None)  # `import httpx` fails as where it is not installed
    assert main(["import", "--root", str(tmp_path / "r"), "http://127.0.0.1:9/x"]) == 2
    one_error_line(capsys, "need httpx", "coli-sessionstore[http]")
    assert not (tmp_path / "r").exists()


def test_a_session_moves_between_servers_and_continues_token_exact(tmp_path: Path, capsys: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.model import load_model

    with ServerProc(tmp_path / "a", "glm-mini") as a, ServerProc(tmp_path / "b", "glm-mini", "--api-key", KEY) as b:
        body = {"model": "glm-mini", "prompt": [9, 8, 7, 6], "max_tokens": 12, "ignore_eos": True, "session": "mv"}
        first = a.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        assert main(["export", "--root", str(a.root), "mv", b.url]) == 1  # no key
        one_error_line(capsys, f"{b.url}/v1/sessions/mv", "HTTP 401", "--api-key")
        monkeypatch.setenv("COLI_API_KEY", KEY)  # the server's own variable
        assert main(["export", "--root", str(a.root), "mv", b.url, "--json"]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert out[0].startswith(f"exported session mv (15 tokens, fp8) to {b.url}/v1/sessions/mv/bundle")
        assert '"server": {"id": "mv"' in out[-1] and '"state": "suspended"' in out[-1]
        assert spool_entries(b.root) == []
        history = b.get("/v1/sessions/mv?history=1").json()["history"]
        assert history == [9, 8, 7, 6, *first]
        more = b.post("/v1/completions", json={**body, "prompt": history, "max_tokens": 6}).json()
        want = reference_turns(load_model("glm-mini"), "fp8", [([9, 8, 7, 6], 12), (None, 6)], Sampler())
        assert first == want[0] and more["choices"][0]["token_ids"] == want[1]

        assert main(["export", "--root", str(a.root), "mv", b.url]) == 2  # taken: no --replace
        one_error_line(capsys, f"{b.url}/v1/sessions/mv/bundle", "already has session 'mv'", "--replace")
        assert main(["export", "--root", str(a.root), "mv", b.url, "--replace"]) == 4  # resident on b now
        one_error_line(capsys, f"{b.url}/v1/sessions/mv/bundle", "resident on the server", "suspend")
        taken = httpx.put(b.url + "/v1/sessions/mv/bundle?replace=0", content=b"x", headers=b.headers(), timeout=60)
        assert taken.status_code == 409 and taken.json()["error"]["code"] == "session_exists"
        assert b.post("/v1/sessions/mv/suspend").status_code == 200
        assert main(["export", "--root", str(a.root), "mv", b.url, "--replace"]) == 0  # a's 16 tokens again
        assert b.get("/v1/sessions/mv").json()["tokens"] == 16
        capsys.readouterr()

        monkeypatch.delenv("COLI_API_KEY")
        local = tmp_path / "local"
        assert main(["import", "--root", str(local), f"{b.url}/mv", "--api-key", "wrong"]) == 1
        one_error_line(capsys, f"{b.url}/v1/sessions/mv/bundle", "HTTP 401")
        assert not local.exists()  # the store this import would have created is gone again
        assert main(["import", "--root", str(local), f"{b.url}/mv", "--api-key", KEY, "--as", "here"]) == 0
        assert capsys.readouterr().out.startswith(f"imported session here (15 tokens, fp8) from {b.url}/mv")
        store = SessionStore(local)
        assert store.history("here") == b.get("/v1/sessions/mv?history=1").json()["history"]
        assert b.stop() == 0 and a.stop() == 0


def test_refusals_leave_both_sides_unchanged(tmp_path: Path, capsys: Any) -> None:
    local = SessionStore(tmp_path / "local")
    make_session(local, "big", BIG, kv_dtype="f32")
    make_session(local, "other-model", 20)
    before = tree_state(local.root)
    with ServerProc(tmp_path / "a", "tiny", "--max-bundle-bytes", "100000") as a:
        assert main(["export", "--root", str(local.root), "big", a.url]) == 2
        one_error_line(capsys, f"{a.url}/v1/sessions/big/bundle", "HTTP 413 body_too_large")
        assert main(["export", "--root", str(local.root), "other-model", a.url]) == 2
        one_error_line(capsys, f"{a.url}/v1/sessions/other-model/bundle", "HTTP 409 model_mismatch")
        assert main(["import", "--root", str(local.root), f"{a.url}/nope"]) == 2
        one_error_line(capsys, f"{a.url}/v1/sessions/nope/bundle", "HTTP 404 session_not_found")
        tls = a.url.replace("http://", "https://")  # TLS spoken to a plain-HTTP server
        assert main(["import", "--root", str(local.root), f"{tls}/nope"]) == 1
        one_error_line(capsys, f"{tls}/v1/sessions/nope/bundle", "cannot reach the server", "SSL")
        assert main(["import", "--root", str(local.root), f"{a.url}/v1/sessions/-x"]) == 2
        one_error_line(capsys, "-x")
        turn = {"model": "tiny", "prompt": list(range(1, 41)), "max_tokens": 4, "session": "t"}
        assert a.post("/v1/completions", json=turn).status_code == 200
        relay = Relay(a.url, up=True, flip=4000)  # one bit of the kv payload, in transit
        assert main(["import", "--root", str(tmp_path / "t"), f"{a.url}/t"]) == 0
        assert main(["export", "--root", str(tmp_path / "t"), "t", relay.url + "/t2", "--compress", "none"]) == 3
        one_error_line(capsys, f"{relay.url}/v1/sessions/t2/bundle", "HTTP 400 bundle_invalid", "checksum")
        relay.close()
        assert a.get("/v1/sessions/t2").status_code == 404 and spool_entries(a.root) == []
        assert tree_state(local.root) == before
        port = a.url
        assert a.stop() == 0
    assert main(["export", "--root", str(local.root), "big", port]) == 1
    one_error_line(capsys, f"{port}/v1/sessions/big", "cannot reach the server")
    assert main(["import", "--root", str(local.root), f"{port}/big"]) == 1
    one_error_line(capsys, f"{port}/v1/sessions/big/bundle", "cannot reach the server")
    assert tree_state(local.root) == before


def test_a_corrupt_local_session_is_abandoned_mid_upload(tmp_path: Path, capsys: Any) -> None:
    local = SessionStore(tmp_path / "local")
    make_session(local, "big", BIG, kv_dtype="f32")
    kv = local.kv_path("big")
    data = bytearray(kv.read_bytes())
    data[len(data) - 100] ^= 1  # the last record: megabytes are on the wire when export notices
    kv.write_bytes(bytes(data))
    with ServerProc(tmp_path / "b", "tiny") as b:
        assert main(["export", "--root", str(local.root), "big", b.url, "--chunk-mib", "1"]) == 3
        one_error_line(capsys, "refusing to export a corrupt session")
        assert b.get("/v1/sessions/big").status_code == 404 and spool_entries(b.root) == []
        assert b.stop() == 0


def test_a_connection_cut_by_a_killed_server(tmp_path: Path, capsys: Any) -> None:
    local = SessionStore(tmp_path / "local")
    make_session(local, "big", BIG, kv_dtype="f32")
    server = ServerProc(tmp_path / "b", "tiny", "--max-resident", "1")
    with server as b:
        relay = Relay(b.url, up=True, cut_after=2 << 20, on_cut=server.proc.kill)  # type: ignore[union-attr]
        assert main(["export", "--root", str(local.root), "big", relay.url]) == 1
        err = one_error_line(capsys, f"{relay.url}/v1/sessions/big/bundle", "the connection was cut after")
        assert "bytes of the bundle were sent" in err and "the server installs nothing" in err
        relay.close()
    # the killed server's receiving temp directory stays (if it got that far) until a store opens
    # the root, which sweeps it: its owner is dead
    served = SessionStore(tmp_path / "b")
    assert served.directory.ids() == [] and spool_entries(served.root) == []
    make_session(served, "big", BIG, kv_dtype="f32")
    with ServerProc(served.root, "tiny") as b:
        relay = Relay(b.url, up=False, cut_after=3 << 20, on_cut=b.proc.kill)  # type: ignore[union-attr]
        before = tree_state(local.root)
        assert main(["import", "--root", str(local.root), f"{relay.url}/big", "--as", "copy"]) == 1
        err = one_error_line(capsys, f"{relay.url}/v1/sessions/big/bundle", "the connection was cut after")
        assert "bytes of the bundle were received" in err and "nothing was installed" in err
        assert tree_state(local.root) == before
        relay.close()
