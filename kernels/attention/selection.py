"""DSA row selection: the indexer's scores over every cached key, then the engine's top-k.

Per query s at absolute position p (queries at ``first_pos`` .. ``first_pos + S - 1``) and key t <= p:
    score_t = sum_h w_h * relu((qi_h . Ic_t) * hd ** -0.5)
where ``qi`` [S, nh, hd] are the indexer queries (RoPE applied) and ``w`` [S, nh] the head weights
(``weights_proj @ x`` times ``nh ** -0.5``). Keys later than p score -inf. The positive factor
``hd ** -0.5`` is applied to the weights (relu(a * c) = c * relu(a) for c > 0): one pass fewer over
the [nh, T] logits, at the cost of a last-bit difference from multiplying each logit.

Top-k, the colibri engine's tie rule: threshold = the k-th largest score; the positions scoring
above it are taken, then those equal to it in ascending position order until k are taken. The
selection is returned as ascending absolute positions. A NaN score counts as -inf when selecting.

The keys are walked in tiles of ``KEY_TILE`` rows at absolute positions: a tile inside one block
is read in place (a strided file view included), a tile that straddles blocks is gathered first,
so every score comes from the same products however the keys are split into blocks.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernels.errors import FormatError

KEY_TILE = 4096  # keys per scoring tile: logits [nh, tile] of one query stay in L2
SCORE_BUDGET_BYTES = 32 << 20  # per query chunk: scores [c, T] + logits [c*nh, tile]


def _key_tiles(key_blocks: Sequence[np.ndarray], stop: int, head_dim: int) -> list[tuple[int, np.ndarray]]:
    """(start, keys [n, hd] f32) tiles covering positions [0, stop) at multiples of KEY_TILE."""
    starts = np.cumsum([0] + [b.shape[0] for b in key_blocks])  # starts: [nblocks + 1]
    tiles: list[tuple[int, np.ndarray]] = []
    for a in range(0, stop, KEY_TILE):
        b = min(a + KEY_TILE, stop)
        first = int(np.searchsorted(starts, a, side="right")) - 1
        if b <= starts[first + 1]:  # inside one block: a view
            tiles.append((a, key_blocks[first][a - starts[first] : b - starts[first]]))
            continue
        gathered = np.empty((b - a, head_dim), np.float32)  # gathered: [n, hd] f32
        for i in range(first, len(key_blocks)):
            lo, hi = max(a, int(starts[i])), min(b, int(starts[i + 1]))
            if lo < hi:
                gathered[lo - a : hi - a] = key_blocks[i][lo - starts[i] : hi - starts[i]]
        tiles.append((a, gathered))
    return tiles


def index_scores(qi: np.ndarray, weights: np.ndarray, key_blocks: Sequence[np.ndarray], first_pos: int) -> np.ndarray:
    """Indexer scores of queries qi [S, nh, hd] (weights [S, nh]) over keys [0, first_pos + S) -> [S, T] f32."""
    n_q, nh, hd = qi.shape
    length = sum(int(b.shape[0]) for b in key_blocks)
    stop = first_pos + n_q
    if first_pos < 0 or stop > length or weights.shape != (n_q, nh):
        raise FormatError(f"index_scores: {n_q} queries from position {first_pos} over {length} keys,"
                          f" weights {weights.shape}")
    if any(b.ndim != 2 or b.shape[1] != hd or b.dtype != np.float32 for b in key_blocks):
        raise FormatError(f"index_scores: key blocks must be float32 [t, {hd}]")
    w = (np.asarray(weights, dtype=np.float32) * np.float32(hd**-0.5))[:, :, None]  # w: [S, nh, 1] f32
    q2t = np.ascontiguousarray(np.asarray(qi, dtype=np.float32).reshape(n_q * nh, hd).T)  # q2t: [hd, S*nh] f32
    scores = np.empty((n_q, stop), np.float32)  # scores: [S, T] f32
    for a, keys in _key_tiles(key_blocks, stop, hd):
        logits = keys @ q2t  # logits: [n, S*nh] f32 (keys as the tall operand: the faster GEMM shape)
        np.maximum(logits, np.float32(0), out=logits)  # relu
        per_query = logits.reshape(-1, n_q, nh).transpose(1, 0, 2)  # per_query: [S, n, nh] view
        scores[:, a : a + keys.shape[0]] = np.matmul(per_query, w)[:, :, 0]  # [S, n] f32
    for s in range(n_q):
        scores[s, first_pos + s + 1 :] = -np.inf  # keys after the query
    return scores


def engine_topk(scores: np.ndarray, first_pos: int, k: int) -> np.ndarray:
    """The engine's top-k of each row of ``scores`` [S, T] (query s sees keys <= first_pos + s, more than k
    of them) -> selection [S, k] i64, ascending positions; ties at the threshold go to lower positions."""
    n_q, length = scores.shape
    if n_q and (k < 1 or first_pos + 1 <= k or first_pos + n_q > length):
        raise FormatError(f"engine_topk: k={k} rows for queries at {first_pos}..{first_pos + n_q - 1}"
                          f" over {length} keys (each needs more than k visible keys)")
    clean = np.array(scores, dtype=np.float32)  # clean: [S, T] f32, NaN and future keys at -inf
    if np.isnan(clean).any():
        clean[np.isnan(clean)] = -np.inf
    for s in range(n_q):
        clean[s, first_pos + s + 1 :] = -np.inf
    thr = np.partition(clean, length - k, axis=1)[:, length - k]  # thr: [S] the k-th largest visible score
    above = clean > thr[:, None]  # above: [S, T] bool (fewer than k per row)
    equal = clean == thr[:, None]  # equal: [S, T] bool
    for s in range(n_q):
        equal[s, first_pos + s + 1 :] = False  # a -inf threshold must not take a future key
    need = k - above.sum(axis=1)  # need: [S] ties to take
    if np.array_equal(equal.sum(axis=1), need):  # no surplus tie (the usual case): take them all
        take = above | equal  # take: [S, T] bool, k per row
    else:
        take = above | (equal & (np.cumsum(equal, axis=1) <= need[:, None]))
    return np.nonzero(take)[1].reshape(n_q, k).astype(np.int64)


def select_rows(qi: np.ndarray, weights: np.ndarray, key_blocks: Sequence[np.ndarray], first_pos: int,
                k: int) -> np.ndarray:
    """Scores + engine top-k for queries at ``first_pos``.. (each seeing more than k keys) -> [S, k] i64,
    in query chunks so that the scores stay within SCORE_BUDGET_BYTES."""
    n_q, nh = qi.shape[:2]
    stop = first_pos + n_q
    per_query = (stop + nh * min(KEY_TILE, stop)) * 4 * 3  # scores, logits and the top-k masks
    chunk = max(1, SCORE_BUDGET_BYTES // per_query)
    out = np.empty((n_q, k), np.int64)  # out: [S, k] i64
    for s0 in range(0, n_q, chunk):
        s1 = min(s0 + chunk, n_q)
        scores = index_scores(qi[s0:s1], weights[s0:s1], key_blocks, first_pos + s0)  # [c, first_pos + s1]
        out[s0:s1] = engine_topk(scores, first_pos + s0, k)
    return out
