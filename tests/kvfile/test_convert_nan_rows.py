"""convert v1 -> v2 of rows holding quiet and signalling NaNs writes the format notes' bytes.

Source and expected files are packed here with ``struct`` from raw u32 bit patterns (a Python float
would quieten a signalling NaN); the expected codes and scales come from the per-row reference of
tests/kernels/test_fp8_nan_rows.py, not from kernels.fp8.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from sessionstore.kvfile.convert import convert_file
from sessionstore.kvfile.header import Dims
from tests.kernels.test_fp8_nan_rows import nan_bits, nan_rows, reference_row
from tests.kvfile.test_layout_fixtures import struct_header
from tools.coli_kv import main

T = 37  # records


def _rows(n: int, count: int, seed: int) -> np.ndarray:
    """[count, n] u32: NaN rows of width n in a shuffled order (cycled when there are fewer)."""
    rows = nan_rows(n)  # [R, n] u32
    order = np.random.default_rng(seed).permutation(rows.shape[0])
    return np.resize(rows[order], (count, n))  # [count, n] u32


def _case(dims: Dims) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    L = dims.n_layers
    tokens = np.arange(100, 100 + T, dtype=np.int32)  # [T] i32
    lc = _rows(dims.kv_lora, T * L, seed=1).reshape(T, L, dims.kv_lora)  # [T, L, kv_lora] u32
    rc = _rows(dims.qk_rope, T * L, seed=2).reshape(T, L, dims.qk_rope)  # [T, L, qk_rope] u32
    index = np.random.default_rng(3).standard_normal((T, dims.n_index_layers, dims.index_head_dim))
    index = index.astype(np.float32).view(np.uint32).copy()  # [T, NI, D] u32
    if index.size:
        index[::3, 0, 0] = nan_bits("signalling+", 5)  # indexer rows stay f32, bits unchanged
        index[1::3, -1, -1] = nan_bits("quiet-", 6)
    return tokens, lc, rc, index


def _u32(values: np.ndarray) -> bytes:
    return struct.pack(f"<{values.size}I", *values.reshape(-1).tolist())


def _v1_bytes(dims: Dims, tokens: np.ndarray, lc: np.ndarray, rc: np.ndarray, index: np.ndarray) -> bytes:
    out = [struct_header(b"COLIKV1\0", dims, T, 0)]
    for p in range(T):
        out.append(struct.pack("<i", int(tokens[p])))
        for layer in range(dims.n_layers):
            out += [_u32(lc[p, layer]), _u32(rc[p, layer])]
        out.append(_u32(index[p]))
    return b"".join(out)


def _v2_reference_bytes(dims: Dims, tokens: np.ndarray, lc: np.ndarray, rc: np.ndarray,
                        index: np.ndarray) -> bytes:
    out = [struct_header(b"COLIKV2\0", dims, T, 1)]
    for p in range(T):
        out.append(struct.pack("<i", int(tokens[p])))
        for layer in range(dims.n_layers):
            for row in (lc[p, layer], rc[p, layer]):
                codes, scale_bits = reference_row(row.tolist())
                out += [bytes(codes), struct.pack("<I", scale_bits)]
        out.append(_u32(index[p]))
    return b"".join(out)


DIMS = [
    Dims(n_layers=2, kv_lora=12, qk_rope=6, index_head_dim=0, n_index_layers=0, vocab=1000),
    Dims(n_layers=3, kv_lora=100, qk_rope=6, index_head_dim=5, n_index_layers=2, vocab=1000),
    Dims(n_layers=1, kv_lora=130, qk_rope=1, index_head_dim=0, n_index_layers=0, vocab=1000),
]


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"lc{d.kv_lora}-rc{d.qk_rope}")
def test_convert_v1_to_v2_of_nan_rows_is_the_reference(tmp_path: Path, dims: Dims) -> None:
    tokens, lc, rc, index = _case(dims)
    src = tmp_path / "src"
    src.write_bytes(_v1_bytes(dims, tokens, lc, rc, index))
    want = _v2_reference_bytes(dims, tokens, lc, rc, index)
    convert_file(src, tmp_path / "dst", "v2", chunk_bytes=4096)  # several chunks per file
    assert (tmp_path / "dst").read_bytes() == want
    assert main(["convert", str(src), str(tmp_path / "cli"), "--to", "v2"]) == 0
    assert (tmp_path / "cli").read_bytes() == want
