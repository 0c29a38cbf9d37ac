"""Shared helpers for the writer, fault, crash and upgrade tests (no tests of its own).

Records are a pure function of (position, epoch): any committed file can be checked against
them without remembering what a (possibly killed) writer did.
"""
from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Callable

import numpy as np

from kernels.rows import RecordRows
from sessionstore.kvfile.durability import Durability
from sessionstore.kvfile.header import Dims
from sessionstore.kvfile.layout import pack_records
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import load_sidecar
from sessionstore.kvfile.sidecar_check import check_records
from sessionstore.testing import count_steps

DIMS = Dims(n_layers=2, kv_lora=8, qk_rope=4, index_head_dim=0, n_index_layers=0, vocab=1000)
DIMS_IX = Dims(n_layers=2, kv_lora=8, qk_rope=4, index_head_dim=4, n_index_layers=1, vocab=1000)
_NON_NAN = np.r_[0:0x7F, 0x80:0xFF].astype(np.uint8)  # [254] codes that are not NaN


def _mix(*parts: np.ndarray) -> np.ndarray:
    x = np.zeros(np.broadcast_shapes(*(p.shape for p in parts)), dtype=np.uint64)
    for i, part in enumerate(parts):
        x = x * np.uint64(1000003) + part.astype(np.uint64) * np.uint64(2 * i + 7919)
    x ^= x >> np.uint64(29)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(32)
    return x


def gen_fp8(dims: Dims, start: int, k: int, epoch: int = 0) -> RecordRows:
    """Codes + scales of positions [start, start + k): a pure function of (position, epoch)."""
    pos = np.arange(start, start + k, dtype=np.int64) + epoch * 1_000_003  # [k]
    L = np.arange(dims.n_layers)

    def codes(n: int, salt: int) -> np.ndarray:
        h = _mix(pos[:, None, None], L[None, :, None], np.arange(n)[None, None, :],
                 np.full((1, 1, 1), salt))  # [k, L, n] u64
        return _NON_NAN[(h % np.uint64(254)).astype(np.int64)]  # [k, L, n] u8

    scale = lambda salt: ((_mix(pos[:, None], L[None, :], np.full((1, 1), salt))  # noqa: E731
                           % np.uint64(1000)).astype(np.float32) + 1) * np.float32(1 / 256)
    index = None
    if dims.n_index_layers:
        h = _mix(pos[:, None, None], np.arange(dims.n_index_layers)[None, :, None],
                 np.arange(dims.index_head_dim)[None, None, :])
        index = ((h % np.uint64(2001)).astype(np.float32) - 1000) / np.float32(64)
    return RecordRows(tokens=((pos + 11) % dims.vocab).astype(np.int32),
                      lc_codes=codes(dims.kv_lora, 1), lc_scale=scale(2),  # [k, L, n] u8 / [k, L] f32
                      rc_codes=codes(dims.qk_rope, 3), rc_scale=scale(4),
                      index=index)


def gen_f32(dims: Dims, start: int, k: int, epoch: int = 0) -> RecordRows:
    """f32 rows of positions [start, start + k): a pure function of (position, epoch)."""
    pos = np.arange(start, start + k, dtype=np.float64) + epoch * 7.5  # [k]
    L = np.arange(dims.n_layers, dtype=np.float64)

    def rows(n: int, phase: float) -> np.ndarray:
        i = np.arange(n, dtype=np.float64)
        x = np.sin(pos[:, None, None] * 0.37 + L[None, :, None] * 1.1 + i * 0.13 + phase)
        return (x * (1 + pos[:, None, None] % 5)).astype(np.float32)  # [k, L, n] f32

    index = None
    if dims.n_index_layers:
        i = np.arange(dims.n_index_layers * dims.index_head_dim, dtype=np.float64)
        index = np.cos(pos[:, None] * 0.5 + i).astype(np.float32).reshape(
            k, dims.n_index_layers, dims.index_head_dim)
    return RecordRows(tokens=((np.arange(start, start + k) + 11) % dims.vocab).astype(np.int32),
                      lc=rows(dims.kv_lora, 0.0), rc=rows(dims.qk_rope, 2.0), index=index)


def expected_records(version: int, dims: Dims, n: int, gen=gen_fp8, epoch: int = 0) -> bytes:
    """The bytes of records [0, n) as the writer must store them."""
    return pack_records(version, dims, gen(dims, 0, n, epoch)).tobytes() if n else b""


def read_committed(path: str | os.PathLike[str]) -> tuple[bytes, int, bytes, int]:
    """(header without nrec, nrec, committed record bytes, file size), read with plain I/O."""
    with open(path, "rb") as f:
        data = f.read()
    magic = data[:8]
    dims = struct.unpack_from("<6i", data, 8)
    (nrec,) = struct.unpack_from("<i", data, 32)
    L, lora, rope, ihd, nil, _ = dims
    per_layer = (lora + rope) * 4 if magic == b"COLIKV1\0" else lora + rope + 8
    rec = 4 + L * per_layer + nil * ihd * 4
    return data[:32] + data[36:40], nrec, data[40:40 + nrec * rec], len(data)


def record_size(version: int, dims: Dims) -> int:
    per_layer = (dims.kv_lora + dims.qk_rope) * 4 if version == 1 else dims.kv_lora + dims.qk_rope + 8
    return 4 + dims.n_layers * per_layer + dims.n_index_layers * dims.index_head_dim * 4


def assert_sidecar_sound(path: str | os.PathLike[str], *, require: bool = True) -> None:
    """The sidecar (if any; required by default) vouches only for records that match."""
    side = load_sidecar(path)
    if side is None:
        assert not require, f"{path}: no sidecar"
        return
    with open_kv(path) as reader:
        report = check_records(reader, side)
        assert report.sound and report.mismatched == 0, report


def leftovers(directory: str | os.PathLike[str]) -> list[str]:
    """Temp files in ``directory`` (anything ending in .tmp or starting with a dot)."""
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp") or n.startswith("."))


def scenario_steps(setup: Callable[[str], object], scenario: Callable[[str, Durability, list], object]) -> list[str]:
    """The durability steps a fault-injection scenario takes, counted once in a scratch directory."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kv")
        setup(path)
        return count_steps(lambda io: scenario(path, io, []))
