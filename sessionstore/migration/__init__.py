"""Moving sessions between hosts (FORMAT.md section 6): the streamed bundle, transports (files,
pipes, object stores), the object-store tier with its lease, the inbox watcher.
Imports the sessions and kvfile rooms below it."""
from sessionstore.migration.bundle_format import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, BundleStats
from sessionstore.migration.bundle_io import WritebackFile
from sessionstore.migration.exporting import MigrateResult, PreparedExport, export_session
from sessionstore.migration.http_transport import HttpOptions, is_http, with_session
from sessionstore.migration.inbox import Inbox
from sessionstore.migration.lease import LEASE_TTL_S, HeldElsewhereError, Lease, default_host_id, held_message
from sessionstore.migration.lease_keeper import LeaseKeeper
from sessionstore.migration.migrate import ReceivedBundle, import_bundle, receive_bundle
from sessionstore.migration.object_records import ObjectRecords
from sessionstore.migration.object_store import ObjectPrefix, RemoteStoreError
from sessionstore.migration.remote import RemoteStore
from sessionstore.migration.shipping import TurnShipper
from sessionstore.migration.transport import describe, is_url, open_sink, open_source, store_errors

__all__ = [
    "BundleStats",
    "DEFAULT_CHUNK_BYTES",
    "HeldElsewhereError",
    "HttpOptions",
    "Inbox",
    "LEASE_TTL_S",
    "Lease",
    "LeaseKeeper",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "MigrateResult",
    "ObjectPrefix",
    "ObjectRecords",
    "PreparedExport",
    "ReceivedBundle",
    "RemoteStore",
    "RemoteStoreError",
    "TurnShipper",
    "WritebackFile",
    "default_host_id",
    "describe",
    "export_session",
    "held_message",
    "receive_bundle",
    "import_bundle",
    "is_http",
    "is_url",
    "open_sink",
    "open_source",
    "store_errors",
    "with_session",
]
