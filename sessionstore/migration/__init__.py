"""Moving sessions between hosts (FORMAT.md section 6): the streamed bundle, transports (files,
pipes, object stores), the object-store tier with its lease, the inbox watcher.
Imports the sessions and kvfile rooms below it."""
from sessionstore.migration.bundle import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from sessionstore.migration.bundle_io import WritebackFile
from sessionstore.migration.inbox import Inbox
from sessionstore.migration.migrate import MigrateResult, export_session, import_bundle
from sessionstore.migration.remote import LEASE_TTL_S, RemoteStore
from sessionstore.migration.transport import describe, fsync_directory, is_url, open_sink, open_source

__all__ = [
    "DEFAULT_CHUNK_BYTES", "Inbox", "LEASE_TTL_S", "MAX_CHUNK_BYTES", "MIN_CHUNK_BYTES",
    "MigrateResult", "RemoteStore", "WritebackFile", "describe", "export_session", "fsync_directory",
    "import_bundle", "is_url", "open_sink", "open_source",
]
