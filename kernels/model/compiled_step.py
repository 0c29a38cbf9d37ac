"""One batched step of a GLM-5 (``glm_moe_dsa``) or DeepSeek-V3 decoder over fp8, f32 or v3 caches on the CPU
as ONE compiled call: every layer (norms, q_a/q_b/kv_a projections, RoPE, W_UK, the cache row
writes, the DSA indexer's keys, queries and selection, attention, W_UV, o_proj, residuals, the
dense MLP and the MoE with its routing and shared expert), the final norm and lm_head, for every
row of the step. A DeepSeek-V3 model has no indexer: each row attends every row it sees (the
selection :func:`kernels.model.step_attention.all_visible` makes, passed in for the step).

It serves what the serving default runs: a decoder :func:`kernels.model.packed_weights.packable`
accepts, with every cache of the step of one kv dtype on the CPU backend (the cases
:class:`kernels.model.step_tables.StepTables` describes; f32 rows are written and attended by
:mod:`kernels.model.f32_row_tables`, v3 rows encoded and decoded by
:mod:`kernels.model.tq_row_tables`). Anything else (no q_lora, attention biases, a batch mixing
kv dtypes, another backend, CUDA) keeps the reference step of :class:`kernels.model.decoder.MLADecoder`,
which also stays as the reference the tests compare with. Weights past the packed ``once_bytes``
(``THREADED_BYTES`` by default: GLM-5.2's projections, experts, W_UK/W_UV and lm_head) go through
:mod:`kernels.model.once_product`, which reads each weight once per step for all rows (the packed
2-D ones kept in panel order, their sums in register tiles: :mod:`kernels.model.panel_tiles`).
numba's cache of :func:`run_step` holds its callees' code and is checked against this file alone:
after changing a callee's module, touch this one.

Bitwise the reference step: the same row-product kernels (:func:`kernels.model.rowwise.rows_times`,
``heads_times``; the MLP and MoE in :mod:`kernels.model.compiled_moe`, the same chains), the same
fp8 encoder, row writes, selection and attention kernels (kernels.attention.row_tables), and
numpy's own float32 sums and exp (:mod:`kernels.model.step_math`). So each row is what that token
alone gives, whoever shares the step (every loop over rows treats rows independently).

The scratch (:class:`StepScratch`) is allocated once per decoder (and thread) for the largest
batch seen, and grown when a larger one comes.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import njit

from kernels.attention.row_tables import attend_rows, select_rows, write_fp8_rows, write_keys
from kernels.compile_notice import announce_if_cold
from kernels.fp8.row_quantizer import quantize_rows_kernel
from kernels.fp8.tables import DECODE_TABLE, ENCODE_TABLE
from kernels.model.compiled_moe import mlp_rows, moe_rows
from kernels.model.f32_row_tables import attend_f32_rows, write_f32_rows
from kernels.model.once_product import heads_step, step_times
from kernels.model.packed_weights import PackedWeights
from kernels.model.step_attention import all_visible
from kernels.model.step_math import STACK, layer_norm_rows, rms_norm_rows, rope_into
from kernels.model.step_tables import StepTables
from kernels.model.tq_row_tables import attend_tq_rows, codec_params, encode_tq_rows, no_codec
from kernels.tq import TqCodec

COMPILED_KINDS = ("fp8", "f32", "tq")  # the cache row kinds the compiled step writes and attends
_KIND = {"fp8": 0, "f32": 1}  # run_step's ``kind``; any other (v3) dtype: 2


@njit(cache=True, nogil=True, boundscheck=False)
def _rope_heads(src: np.ndarray, heads: int, width: int, offset: int, cos: np.ndarray, sin: np.ndarray,
                interleave: bool, tmp: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out [n, heads, R] = RoPE of src [n, heads*width] columns [offset, offset + R) of each head."""
    rope = out.shape[2]
    for b in range(out.shape[0]):
        for hh in range(heads):
            base = hh * width + offset
            for j in range(rope):
                tmp[j] = src[b, base + j]
            rope_into(tmp, cos[b], sin[b], interleave, out[b, hh])


@njit(cache=True, nogil=True, boundscheck=False)
def run_step(h: np.ndarray, cos: np.ndarray, sin: np.ndarray, tables: Any, last: np.ndarray, w: Any, s: Any,
             codecs: Any, logits: np.ndarray) -> None:  # pragma: no cover - compiled
    """Every layer over the step's rows h [n, hidden] (in place), then logits [B, V] of rows ``last``
    [B]. ``tables``: StepTables' (latent, index, dst, key_dst, visible), then the caches' kind (0
    fp8, 1 f32, 2 v3), and for v3 their codec at kv_lora and rope (tq_row_tables.codec_params) and
    the new rows' codes [n, row bytes] u8 of each; ``w``: the packed weights' (dims, fdims, slot_of,
    mlp_of, attn, dense, moe, index, head); ``s``: the scratch."""
    latent, index, dst, key_dst, visible, kind, lp, rp, lcodes, rcodes = tables
    dims, fdims, slot_of, mlp_of, attn, dense, moe, idx, head = w
    in_norm, post_norm, q_a_t, q_a_norm, q_b_t, kv_a_t, kv_a_norm, w_uk, w_uv_t, o_t = attn
    wk_t, kn_w, kn_b, wq_b_t, wp_t = idx
    decode, encode = codecs
    n = h.shape[0]
    heads, nope, rope, kv_lora, v_head = dims[1], dims[2], dims[3], dims[4], dims[5]
    hd, nh, topk, interleave = dims[7], dims[8], dims[9], dims[15] != 0
    qk = nope + rope
    x, qa, ql, q, qn, qr, qabs, comp, lc, rc, lc8, lsc = s[0:12]
    rc8, rsc, ctx, uv, ao, kx, keys, qx, qi, wx, sel, counts = s[12:24]
    sq, tmp, hf, hl = s[36:40]
    once, idx = dims[30], s[45]  # weights past ``once`` bytes: read once per step (kernels.model.once_product)
    x, qa, ql, q, qn, qr, qabs, comp = x[:n], qa[:n], ql[:n], q[:n], qn[:n], qr[:n], qabs[:n], comp[:n]
    lc, rc, lc8, lsc, rc8, rsc = lc[:n], rc[:n], lc8[:n], lsc[:n], rc8[:n], rsc[:n]
    ctx, uv, ao = ctx[:n], uv[:n], ao[:n]
    kx, keys, qx, qi, wx, sel, counts = kx[:n], keys[:n], qx[:n], qi[:n], wx[:n], sel[:n], counts[:n]
    scores_any = False  # some row sees more than index_topk positions: selection must score
    for b in range(n):
        scores_any = scores_any or visible[b] > topk
    for layer in range(dims[0]):
        rms_norm_rows(h, in_norm[layer], fdims[0], sq, x)
        step_times(x, q_a_t[layer], qa, dims[16], once, idx)
        rms_norm_rows(qa, q_a_norm[layer], fdims[1], sq, ql)
        step_times(ql, q_b_t[layer], q, dims[17], once, idx)
        for b in range(n):
            for hh in range(heads):
                for i in range(nope):
                    qn[b, hh, i] = q[b, hh * qk + i]
        _rope_heads(q, heads, qk, nope, cos, sin, interleave, tmp, qr)
        step_times(x, kv_a_t[layer], comp, dims[18], once, idx)
        for b in range(n):
            for i in range(kv_lora):
                lc[b, i] = comp[b, i]
        rms_norm_rows(lc, kv_a_norm[layer], fdims[1], sq, lc)  # in place: each element reads itself
        for b in range(n):
            rope_into(comp[b, kv_lora:], cos[b], sin[b], interleave, rc[b])
        heads_step(qn, w_uk[layer], qabs, once, idx)
        if kind == 1:
            write_f32_rows(dst[layer], lc, rc)
        elif kind == 2:  # v3: codes and radii where fp8 keeps codes and scales
            encode_tq_rows(lc, lp, lcodes, lsc)
            encode_tq_rows(rc, rp, rcodes, rsc)
            write_fp8_rows(dst[layer], lcodes, lsc, rcodes, rsc)
        else:
            quantize_rows_kernel(lc, lc8, lsc, encode)
            quantize_rows_kernel(rc, rc8, rsc, encode)
            write_fp8_rows(dst[layer], lc8, lsc, rc8, rsc)
        slot = slot_of[layer]
        if slot >= 0:  # a full layer: its keys, and the selection the shared layers after it reuse
            step_times(x, wk_t[slot], kx, dims[25], once, idx)
            layer_norm_rows(kx, kn_w[slot], kn_b[slot], fdims[6], sq, keys)
            for b in range(n):
                for i in range(rope):
                    tmp[i] = keys[b, i]
                rope_into(tmp[:rope], cos[b], sin[b], interleave, keys[b, :rope])
            write_keys(key_dst[slot], keys)
            if scores_any:
                step_times(ql, wq_b_t[slot], qx, dims[26], once, idx)
                for b in range(n):
                    for hh in range(nh):
                        for i in range(hd):
                            qi[b, hh, i] = qx[b, hh * hd + i]
                        for i in range(rope):
                            tmp[i] = qx[b, hh * hd + i]
                        rope_into(tmp[:rope], cos[b], sin[b], interleave, qi[b, hh, :rope])
                step_times(x, wp_t[slot], wx, dims[27], once, idx)
                for b in range(n):
                    for hh in range(nh):
                        wx[b, hh] = (wx[b, hh] * fdims[4]) * fdims[5]
            select_rows(qi, wx, index[slot], visible, sel, counts)
        if kind == 1:
            attend_f32_rows(qabs, qr, latent[layer], sel, counts, fdims[2], ctx)
        elif kind == 2:
            attend_tq_rows(qabs, qr, latent[layer], sel, counts, fdims[2], ctx, lp, rp)
        else:
            attend_rows(qabs, qr, latent[layer], sel, counts, decode, fdims[2], ctx)
        heads_step(ctx, w_uv_t[layer], uv, once, idx)
        step_times(uv.reshape(n, heads * v_head), o_t[layer], ao, dims[19], once, idx)
        for b in range(n):
            for i in range(h.shape[1]):
                h[b, i] = h[b, i] + ao[b, i]
        rms_norm_rows(h, post_norm[layer], fdims[0], sq, x)
        m = mlp_of[layer]
        if m >= 0:
            mlp_rows(x, dense[0][m], dense[1][m], dense[2][m], dims[20:22], s[40][:n], s[41][:n], ao, once, idx)
        else:
            moe_rows(x, moe[0], moe[1], moe[2], moe[3], moe[4], moe[5], moe[6], moe[7], -1 - m, dims, fdims,
                      s[24], s[25], s[26], s[27], s[28], s[29], s[30], s[31], s[32], s[33], s[34], s[35], s[42],
                      s[43], s[44], n, ao, (once, idx, s[46], s[47], s[48]))
        for b in range(n):
            for i in range(h.shape[1]):
                h[b, i] = h[b, i] + ao[b, i]
    rms_norm_rows(h, head[0], fdims[0], sq, hf[:n])
    rows = last.shape[0]
    for j in range(rows):
        for i in range(h.shape[1]):
            hl[j, i] = hf[last[j], i]
    step_times(hl[:rows], head[1], logits, dims[28], once, idx)


SELECTION = 22  # where the selection [cap, topk] i64 and its counts [cap] i64 sit in StepScratch's arrays


class StepScratch:
    """The compiled step's working arrays for up to ``capacity`` rows, allocated once and replaced
    by larger ones when a larger step comes (never per token)."""

    def __init__(self, packed: PackedWeights) -> None:
        self.packed, self.capacity = packed, 0
        self.arrays: tuple[np.ndarray, ...] = ()

    def for_rows(self, n: int) -> tuple[np.ndarray, ...]:
        """Scratch for a step of ``n`` rows (the held one when it is large enough)."""
        if n > self.capacity:
            self.capacity = max(n, 2 * self.capacity, 4)
            self.arrays = self._allocate(self.capacity)
        return self.arrays

    def _allocate(self, cap: int) -> tuple[np.ndarray, ...]:
        p = self.packed
        hidden = p.head[0].shape[0]
        heads, nope, rope, kv_lora, v_head = (p.dim(k) for k in ("heads", "nope", "rope", "kv_lora", "v_head"))
        q_lora, hd, nh, topk = (p.dim(k) for k in ("q_lora", "index_dim", "index_heads", "index_topk"))
        n_exp, k_exp, n_group = p.dim("experts"), p.dim("experts_per_tok"), p.dim("n_group")
        moe_inter, shared_inter = p.moe[2].shape[-1], p.moe[5].shape[-1]
        inter = p.dense[0].shape[-1]

        def f(*shape: int) -> np.ndarray:
            return np.zeros(shape, np.float32)

        return (
            f(cap, hidden), f(cap, q_lora), f(cap, q_lora), f(cap, heads * (nope + rope)),  # x qa ql q
            f(cap, heads, nope), f(cap, heads, rope), f(cap, heads, kv_lora), f(cap, kv_lora + rope),  # qn qr qabs comp
            f(cap, kv_lora), f(cap, rope), np.zeros((cap, kv_lora), np.uint8), f(cap),  # lc rc lc8 lsc
            np.zeros((cap, rope), np.uint8), f(cap), f(cap, heads, kv_lora), f(cap, heads, v_head),  # rc8 rsc ctx uv
            f(cap, hidden), f(cap, hd), f(cap, hd), f(cap, nh * hd), f(cap, nh, hd), f(cap, nh),  # ao kx keys qx qi wx
            np.zeros((cap, topk), np.int64), np.zeros(cap, np.int64),  # sel counts (at SELECTION)
            f(cap, n_exp), f(n_exp), f(n_exp), f(n_group), np.zeros(k_exp, np.int64), f(k_exp),  # router
            f(4, moe_inter), f(4, moe_inter), f(cap * k_exp, hidden),  # eg eu: 4 pairs' products; ey: every pair's
            f(cap, shared_inter), f(cap, shared_inter), f(cap, hidden),  # sg su so: the shared expert
            f(max(hidden, q_lora, kv_lora, hd) + STACK), f(max(rope, 2)),  # sq tmp: norms' and RoPE's
            f(cap, hidden), f(cap, hidden),  # hf hl: the final-normed rows, those lm_head takes
            f(cap, inter), f(cap, inter),  # the dense MLP's gate and up
            np.zeros((cap, k_exp), np.int64), f(cap, k_exp),  # picked: each row's experts, and their weights
            np.zeros(cap * k_exp, np.int64),  # pairs: one expert's (row, slot) pairs
            np.arange(cap * k_exp, dtype=np.int64),  # idx: 0, 1, .. (the once-per-step product's plain rows)
            np.zeros(cap * k_exp, np.int64), f(cap * k_exp, moe_inter), f(cap * k_exp, moe_inter),  # prow ga ua
        )


class CompiledStep:
    """A decoder's compiled step: its packed weights, and a scratch per thread that steps it (two
    threads may step one decoder's sessions at once: the kernels hold no GIL)."""

    def __init__(self, packed: PackedWeights) -> None:
        announce_if_cold(__file__)  # numba compiles the step at its first call unless cached (not at import)
        self.packed = packed
        self._local = threading.local()
        p = packed
        self.weights = (p.dims, p.fdims, p.slot_of, p.mlp_of, p.attn, p.dense, p.moe, p.index, p.head)
        self._codecs: dict[str, tuple[Any, Any]] = {}  # kv dtype -> the codec at (kv_lora, rope)

    def _codec(self, kv_dtype: str, n: int) -> tuple[Any, ...]:
        """run_step's (kind, lp, rp, lcodes, rcodes) for a step of ``n`` rows of this kv dtype."""
        if kv_dtype not in self._codecs:
            widths = (self.packed.dim("kv_lora"), self.packed.dim("rope"))
            if kv_dtype in _KIND:
                self._codecs[kv_dtype] = (no_codec(), no_codec())
            else:
                codec = TqCodec.from_kv_dtype(kv_dtype)
                self._codecs[kv_dtype] = (codec_params(codec, widths[0]), codec_params(codec, widths[1]))
        lp, rp = self._codecs[kv_dtype]
        return (_KIND.get(kv_dtype, 2), lp, rp, np.zeros((n, lp[0][2]), np.uint8),  # [n, row bytes] u8 each
                np.zeros((n, rp[0][2]), np.uint8))

    def run(self, h: np.ndarray, cos: np.ndarray, sin: np.ndarray, tables: StepTables,
            last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows h [n, hidden] f32 (embeddings, consumed) at cos/sin [n, rope/2] -> (final-normed h
        [n, hidden] f32, logits [B, vocab] f32 of rows ``last`` [B]); writes every layer's rows
        and keys through ``tables`` and marks them written."""
        n = h.shape[0]
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = StepScratch(self.packed)
        s = scratch.for_rows(n)
        if self.packed.dim("index_heads") == 0:  # no indexer (DeepSeek-V3): each row attends every row it sees
            s = (*s[:SELECTION], *all_visible(tables.visible), *s[SELECTION + 2:])
        logits = np.empty((last.shape[0], self.packed.dim("vocab")), np.float32)  # [B, V] f32
        run_step(np.ascontiguousarray(h, np.float32), np.ascontiguousarray(cos, np.float32),
                 np.ascontiguousarray(sin, np.float32),
                 (tables.latent, tables.index, tables.dst, tables.key_dst, tables.visible,
                  *self._codec(tables.kv_dtype, n)),
                 np.ascontiguousarray(last, np.int64), self.weights, s, (DECODE_TABLE, ENCODE_TABLE), logits)
        tables.mark_all_written()
        return s[38][:n].copy(), logits


def last_rows(counts: Sequence[int]) -> np.ndarray:
    """Each cache's last row of a step in which cache b takes counts[b] rows: [B] i64."""
    return np.cumsum(np.asarray(counts, np.int64)) - 1


__all__ = ["COMPILED_KINDS", "CompiledStep", "StepScratch", "last_rows", "run_step"]
