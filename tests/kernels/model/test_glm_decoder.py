"""The GLM decoder on the tiny numpy-written glm_moe_dsa checkpoint (no torch): Ic rows for every
position, selection past index_topk with shared layers reusing it, resume over file-like rows
(latent + Ic) bitwise, truncate, a failed forward, the protocols, refusals."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kernels.attention as attention
import kernels.model.glm_decoder as glm_decoder
from kernels.errors import BackendUnavailableError, ModelMismatchError
from kernels.model import Decoder, DecoderCache, GlmDecoder, LatentCache, load_model
from kernels.model.tiny_glm import write_tiny_glm
from kernels.rows import F32Rows, Fp8Rows, RecordRows
from tests.support.model_views import is_fp8

TEXT = np.frombuffer(b"The quick brown fox jumps over the lazy dog, twice over.", np.uint8).astype(np.int32)


@pytest.fixture(scope="module")
def glm(tiny_glm_dir: Path) -> GlmDecoder:
    model = load_model(tiny_glm_dir)
    assert isinstance(model, GlmDecoder)
    return model


class SpyBackend:
    """Records each attention call: (layer kind, selection or None); optionally fails at one call."""

    name = "spy"

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[str, np.ndarray | None]] = []
        self.fail_at = fail_at

    def _count(self, kind: str, sel: np.ndarray | None) -> None:
        self.calls.append((kind, sel))
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("injected failure")

    def absorbed_attention(self, q_abs, q_rope, blocks, softmax_scale, *, causal=True):
        self._count("dense", None)
        return attention.absorbed_attention(q_abs, q_rope, blocks, softmax_scale, causal=causal)

    def sparse_absorbed_attention(self, q_abs, q_rope, blocks, selection, softmax_scale):
        self._count("sparse", selection)
        return attention.sparse_absorbed_attention(q_abs, q_rope, blocks, selection, softmax_scale)


def as_file(rec: RecordRows) -> np.ndarray:
    """Records as a .coli_kv file lays them out: token, every layer's rows, then the Ic rows: [k] structured."""
    if is_fp8(rec):
        row = [("lc", "u1", rec.lc_codes.shape[2]), ("lc_scale", "<f4"), ("rc", "u1", rec.rc_codes.shape[2]),
               ("rc_scale", "<f4")]
        layers = rec.lc_codes.shape[1]
    else:
        row = [("lc", "<f4", rec.lc.shape[2]), ("rc", "<f4", rec.rc.shape[2])]
        layers = rec.lc.shape[1]
    assert rec.index is not None
    dtype = [("token", "<i4"), ("layers", row, (layers,)), ("index", "<f4", rec.index.shape[1:])]
    out = np.zeros(rec.length, dtype=dtype)  # [k] records
    out["token"], out["index"] = rec.tokens, rec.index
    if is_fp8(rec):
        out["layers"]["lc"], out["layers"]["lc_scale"] = rec.lc_codes, rec.lc_scale
        out["layers"]["rc"], out["layers"]["rc_scale"] = rec.rc_codes, rec.rc_scale
    else:
        out["layers"]["lc"], out["layers"]["rc"] = rec.lc, rec.rc
    return out


def file_blocks(records: np.ndarray, fp8: bool, split: int | None) -> list[list]:
    cuts = [(0, records.shape[0])] if split is None else [(0, split), (split, records.shape[0])]
    out = []
    for layer in range(records["layers"].shape[1]):
        r = records["layers"][:, layer]
        out.append([Fp8Rows(r["lc"][a:b], r["lc_scale"][a:b], r["rc"][a:b], r["rc_scale"][a:b]) if fp8
                    else F32Rows(r["lc"][a:b], r["rc"][a:b]) for a, b in cuts])
    return out


def test_loaded_by_model_type_with_the_file_dims(glm: GlmDecoder) -> None:
    assert glm.dims_for_file() == (4, 64, 16, 32, 2, 260)
    decoder: Decoder[DecoderCache] = glm
    cache: LatentCache = decoder.new_cache("fp8")
    assert isinstance(decoder, Decoder) and isinstance(cache, LatentCache)


@pytest.mark.parametrize("kv", ["f32", "fp8"])
def test_ic_rows_for_every_position_in_prefill_and_decode(glm: GlmDecoder, kv: str) -> None:
    a = glm.new_cache(kv)
    glm.forward(TEXT[:5], a)  # context below index_topk: no selection, keys all the same
    for t in TEXT[5:20]:
        glm.forward(np.array([t]), a)
    glm.forward(TEXT[20:], a)
    rec = a.records_since(0)
    assert rec.index is not None and rec.index.shape == (TEXT.size, 2, 32) and rec.index.dtype == np.float32
    assert np.all(np.abs(rec.index).max(axis=2) > 0)  # a key in every position, every full layer
    b = glm.new_cache(kv)
    glm.forward(TEXT, b)  # one prefill computes the same keys
    ref = b.records_since(0).index
    assert np.max(np.abs(rec.index - ref)) < 1e-5 * np.max(np.abs(ref))
    assert np.array_equal(a.records_since(30).index, rec.index[30:])
    assert a.records_since(TEXT.size).index.shape == (0, 2, 32)


def test_selection_runs_past_index_topk_and_shared_layers_reuse_it(glm: GlmDecoder, monkeypatch) -> None:
    spy = SpyBackend()
    cache = glm.new_cache("f32", backend=spy)
    glm.forward(TEXT[:16], cache)  # 16 positions: every query sees <= index_topk rows
    assert [kind for kind, _ in spy.calls] == ["dense"] * 4 * 16  # 4 layers, one query a call
    spy.calls.clear()
    glm.forward(TEXT[16:40], cache)  # every query now sees more than 16 rows
    kinds = [kind for kind, _ in spy.calls]
    assert kinds == ["sparse"] * 4 * 24
    sels = [[sel for _, sel in spy.calls[layer * 24 : (layer + 1) * 24]] for layer in range(4)]  # [layer][row]
    for j in range(24):
        assert sels[1][j] is sels[0][j] and sels[3][j] is sels[2][j]  # shared layers reuse the full layer's
        assert sels[0][j].shape == (1, 16)
        assert np.all(sels[0][j] <= 16 + j)  # the query at position 16 + j sees no later row
    assert any(not np.array_equal(sels[0][j], sels[2][j]) for j in range(24))  # each full layer selects


def test_a_prefill_crossing_index_topk_is_dense_then_sparse(glm: GlmDecoder) -> None:
    spy = SpyBackend()
    cache = glm.new_cache("f32", backend=spy)
    mixed = glm.forward(TEXT[:30], cache)
    assert [kind for kind, _ in spy.calls] == (["dense"] * 16 + ["sparse"] * 14) * 4
    steps = glm.new_cache("f32", backend=SpyBackend())  # the same attention code (the cpu backend batches it)
    logits = [glm.forward(np.array([t]), steps)[0] for t in TEXT[:30]]
    assert np.max(np.abs(mixed - np.array(logits))) < 1e-4
    a, b = cache.records_since(0), steps.records_since(0)  # the rows: bitwise the decode steps'
    assert np.array_equal(a.lc, b.lc) and np.array_equal(a.rc, b.rc) and np.array_equal(a.index, b.index)


def test_selection_changes_the_result(glm: GlmDecoder, tmp_path: Path) -> None:
    d = write_tiny_glm(tmp_path / "wide")
    cfg = json.loads((d / "config.json").read_text())
    cfg["index_topk"] = 4096  # the same weights, attention dense everywhere
    (d / "config.json").write_text(json.dumps(cfg))
    wide = load_model(d)
    a, b = glm.forward(TEXT, glm.new_cache("f32")), wide.forward(TEXT, wide.new_cache("f32"))
    assert np.max(np.abs(a[:16] - b[:16])) < 1e-4  # up to index_topk rows: the same attention
    assert np.max(np.abs(a[20:] - b[20:])) > 1e-2  # past it: only the selected rows count


@pytest.mark.parametrize("kv", ["f32", "fp8"])
@pytest.mark.parametrize("n, split", [(10, None), (30, None), (30, 12)])
def test_resume_over_file_rows_and_ic_is_bitwise_identical(glm: GlmDecoder, kv: str, n: int,
                                                           split: int | None) -> None:
    live = glm.new_cache(kv)
    glm.forward(TEXT[:n], live)
    records = as_file(live.records_since(0))
    resumed = glm.cache_from_blocks(file_blocks(records, kv == "fp8", split), records["token"],
                                    index_rows=records["index"])
    assert np.shares_memory(resumed.index_blocks(1)[0], records)  # the file's Ic rows, not a copy
    for t in TEXT[n : n + 12]:  # decode steps cross index_topk for n = 10
        assert np.array_equal(glm.forward(np.array([t]), live), glm.forward(np.array([t]), resumed))
    a, b = live.records_since(0), resumed.records_since(0)
    assert np.array_equal(a.index, b.index) and np.array_equal(a.tokens, b.tokens)


def test_truncate_drops_the_ic_rows_too(glm: GlmDecoder) -> None:
    a = glm.new_cache("f32")
    glm.forward(TEXT[:20], a)
    records = as_file(a.records_since(0))
    a = glm.cache_from_blocks(file_blocks(records, False, 8), records["token"], index_rows=records["index"])
    glm.forward(TEXT[20:34], a)
    assert a.truncate(12) == 12 and a.records_since(0).index.shape == (12, 2, 32)
    b = glm.new_cache("f32")  # the same 20-token prefill, cut back in its own storage
    glm.forward(TEXT[:20], b)
    b.truncate(12)
    fresh = glm.new_cache("f32")  # never saw the tail at all
    glm.forward(TEXT[:12], fresh)
    for t in TEXT[12:30]:
        la, lb, lf = (glm.forward(np.array([t]), c) for c in (a, b, fresh))
        assert np.array_equal(la, lb) and np.max(np.abs(la - lf)) < 1e-4
    assert np.array_equal(a.records_since(0).index, b.records_since(0).index)


def test_failed_forward_leaves_latent_and_ic_rows_unchanged(glm: GlmDecoder) -> None:
    spy = SpyBackend(fail_at=4 * 20 + 3)  # the prompt: 4 layers x 20 rows; the next forward (2 rows) fails in
    # layer 1
    cache = glm.new_cache("f32", backend=spy)
    glm.forward(TEXT[:20], cache)
    before = cache.records_since(0)
    with pytest.raises(RuntimeError, match="injected"):
        glm.forward(TEXT[20:22], cache)
    assert cache.length == 20 and np.array_equal(cache.records_since(0).index, before.index)
    spy.fail_at = None
    ref = glm.new_cache("f32", backend=SpyBackend())
    glm.forward(TEXT[:20], ref)
    assert np.array_equal(glm.forward(TEXT[20:22], cache), glm.forward(TEXT[20:22], ref))


def test_resume_refusals(glm: GlmDecoder) -> None:
    live = glm.new_cache("f32")
    glm.forward(TEXT[:10], live)
    records = as_file(live.records_since(0))
    blocks = file_blocks(records, False, None)
    with pytest.raises(ModelMismatchError, match="index_rows"):
        glm.cache_from_blocks(blocks, records["token"])
    with pytest.raises(ModelMismatchError, match="index_rows"):
        glm.cache_from_blocks(blocks, records["token"], index_rows=records["index"][:, :1])
    with pytest.raises(ModelMismatchError, match="index_rows"):
        glm.cache_from_blocks(blocks, records["token"], index_rows=records["index"].astype(np.float64))
    v3_cache = load_model("tiny").new_cache("f32")
    with pytest.raises(ModelMismatchError, match="other dimensions"):
        glm.forward(TEXT[:3], v3_cache)


def test_a_backend_without_sparse_attention_is_refused_by_name(glm: GlmDecoder) -> None:
    class DenseOnly(SpyBackend):
        sparse_absorbed_attention = None  # type: ignore[assignment]

    cache = glm.new_cache("f32", backend=DenseOnly())
    glm.forward(TEXT[:16], cache)  # dense only: fine
    with pytest.raises(BackendUnavailableError, match="sparse_absorbed_attention"):
        glm.forward(TEXT[16:18], cache)
    assert cache.length == 16


def test_select_step_called_once_per_full_layer_per_forward(glm: GlmDecoder, monkeypatch) -> None:
    calls: list[list[int]] = []
    original_step = glm_decoder.select_step

    def counting_step(qi, w, keys_of, k):
        calls.append([sum(int(b.shape[0]) for b in keys) - 1 for keys in keys_of])  # each query's position
        return original_step(qi, w, keys_of, k)

    monkeypatch.setattr(glm_decoder, "select_step", counting_step)
    monkeypatch.setattr(glm, "use_compiled", False)  # the reference step's calls (the compiled step selects
    # inside its one compiled call, bitwise the same: tests/kernels/model/test_compiled_step.py)
    cache = glm.new_cache("f32")
    glm.forward(TEXT[:20], cache)
    glm.forward(TEXT[20:21], cache)
    # the prefill: one call per full layer for its queries past index_topk; the decode step: its one
    assert calls == [[16, 17, 18, 19], [16, 17, 18, 19], [20], [20]]
