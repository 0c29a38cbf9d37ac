"""Hand-parsed, memory-mapped safetensors checkpoints.

A safetensors file is: u64 little-endian header length N, N bytes of JSON (``name -> {dtype,
shape, data_offsets: [begin, end]}`` plus an optional ``__metadata__``), then the data buffer.
Everything declared is checked against the file size BEFORE any array is made: the header
length is bounded, offsets must lie inside the buffer, not overlap, and match shape x dtype.
F32 tensors are zero-copy views of the mapping; BF16/F16 are converted to f32 on access.

A checkpoint directory is either sharded (``model.safetensors.index.json`` maps tensor names
to shard files) or a set of ``*.safetensors`` files.
"""
from __future__ import annotations

import itertools
import os
import stat
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from kernels.errors import FormatError, LimitError, NotFoundError, UnsupportedModelError
from kernels.jsonfile import parse_json_bytes, read_json_bounded

HEADER_MAX_BYTES = 100 << 20  # the safetensors reference bound
INDEX_MAX_BYTES = 64 << 20
MAX_RANK = 8
INDEX_NAME = "model.safetensors.index.json"

# dtype tag -> (numpy little-endian storage dtype, bytes per element)
_SUPPORTED = {"F32": ("<f4", 4), "BF16": ("<u2", 2), "F16": ("<f2", 2)}
_KNOWN_UNSUPPORTED = {
    "F64": 8, "I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset in the data buffer
    end: int
    path: str


class SafetensorsFile:
    """One ``.safetensors`` file: validated header + a read-only mapping of its data buffer."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFoundError(f"{self.path}: no such safetensors file") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{self.path}: not a regular file")
            self.file_size = st.st_size
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise FormatError(f"{self.path}: {self.file_size} bytes, too short for the 8-byte header length")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > HEADER_MAX_BYTES:
                raise LimitError(
                    f"{self.path}: header length {header_len} at offset 0 exceeds the limit {HEADER_MAX_BYTES}"
                )
            if 8 + header_len > self.file_size:
                raise FormatError(
                    f"{self.path}: header length {header_len} at offset 0 runs past the end of the file"
                    f" ({self.file_size} bytes)"
                )
            header = os.pread(fd, header_len, 8)
        finally:
            os.close(fd)
        self.data_offset = 8 + header_len
        self.data_bytes = self.file_size - self.data_offset
        self.tensors = self._parse_header(header)
        self._data = (
            np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_offset, shape=(self.data_bytes,))
            if self.data_bytes
            else np.zeros(0, dtype=np.uint8)
        )  # data: [data_bytes] u8 (read-only mapping)

    def _parse_header(self, header: bytes) -> dict[str, TensorInfo]:
        obj = parse_json_bytes(header, self.path, "header at offset 8")
        if not isinstance(obj, dict):
            raise FormatError(f"{self.path}: header at offset 8 must be a JSON object")
        tensors: dict[str, TensorInfo] = {}
        for name, entry in obj.items():
            if name == "__metadata__":
                if not isinstance(entry, dict):
                    raise FormatError(f"{self.path}: __metadata__ must be an object")
                continue
            tensors[name] = self._check_entry(name, entry)
        spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
        for (b0, e0, n0), (b1, _e1, n1) in itertools.pairwise(spans):
            if b1 < e0:
                raise FormatError(f"{self.path}: tensors {n0!r} [{b0}, {e0}) and {n1!r} overlap at data offset {b1}")
        return tensors

    def _check_entry(self, name: str, entry: object) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise FormatError(f"{where}: entry must be an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype in _SUPPORTED:
            itemsize = _SUPPORTED[dtype][1]
        elif dtype in _KNOWN_UNSUPPORTED:
            itemsize = _KNOWN_UNSUPPORTED[dtype]
        else:
            raise FormatError(f"{where}: unknown dtype {dtype!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_RANK
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)
        ):
            raise FormatError(
                f"{where}: shape must be a list of at most {MAX_RANK} non-negative integers, found {shape!r}"
            )
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets)
        ):
            raise FormatError(f"{where}: data_offsets must be [begin, end], found {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= self.data_bytes:
            raise FormatError(
                f"{where}: data_offsets [{begin}, {end}] (file offsets {self.data_offset + begin}.."
                f"{self.data_offset + end}) outside the data buffer of {self.data_bytes} bytes"
            )
        n_elems = 1
        for d in shape:
            n_elems *= d
        if n_elems * itemsize != end - begin:
            raise FormatError(
                f"{where}: shape {shape} x {dtype} needs {n_elems * itemsize} bytes, data_offsets span {end - begin}"
            )
        return TensorInfo(name, dtype, tuple(shape), begin, end, self.path)

    def data_bytes_at(self, begin: int, end: int) -> bytes:
        """Raw bytes ``[begin, end)`` of the data buffer (clamped to it)."""
        begin, end = max(0, begin), min(self.data_bytes, end)
        return self._data[begin:end].tobytes() if end > begin else b""

    def read(self, name: str) -> np.ndarray:
        """The tensor as f32 (a zero-copy view for F32, a converted copy for BF16/F16)."""
        info = self.tensors[name]
        if info.dtype not in _SUPPORTED:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} has dtype {info.dtype}; only F32, BF16 and F16 weights are supported"
            )
        raw = self._data[info.begin : info.end].view(np.ndarray)  # raw: [nbytes] u8
        storage = raw.view(_SUPPORTED[info.dtype][0])
        if info.dtype == "F32":
            out = storage  # zero copy
        elif info.dtype == "BF16":
            out = (storage.astype("<u4") << 16).view("<f4")  # bf16 -> f32 bits
        else:
            out = storage.astype("<f4")
        return out.reshape(info.shape)


class WeightStore:
    """All tensors of a checkpoint directory, by name (f32 on access, shapes checked)."""

    def __init__(self, files: Iterable[SafetensorsFile], source: str) -> None:
        self.source = source
        self._where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.tensors:
                if name in self._where:
                    raise FormatError(f"{source}: tensor {name!r} is in both {self._where[name].path} and {f.path}")
                self._where[name] = f

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        return self._where[name].tensors[name]

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name`` as f32, refusing any shape other than ``shape``."""
        f = self._where.get(name)
        if f is None:
            raise FormatError(f"{self.source}: missing tensor {name!r}")
        found = f.tensors[name].shape
        if found != tuple(shape):
            raise FormatError(f"{f.path}: tensor {name!r} has shape {list(found)}, expected {list(shape)}")
        return f.read(name)


class DictWeights:
    """In-memory weights with the :class:`WeightStore` interface (the embedded tiny model)."""

    def __init__(self, tensors: Mapping[str, np.ndarray], source: str = "memory") -> None:
        self._tensors = dict(tensors)
        self.source = source

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        arr = self._tensors.get(name)
        if arr is None:
            raise FormatError(f"{self.source}: missing tensor {name!r}")
        if arr.shape != tuple(shape):
            raise FormatError(f"{self.source}: tensor {name!r} has shape {list(arr.shape)}, expected {list(shape)}")
        return np.asarray(arr, dtype=np.float32)


def open_checkpoint(model_dir: str | os.PathLike[str]) -> WeightStore:
    """Map every safetensors file of a checkpoint directory (sharded or not)."""
    root = os.fspath(model_dir)
    index_path = os.path.join(root, INDEX_NAME)
    if os.path.exists(index_path):
        names = _shards_from_index(index_path)
    else:
        names = sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))
    if not names:
        raise FormatError(f"{root}: no *.safetensors weights in the model directory")
    files = [SafetensorsFile(os.path.join(root, n)) for n in names]
    store = WeightStore(files, root)
    if os.path.exists(index_path):
        _check_index_mapping(index_path, store)
    return store


def _load_index(index_path: str) -> dict[str, str]:
    obj = read_json_bounded(index_path, INDEX_MAX_BYTES)
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise FormatError(f"{index_path}: weight_map must be an object of tensor name -> shard file name")
    return weight_map


def _shards_from_index(index_path: str) -> list[str]:
    shards = sorted(set(_load_index(index_path).values()))
    for name in shards:
        if os.path.basename(name) != name or name in (".", "..") or not name.endswith(".safetensors"):
            raise FormatError(
                f"{index_path}: shard {name!r} must be a plain *.safetensors file name in the same directory"
            )
    return shards


def _check_index_mapping(index_path: str, store: WeightStore) -> None:
    for tensor, shard in _load_index(index_path).items():
        if tensor not in store or os.path.basename(store.info(tensor).path) != shard:
            raise FormatError(f"{index_path}: tensor {tensor!r} is not in shard {shard!r}")
