"""Persistence and the session service, in four rooms that mirror FORMAT.md: ``kvfile`` (the
``.coli_kv`` file, sections 1-4), ``sessions`` (section 5), ``migration`` (section 6) and
``service`` (the HTTP server, section 7). Each room imports only the rooms below it; errors have
one home, :mod:`kernels.errors`. This package imports the three lower rooms, never ``service``
(the web stack is an optional extra).

The public surface::

    from sessionstore import open_kv, KVWriter            # the file (read / durable append)
    from sessionstore import SessionStore                 # sessions: create, resume, fork, ...
    from sessionstore import export_session, import_bundle, RemoteStore   # migration
"""
from kernels.errors import (
    ColiError,
    CorruptionError,
    FormatError,
    LimitError,
    LockedError,
    ModelMismatchError,
    NotFoundError,
)
from sessionstore.kvfile import Dims, Header, KVReader, KVWriter, open_kv
from sessionstore.migration import RemoteStore, export_session, import_bundle
from sessionstore.sessions import SessionStore

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
