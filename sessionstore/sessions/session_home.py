"""What a session needs of the things around it, as Protocols: of its store (:class:`SessionHome`,
a :class:`~sessionstore.sessions.store.SessionStore` is one) and of a server that runs its commits
(:class:`CommitRunner`) and its file work (:class:`IoRunner`, waited for; :class:`IoStarter`, started
and waited for later; a server's engine loop is all three). The
session takes them as arguments; the sessions room never imports the store's users.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kernels.model.sampling import Sampler
from sessionstore.kvfile import Dims
from sessionstore.sessions.manifest import Manifest, ModelRef
from sessionstore.sessions.residency_budget import Residency

T = TypeVar("T")


class SessionHome(Protocol):
    """What a session needs of its store (a :class:`SessionStore` is one): its paths and
    manifest, the creation of its files, forks, and the residency budget it reports to."""

    @property
    def residency(self) -> Residency[Any]: ...  # Residency[Session]
    def session_dir(self, session_id: str) -> Path: ...
    def read_manifest(self, session_id: str) -> Manifest: ...
    def install_empty(self, session_id: str, model_ref: ModelRef, dims: Dims, *, kv_dtype: str = "fp8",
                      sampler: Sampler | None = None, manifest: Manifest | None = None) -> Manifest: ...
    def refuse_taken(self, session_id: str) -> None: ...
    def fork(self, source_id: str, new_id: str, *, at: int | None = None) -> Any: ...
    def note_session(self, manifest: Manifest, *, resident: bool) -> None: ...


class CommitRunner(Protocol):
    """Runs the rest of a turn's commit (:meth:`CommitPath.begin`'s callable), now or beside
    the next batched step; ``overlap``: the turn's loop may run on before it has returned."""

    def __call__(self, commit: Callable[[], object], *, overlap: bool = False) -> None: ...


class IoRunner(Protocol):
    """Runs a session's file work (creating its files, opening and mapping them, writing its
    catalogue row; :func:`~sessionstore.sessions.session_resume.run_io`) and returns ``fn()``'s
    value or raises its error: now, or on a server's I/O thread while the caller waits and its
    engine loop steps the other sessions. ``fn`` touches only the session's own files and objects
    and the store's thread-safe parts (its catalogue, behind the catalogue's lock); never the
    store's residency, which the caller updates on its own thread once ``fn`` has returned."""

    def __call__(self, fn: Callable[[], T]) -> T: ...


class IoStarter(Protocol):
    """Starts a session's file work on a server's I/O thread and returns at once: ``fn()``'s
    future, which the session waits for (by its :class:`IoRunner`) when it needs what ``fn`` made.
    A new session's files are made so (:meth:`Session.create`) while its first turn's prompt is
    prefilled and its first token drawn; the same rules as :class:`IoRunner`'s bind ``fn``."""

    def __call__(self, fn: Callable[[], T]) -> Future[T]: ...


def run_here(fn: Callable[[], T]) -> T:
    """The :class:`IoRunner` of a session with no server around it: ``fn()`` on this thread."""
    return fn()


__all__ = ["CommitRunner", "IoRunner", "IoStarter", "SessionHome", "run_here"]
