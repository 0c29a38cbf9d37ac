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
from kernels.errors import UnsupportedModelError
from kernels.model.config import ModelConfig
from kernels.model.decoder import MLADecoder, Queries
from kernels.model.decoder_layers import Weights
from kernels.model.glm_config import DsaConfig
from kernels.model.glm_indexer import Indexer
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

    def _select_tables(self, layer: int, x: np.ndarray, q: Queries, cos: np.ndarray, sin: np.ndarray,
                       tables: StepTables, step: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """A full layer's :meth:`_select_rows` for the whole batch in two calls: writes its key of every
        row, then each row's selection [B, k] i64 and count [B] (all it sees, up to ``index_topk``);
        a shared layer reuses the last full layer's."""
        if self.dsa.is_full(layer):
            step["selected"] = self._select_full_tables(layer, x, q, cos, sin, tables)
        selected: tuple[np.ndarray, np.ndarray] = step["selected"]  # a full layer precedes every shared one
        return selected

    def _select_full_tables(self, layer: int, x: np.ndarray, q: Queries, cos: np.ndarray, sin: np.ndarray,
                            tables: StepTables) -> tuple[np.ndarray, np.ndarray]:
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

    def _select_rows(self, layer: int, x: np.ndarray, q: Queries, cos: np.ndarray, sin: np.ndarray,
                     caches: Sequence[StepRow], step: dict[str, Any]) -> dict[int, np.ndarray]:
        """{b: selection [1, k] i64} of the rows that see more than ``index_topk`` rows: a full layer
        writes each row's key and selects (:meth:`_select_step`), a shared layer reuses its selections."""
        if self.dsa.is_full(layer):
            step["selections"] = self._select_step(layer, x, q, cos, sin, caches)
        selections: dict[int, np.ndarray] = step["selections"]  # a full layer precedes every shared one
        return selections

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
