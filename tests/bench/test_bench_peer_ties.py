"""bench/peer_ties.py: llama.cpp's top-k tie rule, checked against libstdc++'s own std::partial_sort."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.peer_ties import TieCount, greedy_with_heap_ties, heap_select_step, heap_topk
from kernels.attention.select_step import select_step

# ggml-cpu's top-k, as llama.cpp runs it: indices 0..n-1, std::partial_sort with scores[a] > scores[b]
_ORACLE = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
int main() {
    int n, k;
    while (std::scanf("%d %d", &n, &k) == 2) {
        std::vector<float> s(n);
        std::vector<int> idx(n);
        for (int i = 0; i < n; i++) { std::scanf("%f", &s[i]); idx[i] = i; }
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) { return s[a] > s[b]; });
        std::sort(idx.begin(), idx.begin() + k);
        for (int i = 0; i < k; i++) std::printf("%d ", idx[i]);
        std::printf("\n");
    }
}
"""


@pytest.fixture(scope="module")
def partial_sort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The oracle, compiled with the system's C++ compiler (g++, as .ci/run installs)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx is not None, "no C++ compiler: .ci/run installs g++"
    d = tmp_path_factory.mktemp("partial_sort")
    (d / "oracle.cpp").write_text(_ORACLE)
    subprocess.run([cxx, "-O1", "-o", str(d / "oracle"), str(d / "oracle.cpp")], check=True)
    return d / "oracle"


def _oracle(binary: Path, cases: list[tuple[np.ndarray, int]]) -> list[list[int]]:
    text = "".join(f"{len(s)} {k} " + " ".join(repr(float(v)) for v in s) + "\n" for s, k in cases)
    out = subprocess.run([str(binary)], input=text, capture_output=True, text=True, check=True).stdout
    return [[int(t) for t in line.split()] for line in out.splitlines()]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_heap_topk_is_libstdcxx_partial_sort(partial_sort: Path, data: st.DataObject) -> None:
    """Scores drawn from a few values (ties everywhere, zeros among them, as the ReLU leaves them): the
    kept set is exactly libstdc++'s, for even and odd k, k = 1 and k = n."""
    cases = []
    for _ in range(8):
        n = data.draw(st.integers(1, 90))
        k = data.draw(st.integers(1, n))
        s = np.array(data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.5, 1.25, -2.0]), min_size=n, max_size=n)),
                     np.float32)
        cases.append((s, k))
    want = _oracle(partial_sort, cases)
    assert [heap_topk(s, k).tolist() for s, k in cases] == want


def test_heap_topk_differs_from_the_engines_rule_only_at_ties() -> None:
    """Distinct scores: the k largest, whatever the rule; ties at the threshold: not the lowest positions."""
    rng = np.random.default_rng(3)
    s = rng.standard_normal(200).astype(np.float32)
    assert heap_topk(s, 32).tolist() == sorted(np.argsort(-s)[:32].tolist())
    zeros = np.zeros(64, np.float32)
    zeros[[5, 40]] = 1.0
    kept = heap_topk(zeros, 8)
    assert {5, 40} <= set(kept.tolist()) and kept.tolist() != [0, 1, 2, 3, 4, 5, 6, 40]
    with pytest.raises(ValueError, match="k=0"):
        heap_topk(s, 0)


def test_the_stand_in_selects_what_select_step_selects_without_ties() -> None:
    """Same arguments as select_step and, on keys whose scores do not tie, the same rows: only the tie rule
    is substituted."""
    rng = np.random.default_rng(0)
    nh, hd, k = 4, 32, 8
    qi = rng.standard_normal((3, nh, hd)).astype(np.float32)
    w = np.abs(rng.standard_normal((3, nh))).astype(np.float32)  # positive weights: no negative cancellations
    blocks = [[rng.standard_normal((n, hd)).astype(np.float32)] for n in (20, 33, 50)]
    count = TieCount()
    got = heap_select_step(count)(qi, w, blocks, k)
    assert np.array_equal(got, select_step(qi, w, blocks, k))
    assert count.rows == 3 and count.changed == 0


def test_greedy_with_heap_ties_runs_the_substituted_selection() -> None:
    """On glm-mini the substitution is where the reference decoder selects (rows are counted)."""
    from kernels.model import resolve_model

    tokens, count = greedy_with_heap_ties(resolve_model("glm-mini"), [list(range(40, 80))], 3)
    assert len(tokens) == 1 and len(tokens[0]) == 3
    assert count.rows >= 40 - 32 + 3  # every position past index_topk, each full layer at least once
