"""Views of a model's outputs that only tests ask for: whether record rows are fp8 rows, and the tiny
model's byte ids read back as text (both over public attributes and public data)."""
from __future__ import annotations

from kernels.rows import RecordRows


def is_fp8(rows: RecordRows) -> bool:
    """True for fp8 rows: codes and scales with no codec (v3 rows carry their codec; f32 rows no codes)."""
    return rows.lc_codes is not None and rows.codec is None


def decode_text(ids: list[int]) -> str:
    """Tiny-model ids back to text (specials dropped, invalid UTF-8 replaced): the inverse of
    :func:`kernels.model.tiny.encode_text` over the byte ids."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
