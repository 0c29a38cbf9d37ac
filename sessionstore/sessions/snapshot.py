"""A consistent view of a session's last commit, and copies of it (FORMAT.md 5.6 snapshots, forks).

A reader takes no lock: it reads the manifest (count M, epoch E), copies the header with its
commit word set to M, records [0, M) and sidecar entries [0, M), checks the copy against the
copied entries, then re-reads the manifest: the copy is consistent iff the epoch is still E and
``committed`` >= M. :func:`verify_session_dir` checks a complete directory before it is installed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kernels.errors import ColiError, CorruptionError, FormatError
from sessionstore.kvfile import (
    Dims,
    Header,
    check_records,
    copy_committed,
    copy_sidecar_prefix,
    load_sidecar,
    open_kv,
    record_bytes,
    require_sound,
)
from sessionstore.sessions.conversation_file import copy_record
from sessionstore.sessions.manifest import MANIFEST_NAME, Manifest, read_manifest, write_manifest
from sessionstore.sessions.paths import KV_NAME, SIDECAR_NAME, check_component


@dataclass(frozen=True)
class SessionSnapshot:
    """A consistent view of a session's last commit: its manifest and committed byte count.

    The committed prefix of a live session is immutable until a truncate, which bumps the
    manifest's ``epoch`` BEFORE touching the file; ``still_valid()`` after copying tells a copy
    taken from a live session is consistent. ``copy_to`` copies and checks; its caller retries.
    """

    id: str
    directory: Path
    manifest: Manifest
    header: Header  # the header as it must read for the copy (nrec = committed)

    @property
    def committed(self) -> int:
        return self.manifest.committed

    @property
    def epoch(self) -> int:
        return self.manifest.epoch

    @property
    def kv_path(self) -> Path:
        return self.directory / KV_NAME

    @property
    def sidecar_path(self) -> Path:
        return self.directory / SIDECAR_NAME

    def still_valid(self) -> bool:
        """True while the copied prefix cannot have changed (no truncate since the snapshot)."""
        try:
            now = read_manifest(self.directory / MANIFEST_NAME)
        except ColiError:
            return False
        return now.epoch == self.epoch and now.committed >= self.committed

    @classmethod
    def take(cls, session_id: str, directory: Path, manifest: Manifest) -> SessionSnapshot:
        """The snapshot of the session in ``directory`` whose manifest (read per 5.3.1) is
        ``manifest``: its kv file must hold at least the committed records."""
        dims = Dims(**manifest.dims)
        header = Header(manifest.kv_version, dims, manifest.committed, manifest.kv_tag)
        with open_kv(directory / KV_NAME, expect=dims) as reader:
            if reader.header.kv_dtype != manifest.kv_dtype:
                raise FormatError(f"{reader.path}: v{reader.version} file, the manifest says "
                                  f"{manifest.kv_dtype} (v{manifest.kv_version})")
            if reader.nrec < manifest.committed:
                raise CorruptionError(
                    f"{reader.path}: holds {reader.nrec} committed records, the manifest "
                    f"{manifest.committed}; open the session once to recover it")
        return cls(session_id, directory, manifest, header)

    def copy_to(self, dst_dir: Path, *, at: int | None = None,
                new_id: str | None = None) -> tuple[Manifest, str]:
        """Copy this snapshot (cut to ``at`` records) into ``dst_dir``; returns (manifest, method).

        The kv copy is a reflink where the filesystem has one, else an in-kernel or plain copy of
        the committed bytes; the copy's records are checked against the copied sidecar.
        """
        snap = self
        n = snap.committed if at is None else at
        if not 0 <= n <= snap.committed:
            raise FormatError(f"session {snap.id!r}: position {n} outside [0, {snap.committed}]")
        src = snap.manifest
        pending = list(src.pending)
        if n < src.committed:  # the copy continues as the source did at n: its record n is next
            with open_kv(snap.kv_path, expect=snap.header.dims) as reader:
                pending = [int(reader.tokens[n])]
        header = snap.header.with_nrec(n)
        method = copy_committed(snap.kv_path, dst_dir / KV_NAME, header)
        copy_sidecar_prefix(snap.kv_path, dst_dir / KV_NAME, header)
        with open_kv(dst_dir / KV_NAME, expect=header.dims) as reader:
            sidecar = load_sidecar(reader.path)
            report = check_records(reader, sidecar) if sidecar is not None else None
            copied, copy_path = reader.nrec, str(reader.path)
            history = [int(t) for t in reader.tokens[:n]] + pending
        if report is None or report.status != "ok" or report.vouched != n or copied != n:
            # the copy's records sit at the source's offsets: name the source's file, not the temp copy
            messages = [m.replace(copy_path, str(snap.kv_path)) for m in report.messages] if report else []
            detail = "no sidecar" if report is None else "; ".join(messages) or report.status
            raise CorruptionError(f"copy of session {snap.id!r} at {n} records failed its check: {detail}")
        manifest = Manifest(
            id=new_id or src.id, model=src.model, kv_dtype=src.kv_dtype, dims=dict(src.dims),
            committed=n, epoch=0, pending=pending, sampler=src.sampler,
            last_logits=src.last_logits if n == src.committed else None,
            origin=f"fork of {src.id} at {n}" if new_id else src.origin)
        write_manifest(dst_dir / MANIFEST_NAME, manifest)
        copy_record(snap.kv_path.parent, dst_dir, history)  # the messages, when they describe the copy
        return manifest, method


def verify_session_dir(directory: Path) -> Manifest:
    """Check a session directory is complete and sound: manifest, kv file and sidecar agree."""
    for name in (MANIFEST_NAME, KV_NAME):
        if not check_component(directory / name, want="file"):
            raise CorruptionError(f"{directory}: {name} is missing")
    manifest = read_manifest(directory / MANIFEST_NAME)
    dims = Dims(**manifest.dims)
    with open_kv(directory / KV_NAME, expect=dims) as reader:
        if reader.header.kv_dtype != manifest.kv_dtype:
            raise FormatError(f"{reader.path}: v{reader.version} {reader.header.kv_dtype} file, the manifest says "
                              f"{manifest.kv_dtype}")
        if reader.nrec < manifest.committed:
            raise CorruptionError(f"{reader.path}: {reader.nrec} records, the manifest says "
                                  f"{manifest.committed}")
        require_sound(reader, manifest.committed)  # what verify calls sound, before install
    if record_bytes(manifest.kv_version, dims, manifest.kv_tag) <= 0:  # pragma: no cover - layout guarantees it
        raise FormatError(f"{directory}: impossible record size")
    return manifest


__all__ = ["SessionSnapshot", "verify_session_dir"]
