"""Model fingerprints: cheap to compute, yet they tell two checkpoints of the same shape apart.

A checkpoint directory's fingerprint is SHA-256 over, in this order:

1. the tag ``coli-fp1``;
2. ``config.json`` parsed and re-serialised canonically (sorted keys, no whitespace), so a
   reformatted config keeps its fingerprint;
3. for every ``*.safetensors`` file, sorted by name: its name, its size, its parsed header
   re-serialised canonically (tensor names, dtypes, shapes, data offsets), and a
   sample of its tensor bytes: for every tensor the first and last ``TENSOR_SAMPLE`` bytes of
   its data, plus ``FILE_SAMPLES`` blocks of ``FILE_SAMPLE`` bytes spread evenly over the data.

Headers alone are identical for two trainings of one architecture; the samples make the
difference while reading a few hundred KiB however large the checkpoint is. The embedded
``tiny`` model has no files: its fingerprint hashes its config and its weight seed.
Fingerprints look like ``fp1:<64 hex digits>``.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path
from typing import Any, Protocol

from kernels.errors import FormatError, NotFoundError
from kernels.jsonfile import read_json_bounded
from kernels.model.weights import SafetensorsFile


class Hasher(Protocol):
    """What the fingerprint needs of a ``hashlib`` object."""

    def update(self, data: bytes, /) -> None: ...

FINGERPRINT_TAG = b"coli-fp1"
PREFIX = "fp1:"
CONFIG_MAX_BYTES = 4 << 20
TENSOR_SAMPLE = 64
FILE_SAMPLES = 16
FILE_SAMPLE = 4096
TINY_NAME = "tiny"


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def _frame(h: Hasher, label: str, data: bytes) -> None:
    """Length-prefixed fields: no two different inputs hash the same byte stream."""
    name = label.encode()
    h.update(struct.pack("<I", len(name)) + name + struct.pack("<Q", len(data)))
    h.update(data)


def _read_json(path: Path, limit: int) -> Any:
    try:
        return read_json_bounded(path, limit)
    except FileNotFoundError:
        raise NotFoundError(f"{path}: not found") from None


def _hash_safetensors(h: Hasher, path: Path) -> None:
    # the decoder's own parser validates the header (bounded length, offsets inside the file)
    sf = SafetensorsFile(path)
    _frame(h, "file", path.name.encode())
    _frame(h, "size", struct.pack("<Q", sf.file_size))
    header = {t.name: [t.dtype, list(t.shape), t.begin, t.end] for t in sf.tensors.values()}
    _frame(h, "header", _canonical(header))
    for name in sorted(sf.tensors):
        info = sf.tensors[name]
        first = sf.data_bytes_at(info.begin, min(info.end, info.begin + TENSOR_SAMPLE))
        last = sf.data_bytes_at(max(info.begin, info.end - TENSOR_SAMPLE), info.end)
        _frame(h, "t:" + name, first + last)
    for i in range(FILE_SAMPLES if sf.data_bytes > 0 else 0):
        offset = (sf.data_bytes * i) // FILE_SAMPLES
        _frame(h, f"s{i}", sf.data_bytes_at(offset, offset + FILE_SAMPLE))


_known: dict[str, tuple[tuple[Any, ...], str]] = {}  # resolved dir -> (its files' stat key, fingerprint)
_known_lock = threading.Lock()


def _stat_key(root: Path) -> tuple[Any, ...]:
    """What changes when any file the fingerprint reads changes: (name, inode, size, mtime) of
    ``config.json`` and of every ``*.safetensors``, in name order."""
    names = sorted(p.name for p in root.iterdir() if p.name.endswith(".safetensors") or p.name == "config.json")
    key = []
    for name in names:
        st = os.stat(root / name)
        key.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(key)


def fingerprint_dir(model_dir: str | os.PathLike[str]) -> str:
    """Fingerprint of a checkpoint directory (``config.json`` + ``*.safetensors``); computed once
    and reused while none of those files changes (inode, size and mtime: every session opened
    on a server asks again, and a large checkpoint's samples cost ~20 ms to read)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise NotFoundError(f"{root}: not a model directory")
    where = str(root.resolve())
    try:
        key = _stat_key(root)
    except OSError:  # changing under us: compute afresh (and report what fails there)
        key = ()
    with _known_lock:
        known = _known.get(where)
    if key and known is not None and known[0] == key:
        return known[1]
    fingerprint = _fingerprint_files(root)
    if key:
        with _known_lock:
            _known[where] = (key, fingerprint)
    return fingerprint


def _fingerprint_files(root: Path) -> str:
    h = hashlib.sha256(FINGERPRINT_TAG)
    _frame(h, "config", _canonical(_read_json(root / "config.json", CONFIG_MAX_BYTES)))
    files = sorted(p for p in root.iterdir() if p.name.endswith(".safetensors"))
    if not files:
        raise FormatError(f"{root}: no *.safetensors files")
    for path in files:
        _hash_safetensors(h, path)
    return PREFIX + h.hexdigest()


def fingerprint_tiny(config: dict[str, Any], seed: int) -> str:
    """Fingerprint of a model whose weights are generated from ``seed`` for ``config``."""
    h = hashlib.sha256(FINGERPRINT_TAG)
    _frame(h, "config", _canonical(config))
    _frame(h, "seed", str(int(seed)).encode())
    return PREFIX + h.hexdigest()


def model_fingerprint(source: str | os.PathLike[str]) -> str:
    """``fp1:...`` for ``"tiny"`` (the embedded model) or a checkpoint directory."""
    if os.fspath(source) == TINY_NAME:
        from kernels.model import tiny

        return fingerprint_tiny(tiny.tiny_config_dict(), tiny.TINY_SEED)
    return fingerprint_dir(source)


__all__ = ["PREFIX", "TINY_NAME", "fingerprint_dir", "fingerprint_tiny", "model_fingerprint"]
