"""A resume whose checksum pass runs beside its first step reads the v2 scales in place (issue 36
part 4): ``KVReader.layer_blocks(scales_in_place=True)`` hands the records' stored scales, unsanitised,
and every CPU kernel applies the reading rule as it reads one. So a cache over them steps bitwise
like one over the gathered, sanitised scales, whatever unusable scales the file holds (0, < 0, NaN,
inf, >= 3.4e38: inert rows). Each case well under 3 s once numba's cache is warm."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels.model import load_model
from sessionstore.kvfile import Dims, KVWriter, open_kv

PROMPT = [(7 * i + 3) % 200 + 1 for i in range(40)]
UNUSABLE = [0.0, -2.0, np.nan, np.inf, np.float32(3.4e38)]


def _file(tmp_path: Path, model: Any) -> Path:
    """A v2 file of the model's rows for PROMPT, some scales of every layer made unusable."""
    cache = model.new_cache("fp8")
    model.forward(np.asarray(PROMPT, dtype="<i4"), cache)
    rows = cache.records_since(0)
    for i, bad in enumerate(UNUSABLE):
        rows.lc_scale[3 + 5 * i, :] = bad  # [k, L] f32: every layer of that record inert in Lc
        rows.rc_scale[39 - 4 * i, i % rows.rc_scale.shape[1]] = bad
    path = tmp_path / "kv.coli_kv"
    with KVWriter.open(path, Dims(*model.dims_for_file()), kv_dtype="fp8", create=True) as writer:
        writer.append(rows)
        writer.commit()
    return path


def _steps(model: Any, blocks: Any, tokens: np.ndarray, index: Any) -> list[np.ndarray]:
    """Logits of three decode steps over a cache built from ``blocks``."""
    cache = model.cache_from_blocks(blocks, tokens, kv_dtype="fp8", index_rows=index)
    out = []
    for token in (11, 12, 13):
        out.append(np.array(model.forward(np.asarray([token], dtype="<i4"), cache)[-1]))  # [vocab] f32
    return out


@pytest.mark.parametrize("which", ["tiny", "tiny_glm"])
def test_a_cache_over_scales_in_place_steps_bitwise_like_one_over_sanitised_scales(
        which: str, tmp_path: Path, tiny_glm_dir: Path) -> None:
    model = load_model("tiny" if which == "tiny" else str(tiny_glm_dir))
    path = _file(tmp_path, model)
    with open_kv(path) as reader:
        n = reader.nrec
        in_place = reader.layer_blocks(n, scales_in_place=True)
        raw = in_place[0][0].lc_scale
        assert raw.strides[0] == reader.record_bytes and np.isnan(in_place[0][0].lc_scale[13])  # stored, in place
        got = _steps(model, in_place, reader.tokens[:n], reader.index_block(n))
        gathered = reader.layer_blocks(n)
        assert gathered[0][0].lc_scale[13] == 0.0  # sanitised: the inert row reads as 0
        want = _steps(model, gathered, reader.tokens[:n], reader.index_block(n))
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a.view("<u4"), b.view("<u4"))
