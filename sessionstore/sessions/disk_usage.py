"""What a session takes on the store's disk (FORMAT.md 5.9, 5.10): every file in its directory,
the kv file, its sidecar, the manifest and its commit state page, the conversation and responses
records, the tier record, the lock file; what the catalogue's ``bytes`` and the disk budget count
(a turn's bound of the sidecar: :func:`sessionstore.kvfile.sidecar_bound`)."""
from __future__ import annotations

import os
from pathlib import Path


def session_disk_bytes(session_dir: Path) -> int:
    """The sizes of the regular files directly in ``session_dir`` summed (one ``scandir``; a
    session holds a handful of files); 0 when it is gone. Symlinks are neither followed nor
    counted (FORMAT.md 5.1: never part of a session); a file removed meanwhile counts 0."""
    total = 0
    try:
        with os.scandir(session_dir) as entries:
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    pass
    except (FileNotFoundError, NotADirectoryError):
        return 0
    return total


__all__ = ["session_disk_bytes"]
