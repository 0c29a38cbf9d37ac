"""The reference MLA decoder (DeepSeek-V3 family), f32 numpy, over a latent cache.

Per layer and position it produces exactly what a ``.coli_kv`` record stores: Lc = the kv_a
RMSNorm of the compressed latent, Rc = k_rot after RoPE in the de-interleaved layout. Attention
is absorbed: the decoder multiplies q_nope by W_UK, attends over the cache blocks (which it
never copies; :mod:`kernels.model.step_attention`), then applies W_UV and o_proj.

Every forward is a batched step (:meth:`MLADecoder.step`): each new position is computed as a
decode step of that token alone computes it, row by row, so a prompt gives the same rows in one
piece, in chunks or token by token, and a session the same tokens whoever shares its steps.
Attention is that of :mod:`kernels.model.step_attention`: each row over every row it sees through
the batch-invariant kernels a GLM-5 layer uses (a DeepSeek-V3 layer is one without the DSA indexer).
A model :func:`~kernels.model.packed_weights.packable` accepts whose step's caches are all of one
compiled kind on the CPU runs the step as ONE compiled call (:mod:`kernels.model.compiled_step`,
bitwise this path); every other model, kv dtype and backend runs the step here, which stays the
reference the tests compare the compiled step with.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.errors import FormatError, LimitError, ModelMismatchError
from kernels.model.cache import DecoderCache
from kernels.model.compiled_step import COMPILED_KINDS, CompiledStep, last_rows
from kernels.model.config import ModelConfig
from kernels.model.decoder_layers import MLAttention, Weights, load_layer
from kernels.model.packed_weights import pack, packable
from kernels.model.rope import Rotary, softmax_scale
from kernels.model.rowwise import THREADED_BYTES, head_matmul, rowwise_linear
from kernels.model.step_attention import all_visible, attend_rows_of
from kernels.model.step_rows import StepRow, step_rows_of, write_step_rows
from kernels.model.step_tables import StepTables
from kernels.rows import LatentRows


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, f32."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)  # [..., 1] f32
    y: np.ndarray = weight * (x * (np.float32(1.0) / np.sqrt(variance + np.float32(eps))))  # y: [..., D] f32
    return y


def _linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x [N, in] @ w[out, in]^T (+ bias) -> [N, out] f32, each row alone (batch-invariant)."""
    y = rowwise_linear(x, w)  # y: [N, out] f32
    return y if bias is None else y + bias


@dataclass(frozen=True)
class Queries:
    """One layer's queries for absorbed attention, and the q residual they came from."""

    q_abs: np.ndarray  # [S, H, kv_lora] f32 (q_nope @ W_UK)
    q_rope: np.ndarray  # [S, H, rope] f32
    q_resid: np.ndarray | None  # [S, q_lora] f32: q_a_layernorm(q_a_proj(x)); None without q_lora


class MLADecoder:
    """A loaded model: ``forward(tokens, cache) -> logits`` appends the tokens' rows to ``cache``."""

    def __init__(self, config: ModelConfig, weights: Weights, source: str = "") -> None:
        self.config = config
        self.source = source or weights.source
        cfg = config
        self.embed = weights.get("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))  # [V, hidden]
        self.final_norm = weights.get("model.norm.weight", (cfg.hidden_size,))  # [hidden]
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed  # [V, hidden]
        else:
            self.lm_head = weights.get("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))  # [V, hidden]
        self.layers = [load_layer(cfg, weights, i) for i in range(cfg.n_layers)]
        self.rotary = Rotary(cfg)
        self.softmax_scale = softmax_scale(cfg)
        # the compiled step (kernels.model.compiled_step) where it applies; False: the reference step
        # always (tests compare the two)
        self.use_compiled = True
        self._compiled: CompiledStep | None = None
        self._compiled_why: str | None = None  # why the compiled step does not apply, once decided
        # weights past this many bytes are read once per step for all rows (kernels.model.once_product);
        # set before the first step (tests set 0: every product that way, the same bits)
        self.once_bytes = THREADED_BYTES

    def dims_for_file(self) -> tuple[int, int, int, int, int, int]:
        """(n_layers, kv_lora, qk_rope, index_head_dim, n_index_layers, vocab) of this model's .coli_kv."""
        return self.config.file_dims

    def new_cache(self, kv_dtype: str = "f32", backend: str | Any = "cpu") -> DecoderCache:
        n_layers, kv_lora, rope, index_dim, n_index, _ = self.dims_for_file()
        return DecoderCache(n_layers, kv_lora, rope, kv_dtype, backend, n_index_layers=n_index,
                            index_head_dim=index_dim)

    def cache_from_blocks(
        self,
        per_layer_blocks: Sequence[Sequence[LatentRows]],
        tokens: np.ndarray,
        *,
        kv_dtype: str | None = None,
        backend: str | Any = "cpu",
        index_rows: np.ndarray | None = None,
    ) -> DecoderCache:
        """A cache resuming over existing rows (zero copy), checked against this model's dims.

        ``index_rows`` [T, n_index_layers, index_head_dim] f32: the indexer keys of a DSA model (a view
        of the file's Ic rows, not copied); a model without an indexer takes none.
        """
        n_layers, kv_lora, rope, index_dim, n_index, _ = self.dims_for_file()
        if len(per_layer_blocks) != n_layers:
            raise ModelMismatchError(f"{len(per_layer_blocks)} layers of rows for a {n_layers}-layer model")
        cache = DecoderCache.from_blocks(
            per_layer_blocks, tokens, kv_lora=kv_lora, qk_rope=rope, kv_dtype=kv_dtype, backend=backend,
            index_rows=index_rows, n_index_layers=n_index, index_head_dim=index_dim,
        )
        self.check_tokens(cache.tokens)
        return cache

    def check_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """tokens as [S] i32, refusing ids outside the vocabulary."""
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise FormatError(f"tokens must be a 1-D integer array, found {arr.dtype} {arr.shape}")
        bad = np.nonzero((arr < 0) | (arr >= self.config.vocab_size))[0]
        if bad.size:
            i = int(bad[0])
            raise FormatError(
                f"token id {int(arr[i])} at index {i} is outside the vocabulary [0, {self.config.vocab_size})"
            )
        return arr.astype("<i4")

    def check_room(self, cache: DecoderCache, n: int) -> None:
        """Refuse a cache of other dimensions, or ``n`` more positions past the context."""
        dims = (cache.n_layers, cache.kv_lora, cache.qk_rope, cache.index_head_dim, cache.n_index_layers)
        if dims != self.dims_for_file()[:5]:
            raise ModelMismatchError("this cache belongs to a model with other dimensions")
        if cache.length + n > self.config.max_position_embeddings:
            raise LimitError(f"positions up to {cache.length + n} exceed the model's context of "
                             f"{self.config.max_position_embeddings}")

    def forward(self, tokens: np.ndarray, cache: DecoderCache) -> np.ndarray:
        """Run ``tokens`` [S] at positions [cache.length, +S); returns logits [S, vocab] f32.

        Every position is computed as a decode step of that token alone computes it (:meth:`step`),
        so a prompt's rows, and so a session's tokens, are bitwise the same whether the prompt is
        fed in one piece, in chunks of any size or token by token, alone or beside other sessions.
        The last position's logits are the step's too (bitwise); the earlier positions' come from
        one product over their rows (close, not bitwise: nothing is sampled from them)."""
        toks = self.check_tokens(tokens)  # [S] i32
        n = toks.shape[0]
        if n == 0:
            raise FormatError("forward needs at least one token")
        if n == 1:
            return self.decode_step([cache], toks)
        self.check_room(cache, n)
        h, _ = self._run_rows([cache], toks, [n])  # h: [S, hidden] f32, final-normed
        logits = np.empty((n, self.config.vocab_size), np.float32)  # logits: [S, V] f32
        np.matmul(h[:-1], self.lm_head.T, out=logits[:-1])
        logits[-1:] = rowwise_linear(h[-1:], self.lm_head)  # [1, V]: the step's arithmetic
        return logits

    def decode_step(self, caches: Sequence[DecoderCache], tokens: np.ndarray) -> np.ndarray:
        """One decode step of B sessions at once: token b at position caches[b].length of cache b;
        returns logits [B, vocab] f32 (:meth:`step` with one token per cache)."""
        n = np.asarray(tokens).reshape(-1).shape[0]
        if n != len(caches) or not caches:
            raise FormatError(f"decode_step: {n} tokens for {len(caches)} caches")
        return self.step(caches, tokens, [1] * len(caches))

    def step(self, caches: Sequence[DecoderCache], tokens: np.ndarray, counts: Sequence[int]) -> np.ndarray:
        """One batched step in which cache b takes ``counts[b]`` new tokens (its run of ``tokens``
        [N] in order: 1 for a decode token, more for a prefill chunk); returns the logits [B, vocab]
        f32 of each cache's last new position.

        Batch-invariant: each row is bitwise what a decode step of that token alone gives, whoever
        shares the step and however large it is. Every projection, the MoE and lm_head run row by
        row in one call over all N rows (:mod:`kernels.model.rowwise`); the cache writes, the
        indexer's selection and attention run per row over the rows before it
        (:class:`~kernels.model.step_rows.StepPosition`)."""
        toks = self.check_tokens(tokens)  # [N] i32
        counts = [int(c) for c in counts]
        if len(counts) != len(caches) or not caches:
            raise FormatError(f"step: {len(counts)} token counts for {len(caches)} caches")
        if min(counts) < 1 or sum(counts) != toks.shape[0]:
            raise FormatError(f"step: {toks.shape[0]} tokens for token counts {counts}")
        if len({id(c) for c in caches}) != len(caches):
            raise FormatError("step: a cache appears twice in one batch")
        for cache, count in zip(caches, counts, strict=True):
            self.check_room(cache, count)
        h, logits = self._run_rows(caches, toks, counts)  # h: [N, hidden] f32, final-normed
        if logits is not None:  # the compiled step's (bitwise rowwise_linear's)
            return logits
        return rowwise_linear(h[last_rows(counts)], self.lm_head)  # [B, V] f32

    def compiled_step(self) -> CompiledStep | None:
        """This model's compiled step (its weights packed on first use), or None where
        :func:`~kernels.model.packed_weights.packable` refuses it."""
        if self._compiled is None and self._compiled_why is None:
            self._compiled_why = packable(self)
            if self._compiled_why is None:
                self._compiled = CompiledStep(pack(self, self.once_bytes))
        return self._compiled

    def _run_rows(self, caches: Sequence[DecoderCache], toks: np.ndarray,
                  counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """Every layer over the step's rows (cache b's ``counts[b]`` tokens in order); commits them
        to the caches, or discards every pending row if anything raises. (h [N, hidden] f32,
        final-normed; the logits [B, vocab] f32 of each cache's last row when the compiled step
        ran, else None.)"""
        compiled = self.compiled_step() if self.use_compiled else None
        logits = None
        try:
            tables = StepTables.of(caches, counts, COMPILED_KINDS) if compiled is not None else None
            if compiled is not None and tables is not None:  # every cache fp8 (or f32) on the CPU: one call
                cos, sin = self.rotary.cos_sin(tables.visible - 1)  # [N, rope/2] f32 each, at each row's position
                h, logits = compiled.run(self.embed[toks].astype(np.float32), cos, sin, tables, last_rows(counts))
            else:
                rows = step_rows_of(caches, counts)
                cos, sin = self.rotary.cos_sin(np.array([row.length for row in rows]))  # [N, rope/2] f32 each
                h = self._step_layers(self.embed[toks].astype(np.float32), cos, sin, rows,
                                      StepTables.of(caches, counts))  # h: [N, hidden] f32
            start = 0
            for cache, count in zip(caches, counts, strict=True):
                cache.commit_positions(toks[start : start + count])
                start += count
        except BaseException:
            for cache in caches:
                cache.discard_pending()
            raise
        if logits is not None:
            return h, logits
        return rms_norm(h, self.final_norm, self.config.rms_norm_eps), None

    def _step_layers(self, h: np.ndarray, cos: np.ndarray, sin: np.ndarray, caches: Sequence[StepRow],
                     tables: StepTables | None) -> np.ndarray:
        """Every layer over the step's rows (one new position each): h [B, hidden] f32; ``tables``: the
        step's address tables (fp8 caches on the CPU: every session's rows written, selected and
        attended in one call per layer), or None (the session-by-session loop)."""
        # what one layer leaves for the next: the tables, a DSA model's selections
        step: dict[str, Any] = {"tables": tables}
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, self.config.rms_norm_eps)
            q = self._project_step(i, layer.attn, x, cos, sin, caches, step)
            ctx = self._attend_step(i, x, q, cos, sin, caches, step)  # ctx: [B, H, kv_lora] f32
            h = h + self._attention_output(layer.attn, ctx)
            x = rms_norm(h, layer.post_norm, self.config.rms_norm_eps)
            h = h + layer.mlp(x, rowwise=True)
        return h

    def _attend_step(self, layer: int, x: np.ndarray, q: Queries, cos: np.ndarray, sin: np.ndarray,
                     caches: Sequence[StepRow], step: dict[str, Any]) -> np.ndarray:
        """Each row's query over the rows its selection names (:meth:`_select_tables`,
        :meth:`_select_rows`), every row it sees without one -> ctx [B, H, kv_lora] f32."""
        tables: StepTables | None = step["tables"]
        if tables is not None:  # every session in one call per layer
            sel, counts = self._select_tables(layer, x, q, cos, sin, tables, step)
            return tables.attend(layer, q.q_abs, q.q_rope, sel, counts, self.softmax_scale)
        selections = self._select_rows(layer, x, q, cos, sin, caches, step)
        return attend_rows_of(layer, q.q_abs, q.q_rope, caches, selections, self.softmax_scale, step)

    def _select_tables(self, layer: int, x: np.ndarray, q: Queries, cos: np.ndarray, sin: np.ndarray,
                       tables: StepTables, step: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """The rows each row attends (selection [B, k] i64 ascending, counts [B] i64): all it sees
        (a DSA decoder selects); made once a step."""
        if "selected" not in step:
            step["selected"] = all_visible(tables.visible)
        selected: tuple[np.ndarray, np.ndarray] = step["selected"]
        return selected

    def _select_rows(self, layer: int, x: np.ndarray, q: Queries, cos: np.ndarray, sin: np.ndarray,
                     caches: Sequence[StepRow], step: dict[str, Any]) -> dict[int, np.ndarray]:
        """{b: selection [1, k] i64} of the rows that attend a selection: none here (a DSA decoder selects)."""
        return {}

    def _project_step(self, layer_idx: int, a: MLAttention, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                      caches: Sequence[StepRow], step: dict[str, Any]) -> Queries:
        """The queries of the step's rows (row by row); writes each row's Lc/Rc row to its cache
        (through the step's tables in one call when it has them)."""
        q, lc, rc = self._queries(a, x, cos, sin)
        tables: StepTables | None = step["tables"]
        if tables is not None:
            tables.write_rows(layer_idx, lc, rc)
        else:
            write_step_rows(caches, layer_idx, lc, rc)
        return q

    def _queries(self, a: MLAttention, x: np.ndarray, cos: np.ndarray,
                 sin: np.ndarray) -> tuple[Queries, np.ndarray, np.ndarray]:
        """x [S, hidden] -> (the absorbed queries, lc [S, kv_lora], rc [S, rope]) f32."""
        c = self.config
        n, heads = x.shape[0], c.num_attention_heads
        q_lat = None
        if a.q_proj is not None:
            q = _linear(x, a.q_proj)  # q: [S, H*qk_head]
        else:
            assert a.q_a is not None and a.q_a_norm is not None and a.q_b is not None  # q_lora layers have all three
            q_lat = rms_norm(_linear(x, a.q_a, a.q_a_bias), a.q_a_norm, 1e-6)  # [S, q_lora]
            q = _linear(q_lat, a.q_b)  # q: [S, H*qk_head]
        q = q.reshape(n, heads, c.qk_head_dim)
        q_nope, q_rot = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]  # [S,H,nope], [S,H,rope]
        compressed = _linear(x, a.kv_a, a.kv_a_bias)  # [S, kv_lora + rope]
        lc = rms_norm(compressed[:, : c.kv_lora_rank], a.kv_a_norm, 1e-6)  # lc: [S, kv_lora] f32
        rc = self.rotary.apply(compressed[:, c.kv_lora_rank :], cos, sin)  # rc: [S, rope] f32
        q_rope = self.rotary.apply(q_rot, cos, sin)  # [S, H, rope] f32
        q_abs = head_matmul(q_nope, a.w_uk, True)  # [S, H, kv_lora]
        return Queries(np.ascontiguousarray(q_abs), q_rope, q_lat), lc, rc

    def _attention_output(self, a: MLAttention, ctx: np.ndarray) -> np.ndarray:
        """ctx [S, H, kv_lora] -> W_UV per head, then o_proj: [S, hidden]."""
        n, heads = ctx.shape[0], self.config.num_attention_heads
        out = head_matmul(ctx, a.w_uv, True, w_transposed=True)  # [S, H, v_head]
        out = out.reshape(n, heads * self.config.v_head_dim)  # [S, H*v_head]
        return _linear(out, a.o_proj, a.o_bias)  # [S, hidden]
