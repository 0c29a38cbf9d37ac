"""A chat turn's prompt spliced onto the session's own ids: the history's reply kept as generated.

A client of a chat API sends the whole conversation each turn, the last reply included as text.
Rendered and tokenised, that reply's text often gives other ids than the ones the model sampled
(a word cut by the token limit, a merge the sampler did not take): the prompt then parts from the
session's history inside the reply, and prefix reuse would truncate the session there and feed
the reply again. When the request's messages up to its last assistant message are exactly the
conversation the session holds (FORMAT.md 5.8), and the session's ids spell exactly the same text
as the prompt's ids up to a token boundary of the prompt, the turn's prompt is the session's ids
followed by the prompt's ids after that boundary: the same text, the same ids for the new messages
(the full rendering's own), the reply's ids as generated. Nothing is rendered or tokenised again:
the comparison is of the two id sequences' bytes (the tokenizer's byte-level table), special
tokens compared as ids, not as their spelling.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kernels.model.text.tokenizer import ChatTokenizer
from sessionstore.sessions.turn_loop import common_prefix


def spelled_end(tokenizer: ChatTokenizer, history: Sequence[int], prompt: Sequence[int]) -> int | None:
    """The position m in ``prompt`` such that ``prompt[:m]`` spells exactly ``history``'s text (the
    same bytes, the same special tokens in the same places), or None: no such token boundary, or
    a tokenizer without a byte-level table (its decoding is not a concatenation of tokens' bytes).
    Both share their first ``common_prefix`` ids; only what follows is compared."""
    table = tokenizer.token_bytes(skip_special_tokens=False)  # id -> its bytes (specials spelled out)
    if table is None:
        return None
    start = common_prefix(history, prompt)
    rest = [int(i) for i in history[start:]]
    if not rest:
        return start if start == len(history) else None
    want = sum(len(table[i]) for i in rest)
    got, m = 0, start
    while got < want and m < len(prompt):
        got += len(table[int(prompt[m])])
        m += 1
    if got != want:
        return None  # the history's text ends inside a prompt token (or the prompt is shorter)
    special = tokenizer.special_ids
    if _pieces(rest, table, special) != _pieces([int(i) for i in prompt[start:m]], table, special):
        return None
    return m


def _pieces(ids: list[int], table: list[bytes], special: frozenset[int]) -> list[bytes | int]:
    """``ids`` as runs of plain tokens' bytes joined, with each special id kept as itself."""
    out: list[bytes | int] = []
    run: list[bytes] = []
    for i in ids:
        if i in special:
            if run:
                out.append(b"".join(run))
                run = []
            out.append(i)
        else:
            run.append(table[i])
    if run:
        out.append(b"".join(run))
    return out


def splice_prompt(tokenizer: ChatTokenizer, held: Sequence[dict[str, Any]], messages: Sequence[dict[str, Any]],
                  history: Sequence[int], prompt: Sequence[int]) -> list[int] | None:
    """The prompt for ``messages`` on a session whose ``history`` ids the messages ``held`` stand for
    (a closed conversation: FORMAT.md 5.8), when ``messages`` continue ``held`` exactly, ``held``
    ends with the assistant's reply, and ``prompt`` (the rendering of ``messages`` tokenised) parts
    from ``history`` although both spell the same text up to a boundary m of ``prompt``:
    ``[*history, *prompt[m:]]``. None otherwise (the caller reuses the common prefix, as always)."""
    n = len(held)
    if n == 0 or held[-1].get("role") != "assistant" or len(messages) <= n:
        return None
    if common_prefix(history, prompt) == len(history):
        return None  # the prompt already continues the history: nothing to splice
    if list(messages[:n]) != list(held):
        return None  # an edited message or reply, another system prompt: the rendering decides
    m = spelled_end(tokenizer, history, prompt)
    if m is None or m >= len(prompt):
        return None
    return [*(int(i) for i in history), *(int(i) for i in prompt[m:])]


__all__ = ["spelled_end", "splice_prompt"]
