"""The server's fenced sessions (:mod:`sessionstore.sessions.fence`): a session whose commit failed
with an I/O error is let go of without a commit, listed in ``/healthz`` and counted in the metrics;
its next request reopens it from its last verified commit (the kv file's commit word put back
there first), and the other sessions never notice."""
from __future__ import annotations

import threading

from sessionstore.kvfile import Dims
from sessionstore.log import get_logger
from sessionstore.service.engine.metrics import EngineMetrics
from sessionstore.sessions import Fence, SessionFencedError, SessionStore, reopen_fenced

log = get_logger("service")


class FencedSessions:
    """Fenced sessions by id, until each is reopened."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._fences: dict[str, Fence] = {}
        self._lock = threading.Lock()
        self.metrics = metrics
        metrics.fenced.set_function(lambda: len(self._fences))

    def note(self, fence: Fence) -> None:
        """``fence``'s session was let go of: listed until it is reopened."""
        with self._lock:
            if fence.session_id in self._fences:
                return
            self._fences[fence.session_id] = fence
        self.metrics.fences.inc()
        log.error("service.session_fenced", id=fence.session_id, verified=fence.verified, error=fence.error)

    def listed(self) -> list[dict[str, object]]:
        """The fenced sessions, for ``/healthz`` (FORMAT.md 7.1: id, verified, error, at; never a
        failed tail commit's token ids)."""
        with self._lock:
            return [{k: v for k, v in fence.to_json().items() if k != "pending"} for fence in self._fences.values()]

    def reopen(self, store: SessionStore, session_id: str) -> None:
        """Before ``session_id`` is opened again: when it is fenced, its kv file's commit word is
        put back to the verified count (durably; also when its ``fence.json`` could not be written),
        and it is no longer fenced; a failure there leaves it fenced (SessionFencedError)."""
        with self._lock:
            fence = self._fences.get(session_id)
        if fence is None:
            return
        manifest = store.read_manifest(session_id)
        directory = store.session_dir(session_id)
        try:
            cut = reopen_fenced(directory, directory / manifest.kv_file, Dims(**manifest.dims), manifest.kv_dtype,
                                fence.verified, fence.pending)
        except OSError as exc:
            log.error("service.reopen_failed", id=session_id, error=str(exc))
            raise SessionFencedError(fence) from exc
        with self._lock:
            self._fences.pop(session_id, None)
        log.warning("service.session_reopened", id=session_id, verified=fence.verified, records_cut=cut)


__all__ = ["FencedSessions"]
