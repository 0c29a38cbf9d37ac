"""A truncate's file work (the commit before it, the manifest's rewrite, the kv file's cut, each
with its fsyncs) runs by the session's ``io_runner`` (a server's I/O thread), so a new turn that
parts from its history's tail holds no other stream on the loop's thread; the cut is durable and
the cache follows it."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sessionstore.sessions import SessionOptions, SessionStore

T = TypeVar("T")


class OtherThread:
    """An io_runner that runs each piece of file work on one other thread."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="io-runner")

    def __call__(self, fn: Callable[[], T]) -> T:
        return self.pool.submit(fn).result()


def test_truncate_syncs_only_on_the_runner_and_the_cut_is_durable(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    runner = OtherThread()
    store = SessionStore(tmp_path)
    session = store.create("t", "tiny", options=SessionOptions(io_runner=runner, manifest_fsync=True))
    session.append_tokens([5, 6, 7, 8, 9, 10], commit=True)
    session.append_tokens([11, 12], commit=False)  # staged, not committed: the truncate commits first
    synced: list[str] = []
    for name in ("fsync", "fdatasync"):
        real: Any = getattr(os, name)

        def spy(fd: int, _real: Any = real) -> None:
            synced.append(threading.current_thread().name)
            _real(fd)

        monkeypatch.setattr(os, name, spy)
    assert session.truncate(4) == 4
    monkeypatch.undo()
    here = threading.current_thread().name  # the loop's thread in a server: it syncs nothing
    assert len(synced) >= 3 and here not in synced, synced
    assert session.history() == [5, 6, 7, 8] and session.cache.length == 4
    assert session.manifest.committed == 4
    session.append_tokens([20, 21], commit=True)  # the writer and the cache go on from the cut together
    session.close()
    again = SessionStore(tmp_path).open("t", "tiny")
    assert again.history() == [5, 6, 7, 8, 20, 21]
    again.close()
    runner.pool.shutdown()
