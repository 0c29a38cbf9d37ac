"""The 40-byte header of a ``.coli_kv`` file: magics, named limits, dims, and the ONE parser.

``parse_header`` is the one parser of the engine's header; the reader, the writer, ``inspect``,
``verify``, ``convert`` and resume all go through it. Every field is checked against named limits
before anything is allocated. All integers are little-endian. The header is FORMAT.md 1.1, the
record size 1.2, the parsing order 1.3; the structs below are asserted to those sizes at import.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from kernels.errors import FormatError, LimitError
from kernels.fp8 import USABLE_SCALE_BOUND
from kernels.tq import TqCodec
from kernels.tq.rotation import WIDTHS as V3_WIDTHS

# --- magics and struct constants -----------------------------------------------------------
MAGIC_V1 = b"COLIKV1\0"
MAGIC_V2 = b"COLIKV2\0"
MAGIC_V3 = b"COLIKV3\0"
MAGIC_DSV4 = b"COLIDV41"
MAGIC_SIZE = 8
HEADER_SIZE = 40
NREC_OFFSET = 32
TAG_OFFSET = 36
TAG_F32 = 0
TAG_FP8 = 1
VERSION_TAGS = {1: TAG_F32, 2: TAG_FP8}  # v3's tag names its codec: (codec << 8) | bits
VERSION_MAGICS = {1: MAGIC_V1, 2: MAGIC_V2, 3: MAGIC_V3}
MAGIC_VERSIONS = {magic: version for version, magic in VERSION_MAGICS.items()}

HEADER_STRUCT = struct.Struct("<8s8i")  # magic, 6 dims, nrec, tag
DIMS_STRUCT = struct.Struct("<6i")
NREC_STRUCT = struct.Struct("<i")
TOKEN_BYTES = 4
SCALE_BYTES = 4
F32_BYTES = 4

assert HEADER_STRUCT.size == HEADER_SIZE
assert DIMS_STRUCT.size == 24
assert NREC_STRUCT.size == 4
assert MAGIC_SIZE + DIMS_STRUCT.size == NREC_OFFSET
assert NREC_OFFSET + NREC_STRUCT.size == TAG_OFFSET
assert TAG_OFFSET + 4 == HEADER_SIZE

# --- named limits (checked before any allocation) -------------------------------------------
MAX_LAYERS = 1024  # DeepSeek-V3: 61, GLM-5.2: 78
MAX_WIDTH = 65536  # kv_lora, qk_rope, index_head_dim (512 / 64 / 128 in practice)
MAX_VOCAB = 1 << 24  # GLM-5.2: 154,880
MAX_RECORD_BYTES = 64 << 20  # one record (GLM-5.2 v1: 179,716 B)
MAX_NREC = (1 << 31) - 1  # the commit word is an i32
# A v2 row whose scale is not in (0, 3.4e38f) is inert (the engine's finiteness test; the same
# rule as kernels.fp8.dequantize_rows, and the same bound: kernels.fp8.USABLE_SCALE_BOUND).
INERT_SCALE_LIMIT = USABLE_SCALE_BOUND


@dataclass(frozen=True)
class Dims:
    """What a ``.coli_kv`` file is bound to: the model's cache shape and vocabulary."""

    n_layers: int
    kv_lora: int
    qk_rope: int
    index_head_dim: int = 0
    n_index_layers: int = 0
    vocab: int = 0

    def as_tuple(self) -> tuple[int, int, int, int, int, int]:
        return (self.n_layers, self.kv_lora, self.qk_rope, self.index_head_dim,
                self.n_index_layers, self.vocab)


def record_bytes(version: int, dims: Dims, tag: int | None = None) -> int:
    """Bytes of one record (token + all layers + indexer rows); v3 needs its ``tag`` (the codec)."""
    index = dims.n_index_layers * dims.index_head_dim * F32_BYTES
    if version == 1:
        per_layer = (dims.kv_lora + dims.qk_rope) * F32_BYTES
    elif version == 2:
        per_layer = dims.kv_lora + dims.qk_rope + 2 * SCALE_BYTES
    elif version == 3:
        codec = v3_codec(tag)
        per_layer = codec.row_bytes(dims.kv_lora) + codec.row_bytes(dims.qk_rope) + 2 * SCALE_BYTES
    else:
        raise FormatError(f"record layout: unsupported version {version} (expected 1, 2 or 3)")
    return TOKEN_BYTES + dims.n_layers * per_layer + index


def v3_codec(tag: int | None) -> TqCodec:
    """The codec a v3 tag names (FormatError for any other tag)."""
    if tag is None:
        raise FormatError("record layout: a v3 header needs its format tag (the codec)")
    return TqCodec.from_tag(tag)


@dataclass(frozen=True)
class Header:
    """A parsed (or to-be-written) 40-byte header. ``nrec`` is the commit word as stored."""

    version: int
    dims: Dims
    nrec: int = 0
    tag: int | None = None  # None: the version's tag (0 for v1, 1 for v2); v3 MUST give its codec
    # What parsing noticed in a header the engine loads but we never write (FORMAT.md 1.3):
    # a v1/v2 tag word other than the version's, indexer dims of which only one is 0, a
    # negative nrec (read as 0). Readers report them; writers refuse to append to such a file.
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.tag is None and self.version in VERSION_TAGS:
            object.__setattr__(self, "tag", VERSION_TAGS[self.version])

    @property
    def record_bytes(self) -> int:
        return record_bytes(self.version, self.dims, self.tag)

    @property
    def codec(self) -> TqCodec | None:
        """The v3 row codec (None for v1/v2)."""
        return v3_codec(self.tag) if self.version == 3 else None

    @property
    def kv_dtype(self) -> str:
        """The kv dtype whose rows this file holds: "f32", "fp8", "int4" or "polar2".."polar6"."""
        if self.version == 3:
            return v3_codec(self.tag).kv_dtype
        return "fp8" if self.version == 2 else "f32"

    @property
    def magic(self) -> bytes:
        return VERSION_MAGICS[self.version]

    def committed_end(self) -> int:
        """Byte offset just past the last committed record."""
        return HEADER_SIZE + self.nrec * self.record_bytes

    def with_nrec(self, nrec: int) -> Header:
        return Header(self.version, self.dims, nrec, self.tag, self.notes)


def _where(path: object) -> str:
    return f"{path}" if path is not None else "<buffer>"


def validate_dims(dims: Dims, path: object = None, *, lenient_index: bool = False) -> None:
    """Check every dimension against the named limits; raise FormatError/LimitError naming it.

    ``lenient_index``: indexer dims of which only one is 0 are accepted (a header the engine
    loads; they describe no indexer bytes), as parsing does; what we write never has them."""
    fields = (("n_layers", 8, MAX_LAYERS, 1), ("kv_lora", 12, MAX_WIDTH, 1),
              ("qk_rope", 16, MAX_WIDTH, 1), ("index_head_dim", 20, MAX_WIDTH, 0),
              ("n_index_layers", 24, MAX_LAYERS, 0), ("vocab", 28, MAX_VOCAB, 1))
    for name, offset, limit, minimum in fields:
        value = getattr(dims, name)
        if not isinstance(value, int | np.integer):
            raise FormatError(f"{_where(path)}: {name} must be an integer, found {value!r}")
        if value < minimum:
            raise FormatError(
                f"{_where(path)}: byte {offset}: {name} = {value}, expected >= {minimum}")
        if value > limit:
            raise LimitError(
                f"{_where(path)}: byte {offset}: {name} = {value} exceeds the limit {limit}")
    if (dims.index_head_dim == 0) != (dims.n_index_layers == 0) and not lenient_index:
        raise FormatError(
            f"{_where(path)}: byte 20: index_head_dim = {dims.index_head_dim} and "
            f"n_index_layers = {dims.n_index_layers}: both must be 0 or both > 0")
    if dims.n_index_layers > dims.n_layers:
        raise FormatError(
            f"{_where(path)}: byte 24: n_index_layers = {dims.n_index_layers} exceeds "
            f"n_layers = {dims.n_layers}")
    for version in (1, 2):
        size = record_bytes(version, dims)
        if size > MAX_RECORD_BYTES:
            raise LimitError(
                f"{_where(path)}: v{version} record size {size} bytes exceeds the limit "
                f"{MAX_RECORD_BYTES} (dims {dims.as_tuple()})")


def pack_header(header: Header) -> bytes:
    """The 40 header bytes, little-endian (only headers we write: the version's tag, sound dims)."""
    if header.version not in VERSION_MAGICS:
        raise FormatError(f"pack_header: unsupported version {header.version}")
    validate_dims(header.dims)
    if header.version == 3:
        validate_v3_widths(header.dims, v3_codec(header.tag))
    elif header.tag != VERSION_TAGS[header.version]:
        raise FormatError(f"pack_header: tag {header.tag!r} for a v{header.version} header")
    if not 0 <= header.nrec <= MAX_NREC:
        raise LimitError(f"pack_header: nrec {header.nrec} outside [0, {MAX_NREC}]")
    return HEADER_STRUCT.pack(header.magic, *header.dims.as_tuple(), header.nrec, int(header.tag or 0))


def validate_v3_widths(dims: Dims, codec: TqCodec, path: object = None) -> None:
    """v3 rows need kv_lora and qk_rope to be powers of two in 2..512 (the engine's rule)."""
    for name, offset in (("kv_lora", 12), ("qk_rope", 16)):
        value = getattr(dims, name)
        if value not in V3_WIDTHS:
            raise FormatError(
                f"{_where(path)}: byte {offset}: {name} = {value}: v3 ({codec.kv_dtype}) rows need a "
                f"power of two in {V3_WIDTHS[0]}..{V3_WIDTHS[-1]}")


def pack_nrec(nrec: int) -> bytes:
    """The 4 bytes of the commit word."""
    if not 0 <= nrec <= MAX_NREC:
        raise LimitError(f"nrec {nrec} outside [0, {MAX_NREC}]")
    return NREC_STRUCT.pack(nrec)


def static_header_bytes(header_bytes: bytes) -> bytes:
    """Everything of the header but the commit word: bytes [0:32] + [36:40]."""
    return bytes(header_bytes[:NREC_OFFSET]) + bytes(header_bytes[TAG_OFFSET:HEADER_SIZE])


def parse_header(buf: bytes | bytearray | memoryview, file_size: int, path: object = None) -> Header:
    """Parse and validate the header at the start of ``buf`` (a file of ``file_size`` bytes).

    Refuses (FormatError/LimitError naming the file and byte offset): a short header, an unknown
    magic, COLIDV41 (DeepSeek-V4 engine) by name, impossible or huge dims, a record size over the
    limit, a v3 tag that names no codec or v3 widths that are not powers of two (FORMAT.md 1.3).
    Accepts, with a note in ``Header.notes``, what the engine loads though we never write it:
    a v1/v2 tag word other than the version's (the engine ignores it), indexer dims of which only
    one is 0, a negative nrec (read as 0).
    ``nrec`` beyond the file is NOT refused here: readers keep the complete records (engine rule).
    """
    where = _where(path)
    head = bytes(buf[:HEADER_SIZE])
    if len(head) < MAGIC_SIZE:
        raise FormatError(f"{where}: short header: {file_size} bytes, expected {HEADER_SIZE}")
    magic = head[:MAGIC_SIZE]
    if magic == MAGIC_DSV4:
        raise FormatError(
            f"{where}: byte 0: magic COLIDV41 is the DeepSeek-V4 engine's cache format, "
            "not a .coli_kv latent-KV file; refusing it")
    version = MAGIC_VERSIONS.get(magic)
    if version is None:
        raise FormatError(
            f"{where}: byte 0: unknown magic {magic!r}, expected {MAGIC_V1!r}, {MAGIC_V2!r} or "
            f"{MAGIC_V3!r}")
    if len(head) < HEADER_SIZE or file_size < HEADER_SIZE:
        raise FormatError(
            f"{where}: short header: {min(len(head), file_size)} bytes, expected {HEADER_SIZE}")
    _, *dim_values, nrec, tag = HEADER_STRUCT.unpack(head)
    dims = Dims(*dim_values)
    notes: list[str] = []
    if version == 3:
        try:
            codec = TqCodec.from_tag(tag)
        except FormatError as exc:
            raise FormatError(f"{where}: byte {TAG_OFFSET}: {exc}") from None
    elif tag != VERSION_TAGS[version]:
        notes.append(
            f"byte {TAG_OFFSET}: tag {tag:#x} in a COLIKV{version} file, expected {VERSION_TAGS[version]}: "
            "the engine ignores the tag of v1/v2 files (a forked COLIKV2 keeps a watermark "
            "there, with rows that may mean something else)")
    validate_dims(dims, path, lenient_index=True)
    if version == 3:
        validate_v3_widths(dims, codec, path)
    if (dims.index_head_dim == 0) != (dims.n_index_layers == 0):
        notes.append(
            f"bytes 20-24: index_head_dim = {dims.index_head_dim} with n_index_layers = "
            f"{dims.n_index_layers}: no indexer bytes in the records")
    if nrec < 0:
        notes.append(f"byte {NREC_OFFSET}: nrec = {nrec} is negative: read as 0 records (engine rule)")
        nrec = 0
    return Header(version, dims, nrec, tag, tuple(notes))


def complete_records(header: Header, file_size: int) -> int:
    """Records a reader may use: nrec, or fewer when the file is cut inside the committed part."""
    available = max(file_size - HEADER_SIZE, 0) // header.record_bytes
    return max(min(header.nrec, available), 0)


__all__ = [
    "MAGIC_V1", "MAGIC_V2", "MAGIC_V3", "MAGIC_DSV4", "MAGIC_SIZE", "HEADER_SIZE", "NREC_OFFSET", "TAG_OFFSET",
    "TAG_F32", "TAG_FP8", "VERSION_TAGS", "VERSION_MAGICS", "MAGIC_VERSIONS", "HEADER_STRUCT", "DIMS_STRUCT",
    "NREC_STRUCT", "TOKEN_BYTES", "SCALE_BYTES", "F32_BYTES", "MAX_LAYERS", "MAX_WIDTH", "MAX_VOCAB",
    "MAX_RECORD_BYTES", "MAX_NREC", "INERT_SCALE_LIMIT", "Dims", "Header", "record_bytes", "v3_codec",
    "validate_dims", "pack_header", "validate_v3_widths", "pack_nrec", "static_header_bytes", "parse_header",
    "complete_records"
]
