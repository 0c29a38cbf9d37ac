"""A second process that hashes a share of a file's records while this one hashes the rest.

A resume checks every record it vouches for (FORMAT.md 4.4): for a 32k-token GLM-5.2 session
that is 1.4 GB of xxh3, most of the resume's time. A second process shares it (another core, with
no lock shared with the server's threads; the server's own share is hashed without the GIL:
:func:`~sessionstore.kvfile.sidecar.record_checksums`), and a request's resume hands it the whole
pass that runs beside the turn's first step (:func:`~sessionstore.kvfile.integrity.start_vouching`).
A long-running server starts one helper
(:func:`start_hash_helper`); :func:`sessionstore.kvfile.integrity.require_vouched` then hands it
the tail of every large range and compares its checksums like its own, except in a pass that
gathers the scales too (a v2/v3 resume: every record hashed in one process: :mod:`.integrity`).

The helper is :mod:`.hash_worker` run as its own small program (the standard library and xxhash,
isolated: ``python -I``), spoken to over its stdin and stdout; it imports nothing of ours, so it
starts in tens of milliseconds instead of the second a copy of the server's imports took. It
opens the file by path and hashes only if it is the very file the reader mapped (same device and
inode); any failure of the helper (gone, another file, an error) falls back to hashing that share
here, so no record is ever used unchecked. It ends when its stdin does: when :meth:`HashHelper.close`
closes it, or when this process dies.
"""
from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import IO

import numpy as np

from sessionstore.kvfile.hash_worker import ANSWER, OK
from sessionstore.log import get_logger

log = get_logger("kvfile")

MIN_SHARED_BYTES = 64 << 20  # a range below this is hashed here alone (the hand-over costs ~ms)
HELPER_SHARE = 0.5  # of a range's records, the helper hashes the last this fraction
WORKER = Path(__file__).with_name("hash_worker.py")
CLOSE_TIMEOUT_S = 30.0


class HashHelper:
    """One helper process; :meth:`submit` hashes a range there, :meth:`close` ends it.

    Requests may come from several threads: each is written under a lock with its future queued in
    the same order, and one reader thread settles the futures as the answers come (in request order)."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
        self._lock = threading.Lock()
        self._waiting: collections.deque[Future[bytes | None]] = collections.deque()
        self._broken = False
        self._reader = threading.Thread(target=self._read_answers, name="coli-hash-answers", daemon=True)
        self._reader.start()

    def submit(self, path: str, identity: tuple[int, int], offset: int, record_bytes: int,
               start: int, stop: int) -> Callable[[], np.ndarray | None]:
        """Start hashing [start, stop) in the helper; returns the call that waits for the
        checksums [k] <u8, or None when the helper could not give them (the caller hashes)."""
        request = json.dumps({"path": path, "dev": identity[0], "ino": identity[1], "offset": offset,
                              "record_bytes": record_bytes, "start": start, "stop": stop}).encode() + b"\n"
        future: Future[bytes | None] = Future()
        with self._lock:
            stdin = self._proc.stdin
            if self._broken or stdin is None or stdin.closed:
                return lambda: None
            self._waiting.append(future)
            try:
                stdin.write(request)
                stdin.flush()
            except OSError as exc:  # the helper is gone: every share it holds is hashed by its caller
                self._fail_all()
                log.warning("kv.hash_helper_failed", path=path, error=str(exc))

        def result() -> np.ndarray | None:
            found = future.result()
            return None if found is None else np.frombuffer(found, dtype="<u8")

        return result

    def _read_answers(self) -> None:
        """The reader thread: each answer settles the oldest waiting request."""
        out = self._proc.stdout
        assert out is not None
        while True:
            head = _read_exactly(out, ANSWER.size)
            if head is None:
                break
            status, length = ANSWER.unpack(head)
            payload = _read_exactly(out, length)
            if payload is None:
                break
            with self._lock:
                future = self._waiting.popleft() if self._waiting else None
            if future is None:
                continue
            if status != OK:
                log.warning("kv.hash_helper_failed", error=payload.decode(errors="replace"))
            future.set_result(payload if status == OK else None)
        with self._lock:
            self._fail_all()

    def _fail_all(self) -> None:
        """(Under the lock.) No more requests; every waiting one is its caller's to hash."""
        self._broken = True
        while self._waiting:
            self._waiting.popleft().set_result(None)

    def close(self) -> None:
        with self._lock:
            self._broken = True
            if self._proc.stdin is not None and not self._proc.stdin.closed:
                try:
                    self._proc.stdin.close()
                except OSError:  # its pipe already broken: it is gone
                    pass
        try:
            self._proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=CLOSE_TIMEOUT_S)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _read_exactly(stream: IO[bytes], n: int) -> bytes | None:
    """``n`` bytes of ``stream``, or None if it ends first."""
    chunks, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


_lock = threading.Lock()
_helper: HashHelper | None = None


def start_hash_helper() -> HashHelper:
    """Start this process's helper (once; a long-running server calls it at start)."""
    global _helper
    with _lock:
        if _helper is None:
            _helper = HashHelper()
        return _helper


def stop_hash_helper() -> None:
    global _helper
    with _lock:
        helper, _helper = _helper, None
    if helper is not None:
        helper.close()


def active_hash_helper() -> HashHelper | None:
    return _helper


__all__ = ["HELPER_SHARE", "MIN_SHARED_BYTES", "HashHelper", "active_hash_helper", "start_hash_helper",
           "stop_hash_helper"]
