"""The batch's routed experts in two compiled calls (kernels.model.moe_step): bitwise the
expert-by-expert path, and row b the same alone or in any batch."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.model.config import parse_config
from kernels.model.moe import DenseMLP, MoE
from kernels.model.moe_step import StackedExperts
from kernels.model.tiny import tiny_config_dict

HIDDEN, INNER, EXPERTS = 48, 40, 8


def moe(seed: int, shared: bool = True) -> MoE:
    rng = np.random.default_rng(seed)

    def mlp() -> DenseMLP:
        return DenseMLP(*(rng.standard_normal(s).astype(np.float32) * 0.2
                          for s in ((INNER, HIDDEN), (INNER, HIDDEN), (HIDDEN, INNER))))

    cfg = parse_config({**tiny_config_dict(), "n_routed_experts": EXPERTS, "num_experts_per_tok": 3, "n_group": 2,
                        "topk_group": 2}, source="test")
    gate = rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32)
    bias = rng.standard_normal(EXPERTS).astype(np.float32) * 0.1
    return MoE(cfg, gate, bias, [mlp() for _ in range(EXPERTS)], mlp() if shared else None)


def expert_by_expert(m: MoE, x: np.ndarray) -> np.ndarray:
    """The loop MoE runs when the stacked kernel does not apply (written out: experts ascending)."""
    from kernels.model.moe import route

    weights, chosen = route(x, m.gate_w, m.bias, m.cfg, rowwise=True)
    out = np.zeros_like(x)
    for expert in np.unique(chosen):
        tok, slot = np.nonzero(chosen == expert)
        out[tok] += m.experts[int(expert)](x[tok], rowwise=True) * weights[tok, slot][:, None]
    return out + m.shared(x, rowwise=True) if m.shared is not None else out


@pytest.mark.parametrize("shared", [True, False])
def test_stacked_experts_are_bitwise_the_expert_loop(shared: bool) -> None:
    m = moe(0, shared)
    x = np.random.default_rng(1).standard_normal((16, HIDDEN)).astype(np.float32)
    assert StackedExperts.fits(m.experts)
    assert np.array_equal(m(x, rowwise=True), expert_by_expert(m, x))


def test_a_row_is_the_same_alone_or_in_any_batch() -> None:
    m = moe(2)
    x = np.random.default_rng(3).standard_normal((11, HIDDEN)).astype(np.float32)
    batch = m(x, rowwise=True)
    for b in range(11):
        assert np.array_equal(m(x[b : b + 1], rowwise=True), batch[b : b + 1])
    order = np.random.default_rng(4).permutation(11)
    assert np.array_equal(m(x[order], rowwise=True), batch[order])
    assert np.allclose(batch, m(x), rtol=1e-4, atol=1e-5)  # the prefill's BLAS path: same math


def test_large_experts_keep_the_expert_loop() -> None:
    big = DenseMLP(np.zeros((4, 1024), np.float32), np.zeros((4, 1024), np.float32), np.zeros((1024, 4), np.float32))
    assert not StackedExperts.fits([big])
