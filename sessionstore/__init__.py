"""Persistence and the session service: the ``.coli_kv`` file, sessions, the store, migration.

The public surface::

    from sessionstore import open_kv, KVWriter            # the file (read / durable append)
    from sessionstore import SessionStore                 # sessions: create, resume, fork, ...
    from sessionstore import export_session, import_bundle, RemoteStore   # migration
"""
from sessionstore.errors import (
    ColiError,
    CorruptionError,
    FormatError,
    LimitError,
    LockedError,
    ModelMismatchError,
    NotFoundError,
)
from sessionstore.layout import Dims, Header
from sessionstore.migrate import export_session, import_bundle
from sessionstore.reader import KVReader, open_kv
from sessionstore.remote import RemoteStore
from sessionstore.store import SessionStore
from sessionstore.writer import KVWriter

__all__ = [
    "ColiError",
    "CorruptionError",
    "Dims",
    "FormatError",
    "Header",
    "KVReader",
    "KVWriter",
    "LimitError",
    "LockedError",
    "ModelMismatchError",
    "NotFoundError",
    "RemoteStore",
    "SessionStore",
    "export_session",
    "import_bundle",
    "open_kv",
]
