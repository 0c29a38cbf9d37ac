"""The reference GLM-5.x (``glm_moe_dsa``) decoder: MLA + MoE as DeepSeek-V3, plus DSA sparse attention.

Per step (prefill and decode alike: every forward is a batched step, :meth:`MLADecoder.step`), in
every full layer the indexer's key of each new position is written to the cache (the file's Ic
row); then each query whose context (position + 1) exceeds ``index_topk`` selects its
``index_topk`` rows (kernels.attention.select_step, the engine's tie rule) and attends only those
(``sparse_absorbed_attention``). Queries with a shorter context attend every row (dense absorbed
attention), as transformers' ``min(topk, T)`` does. Shared layers compute no indexer: they reuse
the selection of the most recent full layer of the same step.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels.attention.select_step import select_step
from kernels.attention.tiles import cache_shape
from kernels.errors import BackendUnavailableError, UnsupportedModelError
from kernels.model.compiled_step import CompiledStep
from kernels.model.config import ModelConfig
from kernels.model.decoder import MLADecoder, Queries, Weights
from kernels.model.glm_config import DsaConfig
from kernels.model.glm_indexer import Indexer
from kernels.model.packed_weights import pack, packable
from kernels.model.rowwise import THREADED_BYTES
from kernels.model.step_rows import StepRow
from kernels.model.step_tables import StepTables


class GlmDecoder(MLADecoder):
    """A loaded ``glm_moe_dsa`` model; its caches carry one indexer key per position per full layer
    (``dims_for_file()`` = ``config.file_dims`` names index_head_dim and the number of full layers)."""

    def __init__(self, config: ModelConfig, weights: Weights, source: str = "") -> None:
        if config.dsa is None:
            raise UnsupportedModelError(f"GlmDecoder: model_type {config.model_type!r} has no DSA indexer")
        super().__init__(config, weights, source)
        self.dsa: DsaConfig = config.dsa
        self.indexers = {i: _load_indexer(config, self.dsa, weights, i) for i in self.dsa.full_layers}
        self.index_slots = {layer: slot for slot, layer in enumerate(self.dsa.full_layers)}
        self._compiled: CompiledStep | None = None
        self._compiled_why: str | None = None  # why the compiled step does not apply, once decided
        # weights past this many bytes are read once per step for all rows (kernels.model.once_product);
        # set before the first step (tests set 0: every product that way, the same bits)
        self.once_bytes = THREADED_BYTES

    def compiled_step(self) -> CompiledStep | None:
        """The compiled step of this model (its weights packed on first use), or None where
        :func:`~kernels.model.packed_weights.packable` refuses it."""
        if self._compiled is None and self._compiled_why is None:
            self._compiled_why = packable(self)
            if self._compiled_why is None:
                self._compiled = CompiledStep(pack(self, self.once_bytes))
        return self._compiled

    def _attend_step(self, layer: int, x: np.ndarray, q: Queries, cos: np.ndarray, sin: np.ndarray,
                     caches: Sequence[StepRow], step: dict[str, Any]) -> np.ndarray:
        """One new position per cache: a full layer writes each cache's indexer key and selects rows
        for every session past ``index_topk`` (shared layers reuse that selection); those attend
        their selected rows, the others every row (all of them are selected). Sessions of a backend
        that batches the step attend in one call per row count; others session by session. Each
        session over its own rows -> [B, H, kv_lora]."""
        tables: StepTables | None = step["tables"]
        if tables is not None:  # every session in one call per layer
            if self.dsa.is_full(layer):
                step["selected"] = self._select_tables(layer, x, q, cos, sin, tables)
            sel, counts = step["selected"]
            return tables.attend(layer, q.q_abs, q.q_rope, sel, counts, self.softmax_scale)
        if self.dsa.is_full(layer):
            step["selections"] = self._select_step(layer, x, q, cos, sin, caches)
        selections: dict[int, np.ndarray] = step["selections"]  # a full layer precedes every shared one
        ctx = np.empty(q.q_abs.shape, np.float32)  # ctx: [B, H, kv_lora] f32
        groups: dict[tuple[int, type], list[int]] = {}  # (rows attended, backend) -> the batch rows
        for b, cache in enumerate(caches):
            if hasattr(cache.backend, "batched_sparse_decode"):
                k = selections[b].shape[1] if b in selections else cache.length + 1
                groups.setdefault((k, type(cache.backend)), []).append(b)
            elif b in selections:
                ctx[b : b + 1] = self._sparse_of(cache.backend)(q.q_abs[b : b + 1], q.q_rope[b : b + 1],
                                                                cache.blocks(layer), selections[b], self.softmax_scale)
            else:
                ctx[b : b + 1] = cache.backend.absorbed_attention(q.q_abs[b : b + 1], q.q_rope[b : b + 1],
                                                                  cache.blocks(layer), self.softmax_scale, causal=True)
        shapes: dict[tuple[int, ...], list[Any]] = step.setdefault("shapes", {})
        for (k, _), members in groups.items():
            rows = np.asarray(members)  # rows: [n] batch rows
            blocks_of = [caches[b].blocks(layer) for b in members]
            key = tuple(members)
            if key not in shapes:  # every layer of a cache holds as many rows: described once a step
                shapes[key] = [cache_shape(blocks) for blocks in blocks_of]
            picks = [selections[b][0] if b in selections else np.arange(k) for b in members]  # [k] i64 each
            ctx[rows] = caches[members[0]].backend.batched_sparse_decode(
                q.q_abs[rows], q.q_rope[rows], blocks_of, picks, self.softmax_scale, shapes=shapes[key])
        return ctx

    def _select_tables(self, layer: int, x: np.ndarray, q: Queries, cos: np.ndarray, sin: np.ndarray,
                       tables: StepTables) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_select_step` for the whole batch in two calls: writes this full layer's key of every
        row, then each row's selection [B, k] i64 and count [B] (all it sees, up to ``index_topk``)."""
        indexer, slot, k = self.indexers[layer], self.index_slots[layer], self.dsa.index_topk
        keys = indexer.keys(x, self.rotary, cos, sin, rowwise=True)  # keys: [B, hd] f32
        tables.write_keys(slot, keys)
        if tables.any_past(k):
            assert q.q_resid is not None  # a GLM config always has q_lora (glm_config refuses it otherwise)
            qi, w = indexer.queries(x, q.q_resid, self.rotary, cos, sin, rowwise=True)  # [B, nh, hd], [B, nh]
        else:  # nobody scores: every row attends all it sees
            qi = np.zeros((x.shape[0], indexer.n_heads, indexer.head_dim), np.float32)
            w = np.zeros((x.shape[0], indexer.n_heads), np.float32)
        return tables.select(slot, qi, w, k)

    def _select_step(self, layer: int, x: np.ndarray, q: Queries, cos: np.ndarray, sin: np.ndarray,
                     caches: Sequence[StepRow]) -> dict[int, np.ndarray]:
        """Write this full layer's key of each cache's new position; {b: selection [1, k] i64} for
        the caches whose new position sees more than ``index_topk`` rows."""
        indexer, slot = self.indexers[layer], self.index_slots[layer]
        keys = indexer.keys(x, self.rotary, cos, sin, rowwise=True)  # keys: [B, hd] f32
        for b, cache in enumerate(caches):
            cache.write_index_row(slot, keys, b)
        past = [b for b, cache in enumerate(caches) if cache.length >= self.dsa.index_topk]
        if not past:
            return {}
        assert q.q_resid is not None  # a GLM config always has q_lora (glm_config refuses it otherwise)
        qi, w = indexer.queries(x, q.q_resid, self.rotary, cos, sin, rowwise=True)  # [B, nh, hd], [B, nh]
        rows = np.asarray(past)  # rows: [n] batch rows past index_topk
        chosen = select_step(qi[rows], w[rows], [caches[b].index_blocks(slot) for b in past],
                             self.dsa.index_topk)  # chosen: [n, k] i64
        return {b: chosen[i : i + 1] for i, b in enumerate(past)}

    @staticmethod
    def _sparse_of(backend: Any) -> Any:
        sparse = getattr(backend, "sparse_absorbed_attention", None)
        if sparse is None:
            name = getattr(backend, "name", type(backend).__name__)
            raise BackendUnavailableError(f"the {name!r} backend has no sparse_absorbed_attention (DSA)")
        return sparse


def _load_indexer(cfg: ModelConfig, dsa: DsaConfig, w: Weights, i: int) -> Indexer:
    p = f"model.layers.{i}.self_attn.indexer."
    nh, hd = dsa.index_n_heads, dsa.index_head_dim
    assert cfg.q_lora_rank is not None  # glm_config refuses a GLM config without q_lora
    return Indexer(
        wq_b=w.get(p + "wq_b.weight", (nh * hd, cfg.q_lora_rank)),
        wk=w.get(p + "wk.weight", (hd, cfg.hidden_size)),
        k_norm_weight=w.get(p + "k_norm.weight", (hd,)),
        k_norm_bias=w.get(p + "k_norm.bias", (hd,)),
        weights_proj=w.get(p + "weights_proj.weight", (nh, cfg.hidden_size)),
        n_heads=nh,
        head_dim=hd,
    )
