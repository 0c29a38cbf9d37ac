"""Persistence and the session service, in four rooms that mirror FORMAT.md: ``kvfile`` (the
``.coli_kv`` file, sections 1-4), ``sessions`` (section 5), ``migration`` (section 6) and
``service`` (the HTTP server, section 7). Each room imports only the rooms below it; errors have
one home, :mod:`kernels.errors`. This package's surface imports the three lower rooms on first use
(never ``service``: the web stack is an optional extra).

The public surface::

    from sessionstore import open_kv, KVWriter            # the file (read / durable append)
    from sessionstore import SessionStore                 # sessions: create, resume, fork, ...
    from sessionstore import export_session, import_bundle, RemoteStore   # migration
"""
from typing import TYPE_CHECKING

from kernels.lazy import lazy_members

if TYPE_CHECKING:  # the surface as a type checker sees it; at run time each name is imported on first use
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

# name -> the module that defines it, imported on first use (PEP 562): ``import sessionstore.service.http``
# runs this file first, and a process that needs one room (the API process of ``serve --http``, a CLI
# command over one file) should not import the other three with their compiled kernels and codecs.
_HOMES = {
    **dict.fromkeys(("ColiError", "CorruptionError", "FormatError", "LimitError", "LockedError",
                     "ModelMismatchError", "NotFoundError"), "kernels.errors"),
    **dict.fromkeys(("Dims", "Header", "KVReader", "KVWriter", "open_kv"), "sessionstore.kvfile"),
    **dict.fromkeys(("RemoteStore", "export_session", "import_bundle"), "sessionstore.migration"),
    "SessionStore": "sessionstore.sessions",
}

__getattr__ = lazy_members(__name__, _HOMES)

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
