"""Incremental detokenisation: text as tokens arrive, never a broken character, and the pieces
joined are exactly the final decode.

Each step decodes the ids since the last *stable* point and emits what extends the text so far,
holding back a trailing U+FFFD (the bytes of a multi-byte character split over tokens are not
complete yet). A stable point is taken when the decoded text is clean; decoding restarts a few
tokens before it so decoders that look at their neighbours (spaces, byte fallback) see context.

A byte-level tokenizer (:meth:`ChatTokenizer.token_bytes` gives its table) streams without decoding:
each token's bytes go through one incremental UTF-8 decoder (errors replaced), which emits what is
complete and holds back a character's first bytes; joined, that is the lossy decoding of all the
bytes at once, which is ``decode(all ids)`` (the table's contract).
"""
from __future__ import annotations

import codecs
from collections.abc import Iterable

from kernels.errors import FormatError
from kernels.model.text.tokenizer import ChatTokenizer

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6  # ids decoded again before the stable point


class StreamDecoder:
    """Feed ids with :meth:`push`; each call returns the new text (possibly ""). :meth:`finish`
    returns the rest. The concatenation of everything returned == ``decode(all ids)``."""

    def __init__(self, tokenizer: ChatTokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""  # the text returned so far
        self._base = 0  # ids[:_base] are settled: their text is emitted[:_base_chars]
        self._base_chars = 0
        self._bytes = tokenizer.token_bytes(skip_special_tokens=skip_special_tokens)  # None: the window path
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _window_text(self) -> str | None:
        """emitted-so-far-consistent text of all ids, decoded from a few ids before the base."""
        start, head = self._base, ""
        while start > 0 and (head == "" or self._base - start < CONTEXT_TOKENS):
            # a head with text: a decoder that strips its first token's space strips the head's
            start = max(0, start - CONTEXT_TOKENS)
            head = self._decode(self.ids[start:self._base])
        full = self._decode(self.ids[start:])
        if not full.startswith(head):
            return None  # the decoder rewrote earlier text: wait for more context
        return self.emitted[:self._base_chars] + full[len(head):]

    def push(self, token: int) -> str:
        if self._bytes is not None:
            return self._push_bytes(int(token))
        self.ids.append(int(token))
        text = self._window_text()
        if text is None:
            return ""
        safe = text.rstrip(REPLACEMENT)
        if not safe.startswith(self.emitted):
            return ""
        new = safe[len(self.emitted):]
        self.emitted = safe
        if safe == text:  # clean end: later ids cannot change this text
            self._base, self._base_chars = len(self.ids), len(safe)
        return new

    def _push_bytes(self, token: int) -> str:
        if not 0 <= token < len(self._bytes or ()):
            self.tokenizer.decode([token])  # the id's one error
        self.ids.append(token)
        new: str = self._utf8.decode(self._bytes[token])  # type: ignore[index]  # (not None: the caller's test)
        self.emitted += new
        return new

    def extend(self, tokens: Iterable[int]) -> str:
        return "".join(self.push(t) for t in tokens)

    def finish(self) -> str:
        """The rest of the text (a trailing U+FFFD the ids really end in comes out here)."""
        if self._bytes is not None:
            new: str = self._utf8.decode(b"", final=True)
            self.emitted += new
            return new
        final = self._decode(self.ids)
        if not final.startswith(self.emitted):
            raise FormatError(f"{self.tokenizer.source}: the tokenizer's decoder rewrote text that was already "
                              "streamed; this tokenizer cannot stream")
        new = final[len(self.emitted):]
        self.emitted = final
        self._base, self._base_chars = len(self.ids), len(final)
        return new

    @property
    def text(self) -> str:
        return self.emitted


__all__ = ["StreamDecoder"]
