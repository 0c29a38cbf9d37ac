"""``serve --http`` with ``--inbox`` beside it: a bundle dropped in the inbox becomes a session
the HTTP API lists and continues exactly."""
from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

from kernels.model.sampling import Sampler
from sessionstore.migration import export_session
from sessionstore.sessions import SessionStore, reference_turns
from tests.service.serverkit import ServerProc


def test_bundle_in_the_inbox_is_served(tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any]) -> None:
    model, _ = text_model
    source = SessionStore(tmp_path / "src")
    with source.create("imp", str(text_model_dir), kv_dtype="fp8") as session:
        session.generate([5, 6, 7], 10)
    sink = io.BytesIO()
    export_session(source, "imp", sink)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    with ServerProc(tmp_path / "root", text_model_dir, "--inbox", str(inbox)) as server:
        staged = inbox / "imp.colibundle.partial"
        staged.write_bytes(sink.getvalue())
        staged.rename(inbox / "imp.colibundle")
        deadline = time.monotonic() + 60
        while server.get("/v1/sessions/imp").status_code != 200:  # poll until the inbox imported it
            assert time.monotonic() < deadline, server.stderr()
        name = server.get("/v1/models").json()["data"][0]["id"]
        history = server.get("/v1/sessions/imp?history=1").json()["history"]
        reply = server.post("/v1/completions", json={"model": name, "prompt": history, "max_tokens": 6,
                                                     "ignore_eos": True, "session": "imp"}).json()
        want = reference_turns(model, "fp8", [([5, 6, 7], 10), (None, 6)], Sampler())
        assert history == [5, 6, 7, *want[0]]
        assert reply["choices"][0]["token_ids"] == want[1]
        assert server.stop() == 0
    assert (inbox / "done" / "imp.colibundle").exists()
