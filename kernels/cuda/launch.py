"""Host side of the CUDA attention kernels: descriptors, work items, split planning, launches.

Device-agnostic: a ``Runner`` supplies the array module (cupy on a GPU, numpy for the CPU
emulator), the address of an array and the kernel launch itself, so the packing and the split
arithmetic below are exercised by CI through the emulator exactly as they run on a GPU.

Work items: one per (query row, session): item = (session, q_row, visible length). Batched decode
is one item per session; a causal batch of S queries over one session is S items whose visible
lengths are T-S+1 .. T. The split kernel covers each item's rows in chunks of ``split_rows``;
the reduce kernel merges the chunks (flash-decoding), so T has no cap. A sparse (DSA) launch
passes ``sel`` [n_items, k] i32: item i then attends rows sel[i, :length] of its session, read
by index in place (SIMT gather entries).

Row kinds: f32 (F32Rows), fp8 (Fp8Rows), int4 and polar (TqRows: v3 tag 0x104 or PolarQuant
bits 2..6; the kernel reads unit-scale rotated-domain values in the codec's ``rotated_order``,
the caller rotates the queries and unrotates the context: kernels.cuda.rotation).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kernels.cuda.sources import KernelDims, mma_supported
from kernels.errors import FormatError, LimitError
from kernels.fp8 import usable_scales
from kernels.rows import F32Rows, Fp8Rows, TqRows
from kernels.tq.int4 import LEVELS
from kernels.tq.polar import polar_layout

DeviceRows = F32Rows | Fp8Rows | TqRows

SESSION_FIELDS = ("lc", "rc", "lsc", "rsc", "lc_stride", "rc_stride", "lsc_stride", "rsc_stride")
SESSION_DTYPE = np.dtype([(f, "<i8") for f in SESSION_FIELDS])  # struct MlaSession: 64 bytes
assert SESSION_DTYPE.itemsize == 64
MAX_ITEMS = 65_535  # grid.y limit
PARTIAL_BUDGET_BYTES = 512 << 20  # cap on split partials (acc + m/l) of one launch


@dataclass(frozen=True)
class KernelSpec:
    """A split kernel: its entry points per row kind, CTA shape and row tile."""

    fp8_entry: str
    f32_entry: str | None
    threads: int
    heads_per_cta: int
    tile_rows: int
    dynamic_smem: bool
    v3_prefix: str | None = None  # dense v3 entries are <prefix>_int4 / <prefix>_polar
    sparse_prefix: str | None = None  # sparse entries are <prefix>_<kind>

    def entry(self, kind: str, sparse: bool) -> str | None:
        if sparse:
            return None if self.sparse_prefix is None else f"{self.sparse_prefix}_{kind}"
        if kind in ("int4", "polar"):
            return None if self.v3_prefix is None else f"{self.v3_prefix}_{kind}"
        return self.fp8_entry if kind == "fp8" else self.f32_entry


KERNELS: dict[str, KernelSpec] = {
    "simt": KernelSpec("mla_split_simt_fp8", "mla_split_simt_f32", 256, 8, 16, False, "mla_split_simt",
                       "mla_sparse_simt"),
    "mma": KernelSpec("mla_split_mma_exact", None, 256, 32, 32, True),
    "mma_fast": KernelSpec("mla_split_mma_fast", None, 256, 32, 32, True),
}


def row_kind(rows: DeviceRows) -> str:
    """"f32", "fp8", "int4" or "polar" (the kernels' row kinds)."""
    if isinstance(rows, TqRows):
        return rows.codec.kind
    return "fp8" if isinstance(rows, Fp8Rows) else "f32"


def v3_tables(xp: Any, rows: DeviceRows) -> tuple[Any, int]:
    """(tables, bits) a v3 split kernel reads: int4 the 16 levels; PolarQuant cos | sin of the Lc
    width, then of the Rc width (PolarLayout tables, f32)."""
    if not isinstance(rows, TqRows):
        return xp.asarray(LEVELS), 0
    if rows.codec.kind == "int4":
        return xp.asarray(LEVELS), 4
    lay_l, lay_r = polar_layout(rows.kv_lora, rows.codec.bits), polar_layout(rows.qk_rope, rows.codec.bits)
    host = np.concatenate([lay_l.cos_table, lay_l.sin_table, lay_r.cos_table, lay_r.sin_table])  # [2KL + 2KR] f32
    return xp.asarray(host.astype(np.float32)), rows.codec.bits


class Runner(Protocol):
    """What the launch code needs from a device (or from the emulator)."""

    xp: Any  # numpy or cupy
    n_sm: int  # streaming multiprocessors to fill

    def address(self, arr: Any) -> int: ...

    def launch(self, dims: KernelDims, entry: str, grid: tuple[int, int, int], block: int, args: tuple[Any, ...],
               smem_bytes: int = 0) -> None: ...

    def smem_bytes(self, dims: KernelDims, entry: str) -> int: ...


def _row_stride(arr: Any, name: str, itemsize: int, align: int) -> int:
    if arr.ndim != 2 or arr.strides[1] != itemsize:
        raise FormatError(f"cuda attention: {name} must be [T, width] with a contiguous last axis,"
                          f" strides {arr.strides}")
    if arr.strides[0] % align:
        raise FormatError(f"cuda attention: {name} row stride {arr.strides[0]} is not a multiple of {align}")
    return int(arr.strides[0])


def session_record(runner: Runner, rows: DeviceRows) -> tuple[int, ...]:
    """The MlaSession fields of one device-resident block (pointers and byte strides)."""
    addr = runner.address
    if isinstance(rows, TqRows):  # codes are read byte by byte; radii are f32 (the scale fields)
        for name, arr in (("lc_radius", rows.lc_radius), ("rc_radius", rows.rc_radius)):
            if arr.ndim != 1 or arr.strides[0] % 4 or addr(arr) % 4:
                raise FormatError(f"cuda attention: {name} must be [T] f32 with a 4-byte stride")
        return (addr(rows.lc_codes), addr(rows.rc_codes), addr(rows.lc_radius), addr(rows.rc_radius),
                _row_stride(rows.lc_codes, "lc_codes", 1, 1), _row_stride(rows.rc_codes, "rc_codes", 1, 1),
                int(rows.lc_radius.strides[0]), int(rows.rc_radius.strides[0]))
    if isinstance(rows, Fp8Rows):
        for name, arr in (("lc_scale", rows.lc_scale), ("rc_scale", rows.rc_scale)):
            if arr.ndim != 1 or arr.strides[0] % 4:
                raise FormatError(f"cuda attention: {name} must be [T] f32 with a 4-byte stride")
        return (addr(rows.lc_codes), addr(rows.rc_codes), addr(rows.lc_scale), addr(rows.rc_scale),
                _row_stride(rows.lc_codes, "lc_codes", 1, 4), _row_stride(rows.rc_codes, "rc_codes", 1, 4),
                int(rows.lc_scale.strides[0]), int(rows.rc_scale.strides[0]))
    return (addr(rows.lc), addr(rows.rc), 0, 0, _row_stride(rows.lc, "lc", 4, 4),
            _row_stride(rows.rc, "rc", 4, 4), 0, 0)


def plan_split_rows(max_len: int, n_items: int, ctas_per_item: int, n_sm: int, tile: int, heads: int,
                    kv_lora: int) -> int:
    """Rows per split: enough CTAs for ~4 waves, partials within PARTIAL_BUDGET_BYTES, tile-aligned."""
    want_splits = max(1, -(-4 * n_sm // max(1, n_items * ctas_per_item)))
    max_splits = max(1, PARTIAL_BUDGET_BYTES // max(1, n_items * heads * (kv_lora + 2) * 4))
    splits = min(want_splits, max_splits, -(-max_len // tile))
    rows = -(-max_len // splits)
    return -(-rows // tile) * tile


def run_split_decode(
    runner: Runner,
    dims: KernelDims,
    kernel: str,
    sessions: Sequence[DeviceRows],
    items: np.ndarray,  # [n_items, 4] i32: session, q_row, length, 0
    q_abs: Any,  # [R, H, kv_lora] f32 device (rotated for int4 rows)
    q_rope: Any,  # [R, H, rope] f32 device (rotated for int4 rows)
    scale: float,
    split_rows: int | None = None,
    sel: Any = None,  # [n_items, k] i32 device: sparse rows of each item (k >= its length)
) -> Any:
    """Launch the split kernel + reduce over ``items``; returns ctx [n_items, H, kv_lora] f32 (device)."""
    xp = runner.xp
    spec = KERNELS[kernel]
    kind = row_kind(sessions[0])
    found = sorted({s.codec.kv_dtype if isinstance(s, TqRows) else row_kind(s) for s in sessions})
    if len(found) > 1:
        raise FormatError(f"cuda attention: one launch takes sessions of one row kind (f32, fp8 or one v3 codec),"
                          f" found {found}")
    entry = spec.entry(kind, sel is not None)
    if entry is None:
        what = "sparse (DSA) attention" if sel is not None else f"{kind} rows"
        raise FormatError(f"cuda attention: kernel {kernel!r} reads dense fp8 rows only; use kernel='simt' for {what}")
    if spec.dynamic_smem and not mma_supported(dims):
        raise FormatError(f"cuda attention: kernel {kernel!r} needs kv_lora % 32 == 0 and rope % 16 == 0,"
                          f" found {dims.kv_lora}/{dims.rope}; use kernel='simt'")
    n_items = int(items.shape[0])
    if not 0 < n_items <= MAX_ITEMS:
        raise LimitError(f"cuda attention: {n_items} work items in one launch (1..{MAX_ITEMS})")
    max_len = int(items[:, 2].max())
    ctas = -(-dims.heads // spec.heads_per_cta)
    if split_rows is None:
        split_rows = plan_split_rows(max_len, n_items, ctas, runner.n_sm, spec.tile_rows, dims.heads, dims.kv_lora)
    n_splits = -(-max_len // split_rows)
    records = np.array([session_record(runner, s) for s in sessions], dtype=SESSION_DTYPE)  # [B] MlaSession
    dev_sessions = xp.asarray(records.view("<i8").reshape(len(sessions), 8))  # [B, 8] i64
    dev_items = xp.asarray(np.ascontiguousarray(items, dtype="<i4"))  # [n, 4] i32
    part_o = xp.empty((n_items, n_splits, dims.heads, dims.kv_lora), dtype=xp.float32)  # partial acc
    part_ml = xp.empty((n_items, n_splits, dims.heads, 2), dtype=xp.float32)  # partial (m, l)
    grid = (n_splits, n_items, ctas)
    tail = (q_abs, q_rope, part_o, part_ml, np.float32(scale), np.int32(split_rows), np.int32(n_splits))
    if spec.dynamic_smem:
        fp8_sessions = [s for s in sessions if isinstance(s, Fp8Rows)]
        assert len(fp8_sessions) == len(sessions)  # dynamic-smem (mma) kernels have no f32 entry
        lsc_max = xp.stack([_scale_bound(xp, s) for s in fp8_sessions]).astype(xp.float32)  # [B] f32, no host sync
        runner.launch(dims, entry, grid, spec.threads, (dev_sessions, dev_items, lsc_max, *tail),
                      runner.smem_bytes(dims, entry))
    elif sel is None and kind in ("f32", "fp8"):
        runner.launch(dims, entry, grid, spec.threads, (dev_sessions, dev_items, *tail))
    else:  # v3 and sparse entries: + tables (+ selection) (+ PolarQuant bits)
        tables, bits = v3_tables(xp, sessions[0])
        extra: tuple[Any, ...] = () if sel is None else (sel, np.int32(sel.shape[1]))
        if kind == "polar":
            extra = (*extra, np.int32(bits))
        runner.launch(dims, entry, grid, spec.threads, (dev_sessions, dev_items, *tail, tables, *extra))
    out = xp.empty((n_items, dims.heads, dims.kv_lora), dtype=xp.float32)  # ctx [n, H, kv_lora]
    runner.launch(dims, "mla_reduce", (n_items, dims.heads, 1), 128,
                  (dev_items, part_o, part_ml, out, np.int32(split_rows), np.int32(n_splits)))
    return out


def _scale_bound(xp: Any, rows: Fp8Rows) -> Any:
    """Largest usable Lc scale of a session, as a 0-d device array (the P normaliser of the mma kernels)."""
    s = rows.lc_scale
    usable = usable_scales(s)
    return xp.max(xp.where(usable, s, xp.float32(0)))
