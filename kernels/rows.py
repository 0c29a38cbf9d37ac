"""Latent-row containers shared by the codec, the attention kernels, the decoder and the store.

A *block* holds T consecutive positions of ONE layer's latent cache, either as f32 rows or as
fp8 e4m3 codes with one f32 scale per row. Arrays may be strided views (a memory-mapped
``.coli_kv`` file gives rows whose stride is the record size); the last axis is always
contiguous. Attention takes a sequence of blocks that together form the cache, in order.

*Record rows* hold k consecutive positions across ALL layers, the way a ``.coli_kv`` record
stores them; the decoder produces them and the file writer appends them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.tq.codec import TqCodec

# The kv dtypes, the one table of them: the name a cache, a session or a CLI flag uses -> the
# ``.coli_kv`` (version, format tag) whose records hold those rows (FORMAT.md 1.1: v1 f32 rows,
# v2 fp8 rows, v3 4-bit rows whose tag names the codec: 0x104 rotated int4, 2..6 PolarQuant bits).
KV_FORMAT_OF_DTYPE: dict[str, tuple[int, int]] = {
    "fp8": (2, 1), "f32": (1, 0), "int4": (3, 0x104),
    **{f"polar{bits}": (3, bits) for bits in range(2, 7)},
}
KV_VERSION_OF_DTYPE: dict[str, int] = {name: fmt[0] for name, fmt in KV_FORMAT_OF_DTYPE.items()}
KV_DTYPES: tuple[str, ...] = tuple(KV_FORMAT_OF_DTYPE)  # ("fp8", "f32", "int4", "polar2", ...)


@dataclass(frozen=True)
class F32Rows:
    """One layer, T positions, f32 rows."""

    lc: np.ndarray  # [T, kv_lora] f32
    rc: np.ndarray  # [T, qk_rope] f32

    @property
    def length(self) -> int:
        return int(self.lc.shape[0])


@dataclass(frozen=True)
class Fp8Rows:
    """One layer, T positions, fp8 e4m3 codes + one f32 scale per row (Lc and Rc separately).

    Readers hand out scales sanitised by the reading rules (a non-finite or <= 0 scale is an inert
    row: its scale reads as 0.0, so the row contributes exactly 0), or, for a resume whose checksum
    pass runs beside its first step, as stored (strided views of the records: every CPU attention
    kernel applies the rule as it reads a scale); NaN codes decode to 0 through the table.
    """

    lc_codes: np.ndarray  # [T, kv_lora] u8
    lc_scale: np.ndarray  # [T] f32
    rc_codes: np.ndarray  # [T, qk_rope] u8
    rc_scale: np.ndarray  # [T] f32

    @property
    def length(self) -> int:
        return int(self.lc_codes.shape[0])


@dataclass(frozen=True)
class TqRows:
    """One layer, T positions, v3 4-bit rows: codec bytes + one f32 radius per row (Lc and Rc).

    Radii are as stored; the reading rule (a radius outside [0, 3.4e38) is an inert row) is
    applied by whoever decodes or attends (``TqCodec.row_scale``).
    """

    lc_codes: np.ndarray  # [T, row_bytes(kv_lora)] u8
    lc_radius: np.ndarray  # [T] f32
    rc_codes: np.ndarray  # [T, row_bytes(qk_rope)] u8
    rc_radius: np.ndarray  # [T] f32
    codec: TqCodec
    kv_lora: int
    qk_rope: int

    @property
    def length(self) -> int:
        return int(self.lc_codes.shape[0])


LatentRows = F32Rows | Fp8Rows | TqRows


@dataclass(frozen=True)
class RecordRows:
    """k consecutive positions across all layers, as ``.coli_kv`` records store them.

    Exactly one of the row encodings is set: ``lc``/``rc`` (f32), or the four code fields: fp8
    codes + scales, or, with ``codec`` set, v3 codes + radii (``lc_codes`` [k, L, row_bytes] u8,
    ``lc_scale`` the f32 radius of each row). ``tokens[i]`` is the INPUT token at that position.
    """

    tokens: np.ndarray  # [k] i32
    lc: np.ndarray | None = None  # [k, L, kv_lora] f32
    rc: np.ndarray | None = None  # [k, L, qk_rope] f32
    lc_codes: np.ndarray | None = None  # [k, L, kv_lora] u8
    lc_scale: np.ndarray | None = None  # [k, L] f32
    rc_codes: np.ndarray | None = None  # [k, L, qk_rope] u8
    rc_scale: np.ndarray | None = None  # [k, L] f32
    index: np.ndarray | None = None  # [k, n_index_layers, index_head_dim] f32
    codec: TqCodec | None = None  # set: the code fields hold v3 rows of this codec

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

