"""Attention over the latent cache (numpy, CPU): the public entry points of the package.

- ``absorbed_attention(q_abs, q_rope, blocks, softmax_scale, *, causal=True)`` -> ctx [S,H,kv_lora]
  (kernels.attention.absorbed): the engine's absorbed MLA over f32 or fp8 rows, scales hoisted.
- ``mla_attention(q_nope, q_rope, blocks, w_uk, w_uv, softmax_scale, *, causal=True, path="auto")``
  -> out [S,H,v_head] (kernels.attention.mla): absorbed or expanded through kv_b, by a cost model.
- ``sparse_absorbed_attention(q_abs, q_rope, blocks, selection, softmax_scale)`` -> ctx [S,H,kv_lora]
  (kernels.attention.sparse): DSA, each query over its own selected rows [S, k] only.
- ``select_rows(qi, weights, key_blocks, first_pos, k)`` -> selection [S, k] (kernels.attention.selection):
  the DSA indexer's scores over every key and the engine's top-k (ties to lower positions).

Inside: ``absorbed`` (absorbed MLA, online softmax), ``mla`` (absorbed or expanded, cost model),
``tq`` (absorbed MLA over v3 rows in the rotated domain), ``sparse`` and ``selection`` (DSA),
``sparse_step`` and ``select_step`` (their batched decode-step forms, B sessions at once),
``tiles`` (cache tiles at absolute positions, gathered into aligned scratch) and ``tables``
(the fp8 decode tables the tiles read through).

The CUDA mirror lives in ``kernels.cuda``; ``kernels.backend.get_backend`` picks one.
"""
from __future__ import annotations

from kernels.attention.absorbed import (
    DEFAULT_TILE_ROWS,
    SCRATCH_LIMIT_BYTES,
    absorbed_attention,
    absorbed_scratch_bytes,
)
from kernels.attention.mla import attention_flops, choose_path, expanded_attention, mla_attention
from kernels.attention.selection import engine_topk, index_scores, select_rows
from kernels.attention.sparse import sparse_absorbed_attention, sparse_scratch_bytes

__all__ = [
    "DEFAULT_TILE_ROWS",
    "SCRATCH_LIMIT_BYTES",
    "absorbed_attention",
    "absorbed_scratch_bytes",
    "attention_flops",
    "choose_path",
    "engine_topk",
    "expanded_attention",
    "index_scores",
    "mla_attention",
    "select_rows",
    "sparse_absorbed_attention",
    "sparse_scratch_bytes",
]
