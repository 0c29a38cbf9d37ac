"""How a :class:`~sessionstore.kvfile.writer.KVWriter` writes: the options chosen when it is
opened, carried as one frozen object from :meth:`KVWriter.open` through the opening steps into the
writer (python-zstandard's parameter objects), instead of six arguments passed down unchanged."""
from __future__ import annotations

from dataclasses import dataclass

from kernels.errors import FormatError, LimitError
from kernels.rows import KV_DTYPES
from sessionstore.kvfile.upgrade import DEFAULT_CHUNK_BYTES


@dataclass(frozen=True)
class WriterOptions:
    """The writer's knobs (see :meth:`KVWriter.open` for each one's meaning).

    ``kv_dtype``: the rows the file holds; ``staging_bytes``: the staging buffer's size (at least
    one record); ``checksums``: keep the sidecar; ``upgrade_chunk_bytes``: the v1 upgrade's copy
    chunk; ``preallocate``: headroom bytes past the committed records (None: the default rule);
    ``write_behind``: write every append past nrec at once.
    """

    kv_dtype: str = "fp8"
    staging_bytes: int = 8 << 20
    checksums: bool = True
    upgrade_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    preallocate: int | None = 0
    write_behind: bool = False

    def check(self, path: str) -> None:
        """Refuse, naming ``path``, a kv dtype we do not know or negative headroom."""
        if self.kv_dtype not in KV_DTYPES:
            raise FormatError(f"{path}: kv_dtype {self.kv_dtype!r}, expected one of {', '.join(KV_DTYPES)}")
        if self.preallocate is not None and self.preallocate < 0:
            raise LimitError(f"{path}: preallocate must be >= 0 bytes, found {self.preallocate}")


__all__ = ["WriterOptions"]
