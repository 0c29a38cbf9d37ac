"""The records of a ``.coli_kv`` file: their structured dtype and packing (FORMAT.md 1.2).

Record p sits at ``40 + p * record_bytes``: the input token, each layer's Lc and Rc rows in the
file's encoding (v1 f32; v2 fp8 codes + scale; v3 codec bytes + radius), then the f32 indexer
rows. The header and its one parser are :mod:`sessionstore.kvfile.header` (import them from there).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kernels.errors import FormatError
from kernels.fp8 import usable_scales
from kernels.rows import RecordRows
from kernels.tq import TqCodec
from sessionstore.kvfile.header import Dims, record_bytes, v3_codec


def layer_dtype(version: int, dims: Dims, tag: int | None = None) -> np.dtype:
    """One layer's slice of a record (structured, packed, little-endian). v2 and v3 share the
    field names: ``lc``/``rc`` codes, each followed by its f32 ``*_scale`` (v3: the row radius)."""
    if version == 1:
        return np.dtype([("lc", "<f4", (dims.kv_lora,)), ("rc", "<f4", (dims.qk_rope,))])
    if version in (2, 3):
        widths = (dims.kv_lora, dims.qk_rope)
        if version == 3:
            codec = v3_codec(tag)
            widths = (codec.row_bytes(dims.kv_lora), codec.row_bytes(dims.qk_rope))
        return np.dtype([("lc", "u1", (widths[0],)), ("lc_scale", "<f4"),
                         ("rc", "u1", (widths[1],)), ("rc_scale", "<f4")])
    raise FormatError(f"record layout: unsupported version {version}")


def record_dtype(version: int, dims: Dims, tag: int | None = None) -> np.dtype:
    """Structured dtype of one record; its itemsize equals ``record_bytes(version, dims, tag)``."""
    fields: list[tuple[Any, ...]] = [("token", "<i4"),
                                     ("layers", layer_dtype(version, dims, tag), (dims.n_layers,))]
    if dims.n_index_layers and dims.index_head_dim:
        fields.append(("index", "<f4", (dims.n_index_layers, dims.index_head_dim)))
    dtype = np.dtype(fields)
    assert dtype.itemsize == record_bytes(version, dims, tag)
    return dtype


def _check_shape(name: str, array: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    if array is None:
        raise FormatError(f"pack_records: {name} is missing (expected shape {shape})")
    array = np.asarray(array)
    if array.shape != shape:
        raise FormatError(f"pack_records: {name} has shape {array.shape}, expected {shape}")
    return array


def check_tokens(rows: RecordRows, vocab: int, path: str) -> None:
    """The rows' token ids are integers in [0, vocab) (FormatError naming ``path`` otherwise)."""
    tokens = np.asarray(rows.tokens)  # [k] int
    if tokens.dtype.kind not in "iu":
        raise FormatError(f"{path}: tokens must be integers, found dtype {tokens.dtype}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise FormatError(f"{path}: token ids must lie in [0, {vocab}), found "
                          f"[{int(tokens.min())}, {int(tokens.max())}]")


def pack_records(version: int, dims: Dims, rows: RecordRows, tag: int | None = None) -> np.ndarray:
    """Pack k records into a structured array [k] of ``record_dtype`` (``.tobytes()`` = file bytes).

    Rows already in the file's encoding are stored as given; any other encoding goes through f32:
    v1 stores f32 rows (fp8/v3 rows decoded, inert rows -> zeros), v2 the engine's row quantizer
    (``kernels.fp8.quantize_rows``), v3 its codec's encoder (``kernels.tq``).
    """
    k = rows.length
    out = np.zeros(k, dtype=record_dtype(version, dims, tag))  # [k] records
    out["token"] = _check_shape("tokens", rows.tokens, (k,))
    layers = out["layers"]  # [k, L] structured view
    if version == 1:
        lc, rc = _f32_rows(rows, dims)
        layers["lc"] = lc  # [k, L, kv_lora] f32
        layers["rc"] = rc  # [k, L, rope] f32
    else:
        codec = v3_codec(tag) if version == 3 else None
        lc_codes, lc_scale, rc_codes, rc_scale = _coded_rows(rows, dims, codec)
        layers["lc"] = lc_codes  # [k, L, kv_lora | row_bytes] u8
        layers["lc_scale"] = lc_scale  # [k, L] f32 (v3: radius)
        layers["rc"] = rc_codes  # [k, L, rope | row_bytes] u8
        layers["rc_scale"] = rc_scale  # [k, L] f32 (v3: radius)
    if dims.n_index_layers and dims.index_head_dim:
        shape = (k, dims.n_index_layers, dims.index_head_dim)
        out["index"] = _check_shape("index", rows.index, shape)  # [k, NI, D] f32
    elif rows.index is not None and np.asarray(rows.index).size:
        raise FormatError("pack_records: indexer rows given but the dims declare none")
    return out


def _f32_rows(rows: RecordRows, dims: Dims) -> tuple[np.ndarray, np.ndarray]:
    """Lc [k, L, kv_lora] and Rc [k, L, rope] as f32, decoded from whatever ``rows`` hold."""
    k, L = rows.length, dims.n_layers
    if rows.lc_codes is None:
        return (_check_shape("lc", rows.lc, (k, L, dims.kv_lora)),
                _check_shape("rc", rows.rc, (k, L, dims.qk_rope)))
    lc_scale = _check_shape("lc_scale", rows.lc_scale, (k, L))
    rc_scale = _check_shape("rc_scale", rows.rc_scale, (k, L))
    if rows.codec is not None:
        c = rows.codec
        return (c.decode_rows(_check_shape("lc_codes", rows.lc_codes, (k, L, c.row_bytes(dims.kv_lora))), lc_scale),
                c.decode_rows(_check_shape("rc_codes", rows.rc_codes, (k, L, c.row_bytes(dims.qk_rope))), rc_scale))
    from kernels.fp8 import dequantize_rows
    return (dequantize_rows(_check_shape("lc_codes", rows.lc_codes, (k, L, dims.kv_lora)), sanitize_scales(lc_scale)),
            dequantize_rows(_check_shape("rc_codes", rows.rc_codes, (k, L, dims.qk_rope)), sanitize_scales(rc_scale)))


def _coded_rows(rows: RecordRows, dims: Dims, codec: TqCodec | None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(lc codes, lc scales, rc codes, rc scales) in the target encoding: fp8 (``codec`` None)
    or v3 ``codec``; rows already in it pass through, others are decoded to f32 and encoded."""
    k, L = rows.length, dims.n_layers
    if rows.lc_codes is not None and rows.codec == codec:
        lw, rw = (dims.kv_lora, dims.qk_rope) if codec is None else \
            (codec.row_bytes(dims.kv_lora), codec.row_bytes(dims.qk_rope))
        return (_check_shape("lc_codes", rows.lc_codes, (k, L, lw)),
                _check_shape("lc_scale", rows.lc_scale, (k, L)),
                _check_shape("rc_codes", rows.rc_codes, (k, L, rw)),
                _check_shape("rc_scale", rows.rc_scale, (k, L)))
    lc, rc = _f32_rows(rows, dims)
    lc = np.asarray(lc, dtype=np.float32)  # [k, L, kv_lora] f32
    rc = np.asarray(rc, dtype=np.float32)  # [k, L, rope] f32
    if codec is None:
        from kernels.fp8 import quantize_rows
        lc_codes, lc_scale = quantize_rows(lc)
        rc_codes, rc_scale = quantize_rows(rc)
    else:
        lc_codes, lc_scale = codec.encode_rows(lc)
        rc_codes, rc_scale = codec.encode_rows(rc)
    return lc_codes, lc_scale, rc_codes, rc_scale


def sanitize_scales(scales: np.ndarray) -> np.ndarray:
    """Reading rule for v2 scales: an unusable scale (non-finite, <= 0, >= 3.4e38f) marks an
    inert row, which reads as zeros; its sanitised scale is 0.0 (a fresh f32 copy)."""
    scales = np.asarray(scales, dtype=np.float32)  # [...] f32
    return np.where(usable_scales(scales), scales, np.float32(0)).astype(np.float32)


__all__ = ["check_tokens", "layer_dtype", "record_dtype", "pack_records", "sanitize_scales"]
