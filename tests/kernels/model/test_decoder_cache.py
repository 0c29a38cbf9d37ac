"""DecoderCache: resume over file-like strided rows without copying, truncate, records_since, fp8."""
from __future__ import annotations

import numpy as np
import pytest

import kernels.attention as attention
from kernels.errors import FormatError, ModelMismatchError
from kernels.fp8 import dequantize_rows, quantize_rows
from kernels.model.cache import DecoderCache
from kernels.rows import F32Rows, Fp8Rows, RecordRows, TqRows
from kernels.tq import TqCodec
from tests.support.model_views import is_fp8

PROMPT = np.array([72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100], dtype=np.int32)



def as_file_records(rec: RecordRows) -> np.ndarray:
    """Records laid out like a .coli_kv file (token-major, every layer's rows inside): [k] structured."""
    coded = rec.lc_codes is not None  # fp8 or v3 codes, each row followed by its scale / radius
    k, layers = rec.length, (rec.lc_codes if coded else rec.lc).shape[1]
    if coded:
        row = [("lc", "u1", rec.lc_codes.shape[2]), ("lc_scale", "<f4"), ("rc", "u1", rec.rc_codes.shape[2]),
               ("rc_scale", "<f4")]
    else:
        row = [("lc", "<f4", rec.lc.shape[2]), ("rc", "<f4", rec.rc.shape[2])]
    out = np.zeros(k, dtype=[("token", "<i4"), ("layers", row, (layers,))])  # [k] records
    out["token"] = rec.tokens
    if coded:
        out["layers"]["lc"], out["layers"]["lc_scale"] = rec.lc_codes, rec.lc_scale
        out["layers"]["rc"], out["layers"]["rc_scale"] = rec.rc_codes, rec.rc_scale
    else:
        out["layers"]["lc"], out["layers"]["rc"] = rec.lc, rec.rc
    return out


def file_blocks(records: np.ndarray, fp8: bool | str, split: int | None = None,
                widths: tuple[int, int] = (64, 16)) -> list[list]:
    """Per-layer blocks (``fp8``: True/False, or a kv dtype name such as "int4"): strided views into
    ``records`` (optionally split in two)."""
    kv = fp8 if isinstance(fp8, str) else "fp8" if fp8 else "f32"
    cuts = [(0, records.shape[0])] if split is None else [(0, split), (split, records.shape[0])]
    blocks = []
    for layer in range(records["layers"].shape[1]):
        rows = records["layers"][:, layer]
        if kv == "fp8":
            blocks.append([Fp8Rows(rows["lc"][a:b], rows["lc_scale"][a:b], rows["rc"][a:b], rows["rc_scale"][a:b])
                           for a, b in cuts])
        elif kv != "f32":
            codec = TqCodec.from_kv_dtype(kv)
            blocks.append([TqRows(rows["lc"][a:b], rows["lc_scale"][a:b], rows["rc"][a:b], rows["rc_scale"][a:b],
                                  codec, *widths) for a, b in cuts])
        else:
            blocks.append([F32Rows(rows["lc"][a:b], rows["rc"][a:b]) for a, b in cuts])
    return blocks


@pytest.mark.parametrize("kv", ["f32", "fp8", "int4", "polar4"])
@pytest.mark.parametrize("split", [None, 5])
def test_resume_from_strided_file_rows_is_bitwise_identical(model, kv: str, split: int | None) -> None:
    live = model.new_cache(kv)
    model.forward(PROMPT, live)
    records = as_file_records(live.records_since(0))
    resumed = model.cache_from_blocks(file_blocks(records, kv, split), records["token"])
    base = resumed.blocks(0)[0]
    assert np.shares_memory(base.lc if kv == "f32" else base.lc_codes, records)  # zero copy
    assert resumed.length == live.length and np.array_equal(resumed.tokens, PROMPT)
    for tok in (33, 10, 72):
        a = model.forward(np.array([tok]), live)
        b = model.forward(np.array([tok]), resumed)
        assert np.array_equal(a, b)
    own = resumed.blocks(0)[-1]  # the rows it computed live in its own storage, after the file's
    assert own.length == 3 and not np.shares_memory(own.lc if kv == "f32" else own.lc_codes, records)
    assert np.array_equal(resumed.records_since(0).tokens, live.records_since(0).tokens)
    for name in ("lc", "rc") if kv == "f32" else ("lc_codes", "lc_scale", "rc_codes", "rc_scale"):
        assert np.array_equal(getattr(resumed.records_since(3), name), getattr(live.records_since(3), name))


def test_records_since_matches_slices(model) -> None:
    cache = model.new_cache("f32")
    model.forward(PROMPT[:7], cache)
    model.forward(PROMPT[7:], cache)
    full = cache.records_since(0)
    assert full.lc.shape == (12, 3, 64) and full.rc.shape == (12, 3, 16) and full.index is None
    part = cache.records_since(7)
    assert np.array_equal(part.lc, full.lc[7:]) and np.array_equal(part.rc, full.rc[7:])
    assert np.array_equal(part.tokens, PROMPT[7:])
    empty = cache.records_since(12)
    assert empty.length == 0 and empty.lc.shape == (0, 3, 64)
    with pytest.raises(FormatError, match="holds 12 positions"):
        cache.records_since(13)


def test_truncate_then_continue_equals_never_having_seen_the_tail(model) -> None:
    a = model.new_cache("f32")
    model.forward(PROMPT[:6], a)
    model.forward(PROMPT[6:], a)
    assert a.truncate(6) == 6 and a.length == 6 and np.array_equal(a.tokens, PROMPT[:6])
    b = model.new_cache("f32")
    model.forward(PROMPT[:6], b)
    assert np.array_equal(model.forward(np.array([65, 66]), a), model.forward(np.array([65, 66]), b))
    assert a.truncate(100) == 8  # clamped to what is there
    with pytest.raises(FormatError, match="negative"):
        a.truncate(-1)


@pytest.mark.parametrize("kv", ["f32", "fp8", "int4", "polar4"])
def test_truncate_into_resumed_base_rows(model, kv: str) -> None:
    live = model.new_cache(kv)
    model.forward(PROMPT[:8], live)
    records = as_file_records(live.records_since(0))
    resumed = model.cache_from_blocks(file_blocks(records, kv, split=3), records["token"])
    model.forward(PROMPT[8:], resumed)
    assert resumed.truncate(5) == 5
    fresh = model.new_cache(kv)
    model.forward(PROMPT[:8], fresh)
    fresh.truncate(5)
    assert np.array_equal(model.forward(np.array([1, 2]), resumed), model.forward(np.array([1, 2]), fresh))
    assert len(resumed.blocks(0)) == 3  # two base blocks (cut) + its own rows


def test_fp8_cache_stores_codes_and_scales_only(model) -> None:
    cache = model.new_cache("fp8")
    model.forward(PROMPT, cache)
    rec = cache.records_since(0)
    assert is_fp8(rec) and rec.lc is None and rec.rc is None
    assert rec.lc_codes.dtype == np.uint8 and rec.lc_scale.shape == (12, 3)
    owned = [arr.dtype for arrays in cache.owned_storage()[0] for arr in arrays.values()]
    assert set(owned) == {np.dtype(np.uint8), np.dtype(np.float32)}
    layers = cache.owned_storage()[0]
    assert all(arr.ndim == 1 for arrays in layers for name, arr in arrays.items() if arr.dtype == np.float32)


class SpyBackend:
    """Records what attention sees; optionally fails at one layer call."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[list] = []
        self.fail_at = fail_at

    def absorbed_attention(self, q_abs, q_rope, blocks, softmax_scale, *, causal=True):
        self.calls.append(list(blocks))
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("injected failure")
        return attention.absorbed_attention(q_abs, q_rope, blocks, softmax_scale, causal=causal)


def test_fp8_prefill_attends_to_quantized_rows_only(model) -> None:
    spy = SpyBackend()
    cache = model.new_cache("fp8", backend=spy)
    prefill = model.forward(PROMPT, cache)
    assert len(spy.calls) == model.config.n_layers * PROMPT.size  # one query per call, layer by layer
    for n, blocks in enumerate(spy.calls):  # the rows up to the query's own, already quantized
        assert all(isinstance(b, Fp8Rows) for b in blocks)
        assert sum(b.length for b in blocks) == n % PROMPT.size + 1
    # the prompt's rows are bitwise step-by-step decoding's over quantized rows (through the same
    # attention: the CPU backend's differs from this spy's absorbed_attention in its last bits); its logits close
    stepwise = model.new_cache("fp8", backend=SpyBackend())
    for tok in PROMPT:
        last = model.forward(np.array([tok]), stepwise)
    assert np.allclose(prefill[-1], last[-1], atol=2e-4)
    a, b = cache.records_since(0), stepwise.records_since(0)
    assert np.array_equal(a.lc_codes, b.lc_codes) and np.array_equal(a.lc_scale, b.lc_scale)
    assert np.array_equal(a.rc_codes, b.rc_codes) and np.array_equal(a.rc_scale, b.rc_scale)
    # ... and an f32 cache whose rows are quantized+dequantized before every attention read
    # gives the fp8 prefill's logits, while plain f32 rows do not
    emulated = model.forward(PROMPT, model.new_cache("f32", backend=QuantizeDequantizeBackend()))
    plain = model.forward(PROMPT, model.new_cache("f32"))
    assert np.allclose(prefill, emulated, atol=1e-4)
    assert np.max(np.abs(prefill - plain)) > 1e-3


class QuantizeDequantizeBackend:
    """Attention over f32 blocks that first passes every row through the fp8 row quantizer."""

    def absorbed_attention(self, q_abs, q_rope, blocks, softmax_scale, *, causal=True):
        qdq = [F32Rows(dequantize_rows(*quantize_rows(b.lc)), dequantize_rows(*quantize_rows(b.rc))) for b in blocks]
        return attention.absorbed_attention(q_abs, q_rope, qdq, softmax_scale, causal=causal)


def test_failed_forward_leaves_the_cache_unchanged(model) -> None:
    spy = SpyBackend(fail_at=3 * PROMPT.size + 3)  # prompt: 3 layers x its rows; the next forward (2 rows)
    # fails at its 2nd layer
    cache = model.new_cache("f32", backend=spy)
    model.forward(PROMPT, cache)
    with pytest.raises(RuntimeError, match="injected"):
        model.forward(np.array([1, 2]), cache)
    assert cache.length == PROMPT.size
    spy.fail_at = None
    ref = model.new_cache("f32", backend=SpyBackend())  # the same attention as the spy's
    model.forward(PROMPT, ref)
    assert np.array_equal(model.forward(np.array([1, 2]), cache), model.forward(np.array([1, 2]), ref))


def test_cache_grows_past_initial_capacity(model) -> None:
    tokens = np.arange(150, dtype=np.int32) % 256
    cache = model.new_cache("f32")
    model.forward(tokens[:100], cache)
    for t in tokens[100:]:
        model.forward(np.array([t]), cache)
    assert cache.length == 150 and np.array_equal(cache.tokens, tokens)


def test_from_blocks_refusals(model) -> None:
    live = model.new_cache("fp8")
    model.forward(PROMPT, live)
    records = as_file_records(live.records_since(0))
    blocks = file_blocks(records, fp8=True)
    with pytest.raises(ModelMismatchError, match="Fp8Rows block given to a f32 cache"):
        model.cache_from_blocks(blocks, records["token"], kv_dtype="f32")
    with pytest.raises(FormatError, match="12 rows for 11 tokens"):
        model.cache_from_blocks(blocks, records["token"][:11])
    with pytest.raises(ModelMismatchError, match="2 layers"):
        model.cache_from_blocks(blocks[:2], records["token"])
    bad = [[Fp8Rows(b.lc_codes[:, :32], b.lc_scale, b.rc_codes, b.rc_scale)] for (b,) in blocks]
    with pytest.raises(ModelMismatchError, match="width 32"):
        model.cache_from_blocks(bad, records["token"])
    toks = records["token"].copy()
    toks[3] = 5000
    with pytest.raises(FormatError, match="token id 5000 at index 3"):
        model.cache_from_blocks(blocks, toks)
    with pytest.raises(FormatError, match="kv dtype"):
        DecoderCache(3, 64, 16, "bf16")
