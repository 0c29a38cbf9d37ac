"""Sessions and the store (FORMAT.md section 5): the manifest and its commit state page, the logits
digest, the model fingerprint, a session's life cycle (suspend, resume), its recovery, the store
and its residency budget, snapshots, engine slots.
Imports the kvfile room below it, never migration."""
from kernels.rows import KV_VERSION_OF_DTYPE
from sessionstore.sessions.catalogue import SessionFilesMissingError
from sessionstore.sessions.catalogue_entry import CatalogueEntry
from sessionstore.sessions.catalogue_schema import CATALOGUE_NAME
from sessionstore.sessions.commit_state_page import STATE_BYTES, STATE_SLOTS, state_path
from sessionstore.sessions.committer import BarrierCommit, commit_together
from sessionstore.sessions.conversation_file import (
    CONVERSATION_NAME,
    ConversationRecord,
    check_messages,
    read_record,
    remove_record,
    tokens_digest,
    write_record,
)
from sessionstore.sessions.digest import LogitsDigest, logits_hash, make_digest
from sessionstore.sessions.directory import MAX_PAGE, ORDERS, SessionInfo
from sessionstore.sessions.disk_usage import session_disk_bytes
from sessionstore.sessions.durable_text import DURABLE_STREAM, held_until_committed
from sessionstore.sessions.fence import Fence, SessionFencedError, reopen_fenced
from sessionstore.sessions.fingerprint import TINY_NAME, fingerprint_tiny, model_fingerprint
from sessionstore.sessions.manifest import (
    MANIFEST_NAME,
    Manifest,
    ModelRef,
    manifest_from_json,
    read_manifest,
    utc_now,
    write_manifest,
)
from sessionstore.sessions.output import OutputProcessor, TurnEnd, TurnReply, TurnStop
from sessionstore.sessions.paths import (
    KV_NAME,
    LOCK_NAME,
    SIDECAR_NAME,
    check_component,
    confined,
    validate_session_id,
)
from sessionstore.sessions.recovery import ResumeCheck, ResumeTarget, check_resume
from sessionstore.sessions.residency_budget import Residency, Resident
from sessionstore.sessions.response_list import (
    MAX_RESPONSES_BYTES,
    RESPONSES_NAME,
    read_response_list,
    response_list_bytes,
    write_response_list,
)
from sessionstore.sessions.session import Session
from sessionstore.sessions.session_home import SessionHome
from sessionstore.sessions.session_options import DEFAULT_COMMIT_EVERY, DEFAULT_SESSION_OPTIONS, SessionOptions
from sessionstore.sessions.session_resume import settle_check
from sessionstore.sessions.slots import export_slot, import_slot
from sessionstore.sessions.snapshot import SessionSnapshot, verify_session_dir
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.tier_policy import SessionUse, TierPlan, epoch_of, plan_tiers
from sessionstore.sessions.tier_record import (
    MAX_RETENTION_S,
    TIER_NAME,
    Offloaded,
    SessionOffloadedError,
    TierChange,
    TierRecord,
    check_retention,
    is_offloaded,
    read_tier,
    write_tier,
)
from sessionstore.sessions.turn import run_turn
from sessionstore.sessions.turn_loop import (
    DecodeDriver,
    RunningTurn,
    common_prefix,
    decode_turn,
    drive_inline,
    feed_chunk,
    reference_turns,
)

__all__ = [
    "BarrierCommit",
    "commit_together",
    "STATE_BYTES",
    "STATE_SLOTS",
    "CATALOGUE_NAME",
    "CONVERSATION_NAME",
    "CatalogueEntry",
    "ConversationRecord",
    "DEFAULT_COMMIT_EVERY",
    "DEFAULT_SESSION_OPTIONS",
    "DURABLE_STREAM",
    "DecodeDriver",
    "Fence",
    "KV_NAME",
    "KV_VERSION_OF_DTYPE",
    "LOCK_NAME",
    "LogitsDigest",
    "MANIFEST_NAME",
    "MAX_PAGE",
    "MAX_RESPONSES_BYTES",
    "MAX_RETENTION_S",
    "Manifest",
    "ModelRef",
    "ORDERS",
    "Offloaded",
    "OutputProcessor",
    "RESPONSES_NAME",
    "Residency",
    "Resident",
    "ResumeCheck",
    "ResumeTarget",
    "RunningTurn",
    "SIDECAR_NAME",
    "Session",
    "SessionFencedError",
    "SessionFilesMissingError",
    "SessionHome",
    "SessionInfo",
    "SessionOffloadedError",
    "SessionOptions",
    "SessionSnapshot",
    "SessionStore",
    "SessionUse",
    "TIER_NAME",
    "TINY_NAME",
    "TierChange",
    "TierPlan",
    "TierRecord",
    "TurnEnd",
    "TurnReply",
    "TurnStop",
    "check_component",
    "check_messages",
    "check_resume",
    "check_retention",
    "common_prefix",
    "confined",
    "decode_turn",
    "drive_inline",
    "epoch_of",
    "export_slot",
    "feed_chunk",
    "fingerprint_tiny",
    "held_until_committed",
    "import_slot",
    "is_offloaded",
    "logits_hash",
    "make_digest",
    "manifest_from_json",
    "model_fingerprint",
    "plan_tiers",
    "read_manifest",
    "read_record",
    "read_response_list",
    "read_tier",
    "reference_turns",
    "remove_record",
    "settle_check",
    "reopen_fenced",
    "response_list_bytes",
    "run_turn",
    "session_disk_bytes",
    "state_path",
    "tokens_digest",
    "utc_now",
    "validate_session_id",
    "verify_session_dir",
    "write_manifest",
    "write_record",
    "write_response_list",
    "write_tier",
]
