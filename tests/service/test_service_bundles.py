"""Bundles over HTTP: a session exported from one server (GET .../bundle, streamed) and imported
into another (PUT .../bundle, verified before install) continues exactly; a corrupt or oversized
upload and one over a live session are refused, the target store unchanged."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from kernels.model.sampling import Sampler
from sessionstore.sessions import reference_turns
from tests.service.serverkit import ServerProc


def test_bundle_moves_a_session_between_servers(tmp_path: Path, text_model_dir: Path,
                                                text_model: tuple[Any, Any]) -> None:
    model, _ = text_model
    a_server = ServerProc(tmp_path / "a", text_model_dir, "--max-bundle-bytes", "1000")
    with a_server as a, ServerProc(tmp_path / "b", text_model_dir) as b:
        name = a.get("/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": [9, 8, 7, 6], "max_tokens": 12, "ignore_eos": True, "session": "mv"}
        first = a.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        with httpx.stream("GET", a.url + "/v1/sessions/mv/bundle", timeout=60) as response:
            assert response.status_code == 200
            bundle = b"".join(response.iter_bytes())
        assert b.get("/v1/sessions/mv").status_code == 404
        assert b.post("/v1/sessions/x/suspend").status_code == 404
        bad = httpx.put(b.url + "/v1/sessions/mv/bundle", content=bundle[:-100], timeout=60)
        assert 400 <= bad.status_code < 500 and bad.json()["error"]["message"]
        assert b.get("/v1/sessions/mv").status_code == 404  # refused before install
        put = httpx.put(b.url + "/v1/sessions/mv/bundle", content=bundle, timeout=60)
        assert put.status_code == 200, put.text
        assert put.json()["tokens"] == 4 + len(first)
        history = b.get("/v1/sessions/mv?history=1").json()["history"]
        more = b.post("/v1/completions", json={**body, "prompt": history, "max_tokens": 6}).json()
        want = reference_turns(model, "fp8", [([9, 8, 7, 6], 12), (None, 6)], Sampler())
        assert first == want[0] and more["choices"][0]["token_ids"] == want[1]
        live = httpx.put(b.url + "/v1/sessions/mv/bundle", content=bundle, timeout=60)  # mv is resident on b now
        assert live.status_code == 409 and live.json()["error"]["code"] == "session_live"
        assert a.get("/v1/sessions/nope/bundle").status_code == 404
        big = httpx.put(a.url + "/v1/sessions/big/bundle", content=b"x" * 1001, timeout=60)
        assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
        chunked = httpx.put(a.url + "/v1/sessions/big/bundle", content=iter([b"x" * 600, b"y" * 600]), timeout=60)
        assert chunked.status_code == 413  # no content-length: counted as it arrives
        assert a.get("/v1/sessions/big").status_code == 404
        assert b.stop() == 0 and a.stop() == 0
