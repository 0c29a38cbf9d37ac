"""The ``.coli_kv`` file (FORMAT.md sections 1-4): layout, reading, the single writer and its
commit protocol, the crash-safe upgrade, the checksum sidecar, conversion and verification.
Imports nothing from the rooms above it (sessions, migration)."""
from kernels.fp8 import usable_scales
from kernels.jsonfile import read_json_bounded
from sessionstore.kvfile.check_beside import PendingCheck
from sessionstore.kvfile.convert import ConvertResult, convert_file, parse_version, target_codec
from sessionstore.kvfile.copying import copy_committed, copy_sidecar_prefix
from sessionstore.kvfile.durability import Durability
from sessionstore.kvfile.fsio import (
    Buffer,
    atomic_replace,
    fsync_directory,
    fsync_parent,
    open_regular,
    pwrite_all,
    readable_temp,
    unlink_durably,
    write_all,
)
from sessionstore.kvfile.hash_helper import start_hash_helper, stop_hash_helper
from sessionstore.kvfile.header import HEADER_SIZE, Dims, Header, pack_header, parse_header, record_bytes, validate_dims
from sessionstore.kvfile.headroom import PAGE, default_headroom
from sessionstore.kvfile.integrity import Vouched, require_sound, require_vouched
from sessionstore.kvfile.layout import pack_records, sanitize_scales
from sessionstore.kvfile.lock import WriterLock
from sessionstore.kvfile.mapping import release_later, wait_for_unmaps
from sessionstore.kvfile.reader import KVReader, open_kv
from sessionstore.kvfile.sidecar import (
    ENTRY_SIZE,
    SIDECAR_HEADER_SIZE,
    hash_without_compiled_code,
    load_sidecar,
    record_checksum,
    record_checksums,
    sidecar_bound,
    sidecar_bytes,
    sidecar_path,
    static_hash,
    warm_record_hashing,
    write_sidecar_for,
)
from sessionstore.kvfile.sidecar_check import SidecarReport, check_records
from sessionstore.kvfile.sweep import (
    REPLACED_PREFIX,
    TMP_DIR_PREFIX,
    TRASH_PREFIX,
    Swept,
    current_owner,
    owner_of,
    store_entry_name,
    sweep_beside,
    sweep_store_tmp,
    temp_beside,
)
from sessionstore.kvfile.verify import RecordScan, VerifyReport, scan_records, verify_file
from sessionstore.kvfile.writer import KVWriter

__all__ = [
    "Buffer",
    "ConvertResult",
    "Dims",
    "Durability",
    "ENTRY_SIZE",
    "HEADER_SIZE",
    "Header",
    "KVReader",
    "KVWriter",
    "PAGE",
    "REPLACED_PREFIX",
    "RecordScan",
    "SIDECAR_HEADER_SIZE",
    "SidecarReport",
    "Swept",
    "TMP_DIR_PREFIX",
    "TRASH_PREFIX",
    "VerifyReport",
    "PendingCheck",
    "Vouched",
    "WriterLock",
    "atomic_replace",
    "check_records",
    "convert_file",
    "copy_committed",
    "copy_sidecar_prefix",
    "current_owner",
    "default_headroom",
    "fsync_directory",
    "fsync_parent",
    "load_sidecar",
    "open_kv",
    "open_regular",
    "owner_of",
    "pack_header",
    "pack_records",
    "parse_header",
    "parse_version",
    "pwrite_all",
    "read_json_bounded",
    "readable_temp",
    "record_bytes",
    "record_checksum",
    "record_checksums",
    "release_later",
    "require_sound",
    "require_vouched",
    "sanitize_scales",
    "scan_records",
    "sidecar_bound",
    "sidecar_bytes",
    "sidecar_path",
    "start_hash_helper",
    "static_hash",
    "stop_hash_helper",
    "store_entry_name",
    "sweep_beside",
    "sweep_store_tmp",
    "target_codec",
    "temp_beside",
    "unlink_durably",
    "usable_scales",
    "validate_dims",
    "verify_file",
    "wait_for_unmaps",
    "write_all",
    "warm_record_hashing",
    "hash_without_compiled_code",
    "write_sidecar_for",
]
