"""Pure session mechanics shared by :class:`Session` and the uninterrupted reference run.

Feeding policy (what makes resume bit-identical by construction): a chunk of input tokens is fed
in one forward, which computes every position as a single-token step of that token computes it
(the decoder's row invariance), so the logits that pick a token are always a single-token step's,
and resume can recompute the last position with exactly that operation over the restored rows.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kernels.errors import CorruptionError, FormatError
from kernels.model.logits import TurnDraw, turn_draw
from kernels.model.protocols import Decoder, LatentCache
from kernels.model.sampling import Sampler
from kernels.rows import RecordRows
from sessionstore.kvfile import KVReader, sanitize_scales
from sessionstore.sessions.output import TurnEnd

ROW_RTOL = 0.15  # recomputed rows vs stored ones, relative to the row's max |value| (one fp8
# step near the top of the range is up to 32/448 of it): catches a foreign cache, not noise


def feed_chunk(model: Decoder[Any], cache: LatentCache, tokens: Sequence[int] | np.ndarray,
               on_rows: Callable[[], None] | None = None) -> np.ndarray:
    """Feed ``tokens`` in one forward; returns the last position's logits [vocab].

    One forward, not the chunk's head and then its last token: every forward computes each row as a
    decode step of that token alone does (:meth:`kernels.model.MLADecoder.forward`), so the last
    position's logits are bitwise those of the split, one step sooner (a server's engine loop runs
    each forward as a step: at GLM-5.2's dims a step of one row reads every weight once more)."""
    toks = np.asarray(tokens, dtype="<i4").reshape(-1)  # [S] i32
    if toks.size == 0:
        raise FormatError("nothing to feed: at least one token is needed")
    logits = model.forward(toks, cache)[-1]  # [vocab] f32
    if on_rows is not None:
        on_rows()
    return logits


def decode_turn(model: Decoder[Any], cache: LatentCache, feed: Sequence[int] | None,
                last_logits: np.ndarray | None, max_new: int, sampler: Sampler | TurnDraw, *,
                stop_at_eos: bool = False, on_rows: Callable[[], None] | None = None,
                on_step: Callable[[int, int, np.ndarray], None] | None = None,
                drive: DecodeDriver | None = None) -> RunningTurn:
    """A turn's mechanics over a cache (called by a session's ``generate`` and by
    :func:`sessionstore.sessions.run_turn`, the one turn every front end runs): feed ``feed`` (or
    start from ``last_logits``), then sample ``max_new`` tokens with ``sampler`` (settings, or a
    :class:`TurnDraw` the caller keeps to read its log-probabilities).

    The last sampled token is returned but not fed (it is the pending token). ``on_step(token,
    position, logits)`` runs after each sample. Returns the ended :class:`RunningTurn`: its
    ``tokens``, the ``logits`` of its last fed position and its ``end`` (``TurnEnd.LENGTH`` or, with
    ``stop_at_eos``, ``TurnEnd.EOS``). The sampling is run by ``drive(turn, cache)``
    when the caller gives one (a server's engine thread steps it with every other running turn),
    else here by :func:`drive_inline`: the same forwards either way.

    Trusts its caller: ``feed``'s ids and the turn's room in the context were checked where they
    entered (the server's core, the CLI, the Session API's ``check_turn``); the model's own step
    still refuses what it cannot run.
    """
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise FormatError(f"max_new must be an integer >= 0, found {max_new!r}")
    if feed is not None:
        logits = feed_chunk(model, cache, feed, on_rows)
    elif last_logits is not None:
        logits = last_logits
    else:
        raise FormatError("nothing to continue from: the session is empty; give prompt ids")
    eos = frozenset(model.config.eos_token_ids) if stop_at_eos else frozenset()
    draw = turn_draw(sampler, frozenset(model.config.eos_token_ids))
    if draw.wants_context:
        draw.begin(cache.tokens)
    turn = RunningTurn(cache, logits, max_new, draw, eos, on_rows, on_step)
    return drive(turn, cache) if drive is not None else drive_inline(model, cache, turn)


class RunningTurn:
    """A turn's sampling as plain data: its cache, draw, eos ids, counts and end, stepped by whoever
    runs the forwards (:func:`drive_inline` here; a server's engine loop steps every running turn
    after each batched step, with no generator or greenlet per turn).

    :meth:`start` draws the first token from the turn's first ``logits`` [vocab]; :meth:`advance`
    takes the logits [vocab] of the step that fed the last token (and that row's greedy pick, made
    for the whole step by ``kernels.model.sampling.greedy_rows``; -1: none) and draws the next. Each
    returns the token to feed next, or None once the turn has ended (after ``max_new`` tokens or at
    a token in ``eos``, that last token not fed); :attr:`end` then says why (a :class:`TurnEnd`:
    LENGTH or EOS), :attr:`tokens` holds its tokens and :attr:`logits` its last fed position's. A plain
    greedy draw takes the step's pick (bitwise its own draw); any other draws from its row.
    ``on_step(token, position, logits)`` runs after each draw (it may raise to end the turn:
    a stop string, a cancel), ``on_rows()`` after each step's rows reached the cache."""

    __slots__ = ("cache", "draw", "end", "ended", "eos", "logits", "max_new", "on_rows", "on_step", "taker",
                 "tokens")

    def __init__(self, cache: LatentCache, logits: np.ndarray, max_new: int, draw: Callable[[np.ndarray, int], int],
                 eos: frozenset[int], on_rows: Callable[[], None] | None,
                 on_step: Callable[[int, int, np.ndarray], None] | None) -> None:
        self.cache, self.logits, self.max_new, self.draw, self.eos = cache, logits, max_new, draw, eos
        self.on_rows, self.on_step = on_rows, on_step
        self.taker = draw if isinstance(draw, TurnDraw) and draw.plain_greedy else None
        self.tokens: list[int] = []
        self.end = TurnEnd.LENGTH  # why it ended (once ``ended``): its max_new tokens, or an eos id
        self.ended = False

    def start(self) -> int | None:
        """The first token to feed (None: the turn ended without one to feed)."""
        if self.max_new <= 0:
            self.ended = True
            return None
        return self._next(-1)

    def advance(self, logits: np.ndarray, greedy: int = -1) -> int | None:
        """The step fed the last token: its logits [vocab] (and greedy pick); the next token, or None."""
        self.logits = logits
        if self.on_rows is not None:
            self.on_rows()
        return self._next(greedy)

    def _next(self, greedy: int) -> int | None:
        position = self.cache.length
        token = self.taker.take(greedy) if self.taker is not None and greedy >= 0 else self.draw(self.logits, position)
        self.tokens.append(token)
        try:
            if self.on_step is not None:
                self.on_step(token, position, self.logits)
        except BaseException:
            self.ended = True
            raise
        if token in self.eos:
            self.ended, self.end = True, TurnEnd.EOS
            return None
        if len(self.tokens) == self.max_new:
            self.ended = True
            return None
        return token


DecodeDriver = Callable[[RunningTurn, Any], RunningTurn]  # runs a running turn over a cache to its end; returns it


def drive_inline(model: Any, cache: LatentCache, turn: RunningTurn) -> RunningTurn:
    """Run ``turn`` here: one ``model.forward`` of each token it draws, as ``feed_chunk`` feeds one;
    returns it, ended."""
    token = turn.start()
    while token is not None:
        logits = model.forward(np.asarray([token], dtype="<i4"), cache)[-1]  # [vocab] f32
        token = turn.advance(logits)
    return turn


def common_prefix(history: Sequence[int] | np.ndarray, prompt_ids: Sequence[int] | np.ndarray) -> int:
    """Longest common prefix of ``history`` and ``prompt_ids``, capped at ``len(prompt) - 1``
    (prefix reuse, FORMAT.md 5.6: at least one token is always fed)."""
    hist = np.asarray(history, dtype=np.int64)  # [n]
    prompt = np.asarray(prompt_ids, dtype=np.int64)  # [m]
    m = min(hist.shape[0], prompt.shape[0])
    differ = np.flatnonzero(hist[:m] != prompt[:m])
    k = int(differ[0]) if differ.size else m
    return max(min(k, prompt.shape[0] - 1), 0)


def reference_turns(model: Decoder[Any], kv_dtype: str, turns: Sequence[tuple[Sequence[int] | None, int]],
                    sampler: Sampler, *, stop_at_eos: bool = False) -> list[list[int]]:
    """The uninterrupted run: every turn in one process, one in-memory cache, no store.

    ``turns``: (prompt_ids or None to continue, max_new). Prompt ids are prefix-matched against
    the history exactly as a session does.
    """
    cache = model.new_cache(kv_dtype)
    pending: list[int] = []
    last: np.ndarray | None = None
    outputs = []
    for prompt, max_new in turns:
        if prompt is not None:
            k = common_prefix(cache.tokens, prompt)
            if k < cache.length:
                cache.truncate(k)
            feed: list[int] | None = list(prompt[k:])
        else:
            feed = list(pending) if pending else None
            if feed is None and last is None and cache.length:
                last = recompute_last(model, cache.blocks, cache.tokens, kv_dtype, cache.index_rows())[0]
        turn = decode_turn(model, cache, feed, last, max_new, sampler, stop_at_eos=stop_at_eos)
        last, pending = turn.logits, turn.tokens[-1:]
        outputs.append(turn.tokens)
    return outputs


def recompute_last(model: Decoder[Any], blocks_of: Callable[[int, int], list], tokens: np.ndarray,
                   kv_dtype: str, index_rows: np.ndarray | None = None) -> tuple[np.ndarray, RecordRows]:
    """Logits [vocab] and rows of the last position, recomputed as a single-token step.

    ``index_rows``: the indexer keys [>= n-1, NI, hd] of a DSA model's positions (None without)."""
    n = int(tokens.shape[0])
    per_layer = [blocks_of(layer, n - 1) for layer in range(model.config.n_layers)]
    scratch = model.cache_from_blocks(per_layer, np.asarray(tokens[:n - 1], dtype="<i4"), kv_dtype=kv_dtype,
                                      index_rows=None if index_rows is None else index_rows[:n - 1])
    logits = model.forward(np.asarray(tokens[n - 1:n], dtype="<i4"), scratch)[-1]  # [vocab]
    return logits, scratch.records_since(n - 1)


def compare_rows(found: RecordRows, reader: KVReader, position: int) -> bool:
    """True if bit-identical; raises CorruptionError when beyond ROW_RTOL of the row's magnitude."""
    stored = reader.records[position]["layers"]  # [L] layer records
    exact = True
    for layer in range(reader.dims.n_layers):
        for name, scale_name in (("lc", "lc_scale"), ("rc", "rc_scale")):
            if reader.version == 1:
                want = np.asarray(stored[layer][name], dtype=np.float32)  # [w] f32
                got = getattr(found, name)[0, layer]  # [w] f32
                same = np.array_equal(want.view("<u4"), np.asarray(got, "<f4").view("<u4"))
            else:
                g_codes = getattr(found, name + "_codes")[0, layer]
                g_scale = getattr(found, scale_name)[0, layer]
                w_codes, w_scale = stored[layer][name], stored[layer][scale_name]
                same = np.array_equal(w_codes, g_codes) and np.float32(w_scale) == np.float32(g_scale)
                want = _decoded_row(reader, w_codes, w_scale)  # [w] f32
                got = _decoded_row(reader, g_codes, g_scale)  # [w] f32
            if same:
                continue
            exact = False
            limit = ROW_RTOL * float(np.max(np.abs(want))) + 1e-6
            err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
            if err > limit:
                raise CorruptionError(
                    f"{reader.path}: record {position} layer {layer} {name}: the stored row differs "
                    f"from the recomputed one by {err:.3g} (limit {limit:.3g}): the cache does not "
                    "belong to this model or was damaged")
    return exact


def _decoded_row(reader: KVReader, codes: np.ndarray, scale: np.floating[Any] | float) -> np.ndarray:
    """One stored v2/v3 row (codes + scale or radius), decoded by the file's reading rules: [w] f32."""
    codec = reader.header.codec
    if codec is not None:
        decoded: np.ndarray = codec.decode_rows(np.asarray(codes)[None], np.asarray([scale], np.float32))[0]
        return decoded
    from kernels.fp8 import dequantize_rows

    safe = sanitize_scales(np.asarray([scale], np.float32))  # [1] f32
    row: np.ndarray = dequantize_rows(np.asarray(codes)[None], safe)[0]
    return row


__all__ = ["ROW_RTOL", "DecodeDriver", "RunningTurn", "common_prefix", "compare_rows", "decode_turn", "drive_inline",
           "feed_chunk", "recompute_last", "reference_turns"]
