"""Attention over the latent cache (numpy, CPU): the public entry points of the package.

- ``absorbed_attention(q_abs, q_rope, blocks, softmax_scale, *, causal=True)`` -> ctx [S,H,kv_lora]
  (kernels.attention.absorbed): the engine's absorbed MLA over f32 or fp8 rows, scales hoisted.
- ``mla_attention(q_nope, q_rope, blocks, w_uk, w_uv, softmax_scale, *, causal=True, path="auto")``
  -> out [S,H,v_head] (kernels.attention.mla): absorbed or expanded through kv_b, by a cost model.

Inside: ``absorbed`` (absorbed MLA, online softmax), ``mla`` (absorbed or expanded, cost model),
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

__all__ = [
    "DEFAULT_TILE_ROWS",
    "SCRATCH_LIMIT_BYTES",
    "absorbed_attention",
    "absorbed_scratch_bytes",
    "attention_flops",
    "choose_path",
    "expanded_attention",
    "mla_attention",
]
