"""Fuzz: mutated, truncated and extended files through open_kv / verify / inspect.

Only our own errors (ColiError subclasses) may escape, and nothing may allocate more than the
file's size (plus a small constant) whatever its header claims.
"""
from __future__ import annotations

import struct
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import numpy.ma  # np.median (inspect's scale statistics) imports it lazily on first

# use, ~2.4 MB of module objects: loaded here so that one-time import never lands in a measured window
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.errors import ColiError
from sessionstore.kvfile.header import HEADER_SIZE, MAGIC_DSV4, MAGIC_V1, MAGIC_V2, MAGIC_V3, Header, pack_header
from sessionstore.kvfile.layout import pack_records
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import load_sidecar, sidecar_path, write_sidecar_for
from sessionstore.kvfile.sidecar_check import check_records
from sessionstore.kvfile.verify import verify_file
from tests.kvfile.test_layout_fixtures import ENGINE_DIMS, INDEXER_DIMS, f32_rows, fp8_rows
from tools.cmd_inspect import inspect_file

SLACK = 2 << 20  # allocation allowance beyond the file size


def _base(version: int, indexer: bool, k: int) -> bytes:
    dims = INDEXER_DIMS if indexer else ENGINE_DIMS
    tokens = np.arange(11, 11 + k, dtype=np.int32)
    rows = f32_rows(dims, tokens) if version == 1 else fp8_rows(dims, tokens)
    return pack_header(Header(version, dims, k)) + pack_records(version, dims, rows).tobytes()


BASES = {(v, ix, k): _base(v, ix, k) for v in (1, 2) for ix in (False, True) for k in (0, 1, 7)}

interesting_i32 = st.sampled_from([0, 1, -1, 2, 7, 8, 44, 2**31 - 1, -(2**31), 1 << 16, 65537, 1 << 24,
                                   (1 << 8) | 4, 0x574D4B31])
field_offsets = st.sampled_from(range(8, HEADER_SIZE, 4))


@st.composite
def mutated_files(draw: st.DrawFn) -> tuple[bytes, bool]:
    data = bytearray(BASES[draw(st.sampled_from(sorted(BASES)))])
    if draw(st.booleans()):
        data[:8] = draw(st.sampled_from([MAGIC_V1, MAGIC_V2, MAGIC_V3, MAGIC_DSV4, b"COLIKV9\0", b"\0" * 8]))
    for _ in range(draw(st.integers(0, 3))):
        offset = draw(field_offsets)
        value = draw(st.one_of(interesting_i32, st.integers(-(2**31), 2**31 - 1)))
        data[offset:offset + 4] = struct.pack("<i", value)
    for _ in range(draw(st.integers(0, 4))):
        if data:
            at = draw(st.integers(0, len(data) - 1))
            data[at] = draw(st.integers(0, 255))
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    if cut is not None:
        del data[cut:]
    data += draw(st.binary(max_size=64))
    return bytes(data), draw(st.booleans())


def _exercise(path: Path, sidecar: bool) -> None:
    try:
        with open_kv(path) as kv:
            if sidecar:
                write_sidecar_for(kv)
            for layer in range(kv.dims.n_layers):
                kv.layer_rows(layer)
            for i in range(kv.dims.n_index_layers):
                kv.index_rows(i)
            if kv.nrec:
                bytes(kv.records_bytes_view(kv.nrec - 1, kv.nrec))
    except ColiError:
        pass
    try:
        verify_file(path)
    except ColiError:
        pass
    try:
        inspect_file(str(path), all_tokens=True)
    except ColiError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_files())
def test_only_our_errors_escape_and_allocation_is_bounded(case: tuple[bytes, bool]) -> None:
    data, sidecar = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ".coli_kv"
        path.write_bytes(data)
        tracemalloc.start()
        try:
            _exercise(path, sidecar)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < len(data) + SLACK


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(BASES)), st.integers(0, 200), st.binary(min_size=0, max_size=120))
def test_mutated_sidecars_only_raise_our_errors(key: tuple, cut: int, junk: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ".coli_kv"
        path.write_bytes(BASES[key])
        with open_kv(path) as kv:
            write_sidecar_for(kv)
        side = Path(sidecar_path(path))
        raw = bytearray(side.read_bytes())
        raw[cut % max(len(raw), 1):cut % max(len(raw), 1) + len(junk)] = junk
        side.write_bytes(bytes(raw))
        try:
            sidecar = load_sidecar(path)
            if sidecar is not None:
                with open_kv(path) as kv:
                    check_records(kv, sidecar)
        except ColiError:
            pass
        report = verify_file(path)  # a damaged sidecar is a finding, never a crash
        assert report.sidecar is not None
