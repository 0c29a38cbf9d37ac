"""Sessions and the store (FORMAT.md section 5): the manifest and its commit state page, the logits
digest, the model fingerprint, a session's life cycle (suspend, resume), its recovery, the store
and its residency budget, snapshots, engine slots.
Imports the kvfile room below it, never migration."""
from kernels.rows import KV_VERSION_OF_DTYPE
from sessionstore.sessions.catalogue import CATALOGUE_NAME, SessionFilesMissingError
from sessionstore.sessions.conversation import CONVERSATION_NAME, check_messages, read_record, remove_record
from sessionstore.sessions.digest import LogitsDigest, logits_hash, make_digest
from sessionstore.sessions.directory import MAX_PAGE, ORDERS, SessionInfo
from sessionstore.sessions.fingerprint import TINY_NAME, fingerprint_tiny, model_fingerprint
from sessionstore.sessions.manifest import (
    MANIFEST_NAME,
    Manifest,
    ModelRef,
    manifest_from_json,
    read_manifest,
    write_manifest,
)
from sessionstore.sessions.output import OutputProcessor, TurnStop
from sessionstore.sessions.paths import KV_NAME, SIDECAR_NAME, check_component, validate_session_id
from sessionstore.sessions.recovery import ResumeCheck, ResumeTarget, check_resume
from sessionstore.sessions.residency import Residency, Resident
from sessionstore.sessions.session import DEFAULT_COMMIT_EVERY, Session, SessionHome
from sessionstore.sessions.slots import export_slot, import_slot
from sessionstore.sessions.snapshot import SessionSnapshot, verify_session_dir
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turns import TurnResult, common_prefix, reference_turns

__all__ = [
    "DEFAULT_COMMIT_EVERY", "KV_NAME", "KV_VERSION_OF_DTYPE", "MANIFEST_NAME", "Manifest",
    "ModelRef", "SIDECAR_NAME", "Session", "SessionInfo", "SessionSnapshot",
    "SessionStore", "TINY_NAME", "TurnResult", "check_component", "export_slot",
    "fingerprint_tiny", "import_slot", "make_digest", "manifest_from_json", "model_fingerprint",
    "read_manifest", "reference_turns", "validate_session_id", "write_manifest",
    # added with the sessions room's restructuring
    "LogitsDigest", "Residency", "Resident", "ResumeCheck", "ResumeTarget", "SessionHome",
    "check_resume", "common_prefix", "logits_hash", "verify_session_dir",
    # the rendered conversation (FORMAT.md 5.8)
    "CONVERSATION_NAME", "check_messages", "read_record", "remove_record",
    # for the CLI: the catalogue's file and listing, a turn's output
    "CATALOGUE_NAME", "MAX_PAGE", "ORDERS", "OutputProcessor", "SessionFilesMissingError", "TurnStop",
]
