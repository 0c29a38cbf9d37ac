"""How a :class:`~sessionstore.sessions.session.Session` runs: the options chosen when it is created
or opened, carried as one frozen object from the callers (the CLI, the engine, the fleet) through
:class:`~sessionstore.sessions.store.SessionStore` and ``Session.create`` / ``Session.open`` into the
session (python-zstandard's parameter objects), instead of eleven keyword arguments passed down
unchanged. Change one with :func:`dataclasses.replace`."""
from __future__ import annotations

from dataclasses import dataclass

from sessionstore.kvfile import Durability
from sessionstore.sessions.session_home import CommitRunner, IoRunner, IoStarter
from sessionstore.sessions.turn_loop import DecodeDriver

DEFAULT_COMMIT_EVERY = 64
WRITE_BEHIND = True  # default: decoded records (and their sidecar entries) go to the file as they
# are handed over, write-back started: a commit finds the bytes on disk and waits only for the barriers


@dataclass(frozen=True)
class SessionOptions:
    """A session's knobs.

    ``commit_every``: a turn commits every that many tokens (None or 0: at the end of the turn);
    ``backend``: the decoder cache's ("cpu" or "cuda"); ``durability``: the kv writer's fsync steps
    (None: the shared default); ``manifest_fsync``: fsync the manifest's state page at each commit;
    ``verify``: resume recomputes the last position and checks the manifest's logits digest;
    ``write_behind``: the writer writes each record as it is handed over; ``lazy_logits``: defer
    that recompute until a turn samples from those logits (FORMAT.md 5.5); ``commit_runner``: runs
    a turn's commits (a server's engine loop; None: inline); ``decode_driver``: runs a turn's
    sampling loop (None: inline); ``durable_stream``: commit at every generated token;
    ``io_runner``: runs the session's file work (its creation, a resume's opening and mapping; a
    server's I/O threads; None: inline); ``io_start``: starts a new session's file work without
    waiting for it (a server's I/O threads: its kv file, sidecar, manifest and catalogue row are
    made while its first turn's prompt is prefilled and its first token drawn, and its first
    commit waits for them; None, or with ``durable_stream``, whose every token commits: made
    before the session is returned, by ``io_runner``).
    """

    commit_every: int | None = DEFAULT_COMMIT_EVERY
    backend: str = "cpu"
    durability: Durability | None = None
    manifest_fsync: bool = False
    verify: bool = True
    write_behind: bool = WRITE_BEHIND
    lazy_logits: bool = False
    commit_runner: CommitRunner | None = None
    decode_driver: DecodeDriver | None = None
    durable_stream: bool = False
    io_runner: IoRunner | None = None
    io_start: IoStarter | None = None


DEFAULT_SESSION_OPTIONS = SessionOptions()  # what a session runs with when its opener names none


__all__ = ["DEFAULT_COMMIT_EVERY", "DEFAULT_SESSION_OPTIONS", "SessionOptions", "WRITE_BEHIND"]
