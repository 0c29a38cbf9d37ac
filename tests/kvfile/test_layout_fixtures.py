"""Shared builders for H2's format tests: engine-scenario dims and hand-packed files.

``struct_*`` helpers build bytes with ``struct.pack`` field by field, independently of
``sessionstore.kvfile.layout``'s dtype packer, so golden tests compare two separate constructions.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from kernels.rows import RecordRows
from sessionstore.kvfile.header import Dims, Header, pack_header
from sessionstore.kvfile.layout import pack_records

# The engine's test scenario: 2 layers, latent 8, rope 4, tokens 11..55; vocab large enough.
ENGINE_DIMS = Dims(n_layers=2, kv_lora=8, qk_rope=4, index_head_dim=0, n_index_layers=0, vocab=1000)
INDEXER_DIMS = Dims(n_layers=2, kv_lora=8, qk_rope=4, index_head_dim=6, n_index_layers=2, vocab=1000)
ENGINE_TOKENS = np.arange(11, 56, dtype=np.int32)  # [45] i32


def f32_rows(dims: Dims, tokens: np.ndarray, seed: int = 0) -> RecordRows:
    """Random f32 rows for ``tokens`` (with indexer rows when the dims have them)."""
    rng = np.random.default_rng(seed)
    k, L = len(tokens), dims.n_layers
    index = None
    if dims.n_index_layers:
        index = rng.standard_normal((k, dims.n_index_layers, dims.index_head_dim)).astype(np.float32)
    return RecordRows(
        tokens=np.asarray(tokens, np.int32),
        lc=rng.standard_normal((k, L, dims.kv_lora)).astype(np.float32),
        rc=rng.standard_normal((k, L, dims.qk_rope)).astype(np.float32),
        index=index)


def fp8_rows(dims: Dims, tokens: np.ndarray, seed: int = 0) -> RecordRows:
    """Random codes (NaN codes excluded) and positive scales for ``tokens``."""
    rng = np.random.default_rng(seed)
    k, L = len(tokens), dims.n_layers
    codes = lambda n: rng.choice(np.r_[0:0x7F, 0x80:0xFF].astype(np.uint8), size=(k, L, n))  # noqa: E731
    index = None
    if dims.n_index_layers:
        index = rng.standard_normal((k, dims.n_index_layers, dims.index_head_dim)).astype(np.float32)
    return RecordRows(
        tokens=np.asarray(tokens, np.int32),
        lc_codes=codes(dims.kv_lora), lc_scale=(rng.random((k, L)) + 0.01).astype(np.float32),
        rc_codes=codes(dims.qk_rope), rc_scale=(rng.random((k, L)) + 0.01).astype(np.float32),
        index=index)


def struct_header(magic: bytes, dims: Dims, nrec: int, tag: int) -> bytes:
    return struct.pack("<8s", magic) + struct.pack(
        "<iiiiiiii", dims.n_layers, dims.kv_lora, dims.qk_rope, dims.index_head_dim,
        dims.n_index_layers, dims.vocab, nrec, tag)


def struct_record(version: int, rows: RecordRows, p: int, dims: Dims) -> bytes:
    """One record's bytes from ``struct.pack`` calls in the engine's field order."""
    out = [struct.pack("<i", int(rows.tokens[p]))]
    for l in range(dims.n_layers):
        if version == 1:
            out.append(struct.pack(f"<{dims.kv_lora}f", *rows.lc[p, l].tolist()))
            out.append(struct.pack(f"<{dims.qk_rope}f", *rows.rc[p, l].tolist()))
        else:
            out.append(bytes(rows.lc_codes[p, l].tolist()))
            out.append(struct.pack("<f", float(rows.lc_scale[p, l])))
            out.append(bytes(rows.rc_codes[p, l].tolist()))
            out.append(struct.pack("<f", float(rows.rc_scale[p, l])))
    for i in range(dims.n_index_layers):
        out.append(struct.pack(f"<{dims.index_head_dim}f", *rows.index[p, i].tolist()))
    return b"".join(out)


def write_kv(path: Path, version: int, dims: Dims, rows: RecordRows, *, nrec: int | None = None,
             tail: bytes = b"") -> Path:
    """Write a file the way the engine lays it out (no sidecar)."""
    header = Header(version, dims, rows.length if nrec is None else nrec)
    path.write_bytes(pack_header(header) + pack_records(version, dims, rows).tobytes() + tail)
    return path
