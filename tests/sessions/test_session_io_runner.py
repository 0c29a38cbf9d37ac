"""A session's file work goes through its ``io_runner`` (a server's I/O thread), and only that:
creating its files, a resume's lock, mapping and catalogue row run there, while joining (and
leaving) the store's residency stays on the caller's thread, also when a resume fails there."""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kernels.errors import ModelMismatchError
from sessionstore.sessions import SessionOptions, SessionStore
from sessionstore.sessions.manifest import MANIFEST_NAME, read_manifest, write_manifest

T = TypeVar("T")


class ThreadRunner:
    """An io_runner that runs each piece of file work on one other thread, counting them."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="test-io")
        self.ran = 0

    def __call__(self, fn: Callable[[], T]) -> T:
        self.ran += 1
        return self.pool.submit(fn).result()


def _record_threads(store: SessionStore, monkeypatch: pytest.MonkeyPatch, names: list[str]) -> None:
    """Record the thread of every residency change and catalogue row written."""
    for obj, attr in ((store.residency, "register"), (store.residency, "unregister"), (store, "note_session")):
        real: Any = getattr(obj, attr)

        def spy(*args: Any, _real: Any = real, _attr: str = attr, **kw: Any) -> Any:
            names.append(f"{_attr}@{threading.current_thread().name}")
            return _real(*args, **kw)

        monkeypatch.setattr(obj, attr, spy)


def test_create_and_resume_do_their_file_work_by_the_runner_and_join_the_residency_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SessionStore(tmp_path)
    runner = ThreadRunner()
    names: list[str] = []
    _record_threads(store, monkeypatch, names)
    here = threading.current_thread().name
    session = store.create("a", "tiny", options=SessionOptions(io_runner=runner))
    assert session.state == "resident" and runner.ran == 2  # the files installed, then the resume's work
    assert f"register@{here}" in names and all(n.endswith("test-io_0") for n in names if n.startswith("note"))
    session.suspend()
    names.clear()
    session.ensure_resident()
    assert names[0].startswith("note_session@test-io") and names[1] == f"register@{here}", names
    session.close()
    runner.pool.shutdown()


def test_a_resume_that_fails_on_the_runner_leaves_the_residency_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SessionStore(tmp_path)
    store.create("b", "tiny").close()
    path = store.session_dir("b") / MANIFEST_NAME
    manifest = read_manifest(path)
    manifest.model = replace(manifest.model, fingerprint="fp1:" + "0" * 64)  # another model's session
    write_manifest(path, manifest)
    runner = ThreadRunner()
    names: list[str] = []
    _record_threads(store, monkeypatch, names)
    with pytest.raises(ModelMismatchError):
        store.open("b", "tiny", options=SessionOptions(io_runner=runner))
    assert not any(n.startswith(("register", "unregister")) for n in names), names
    assert store.residency.sessions() == []
    runner.pool.shutdown()
