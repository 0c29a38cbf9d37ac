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
tokens compared as ids, not as their spelling; a special id the reply sampled, which its text
skips, stays in the prompt as it stays in the history (the conversation record already stands for
the history with it).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kernels.model.text.tokenizer import ChatTokenizer
from sessionstore.sessions.turn_loop import common_prefix


def spelled_end(tokenizer: ChatTokenizer, history: Sequence[int], prompt: Sequence[int]) -> int | None:
    """The position m in ``prompt`` such that ``prompt[:m]`` spells ``history``'s text, or None.

    Spelled: past their common prefix, the plain tokens of both give the same bytes (the
    tokenizer's byte-level table) and every special id of ``prompt`` there is one of
    ``history`` in the same place; a special id of ``history`` that ``prompt`` lacks is one its
    reply's text dropped (a reply is text with special tokens skipped: an eos id sampled past
    under ``ignore_eos``), and stays. A special id ending ``history`` (the eos that ended the
    reply) that ``prompt`` has next is taken as the template's own (``<|user|>``, which GLM's
    eos doubles as). None: the history's text ends inside a prompt token, the texts differ, or
    a tokenizer without a byte-level table (its decoding is not a concatenation of tokens' bytes)."""
    table = tokenizer.token_bytes(skip_special_tokens=False)  # id -> its bytes
    if table is None:
        return None
    special = tokenizer.special_ids
    j = common_prefix(history, prompt)
    if j == len(history):
        return j
    n = len(prompt)
    pending = b""  # the history's plain bytes no prompt token has covered yet
    for t in (int(i) for i in history[j:]):
        if t in special:
            if not pending and j < n and int(prompt[j]) == t:
                j += 1  # the same special in the same place
            continue  # else one the reply's text dropped: kept in the history, not in the text
        pending += table[t]
        while pending and j < n:
            p = int(prompt[j])
            if p in special:
                return None  # the prompt has a special token where the history has text
            piece = table[p]
            if pending.startswith(piece):
                pending, j = pending[len(piece):], j + 1
            elif piece.startswith(pending):
                break  # this prompt token spans past the history's bytes so far: read on
            else:
                return None
    return j if not pending else None


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
    return [*map(int, history), *map(int, prompt[m:])]  # half a generator's time (~65 us for 1k ids)


__all__ = ["spelled_end", "splice_prompt"]
