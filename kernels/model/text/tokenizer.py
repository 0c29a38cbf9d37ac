"""A checkpoint's tokenizer and chat template together: text <-> ids, conversations -> ids.

``chat_ids`` is what transformers' ``apply_chat_template(messages, tokenize=True)`` gives: the
template's text encoded with ``add_special_tokens=False`` (the template writes bos and the
role markers itself; special tokens spelled in the text become their ids).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer

from kernels.errors import FormatError, ModelMismatchError, NotFoundError
from kernels.model.text.files import TOKENIZER_NAME, TextFiles, TokenSpec, read_text_files
from kernels.model.text.template import ChatTemplate

MAX_TEXT_CHARS = 16 << 20  # one prompt or conversation, before tokenisation


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the character that stands for each byte -> the byte.
    Printable Latin-1 bytes stand for themselves; the others take U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class ChatTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library plus the chat template."""

    def __init__(self, files: TextFiles) -> None:
        where = str(files.directory / TOKENIZER_NAME)
        try:
            self._tok = Tokenizer.from_str(files.tokenizer_json)
        except Exception as exc:  # the Rust parser raises plain Exception
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise FormatError(f"{where}: not a tokenizers tokenizer.json ({first})") from None
        self.files = files
        self.source = str(files.directory)
        _add_declared_tokens(self._tok, files.declared_tokens)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self.template = (ChatTemplate(files.chat_template, files.special_tokens, where=f"{files.directory}: "
                                      "chat template") if files.chat_template is not None else None)
        eos = list(files.eos_ids)
        eos_text = files.special_tokens.get("eos_token")
        if eos_text is not None:
            eos_id = self._tok.token_to_id(eos_text)
            if eos_id is None:
                raise FormatError(f"{files.directory}: eos_token {eos_text!r} is not in {TOKENIZER_NAME}")
            if eos_id not in eos:
                eos.append(int(eos_id))
        self.eos_ids: tuple[int, ...] = tuple(eos)
        decoder = self._tok.decoder
        self._byte_level = byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        self._byte_tables: dict[bool, list[bytes] | None] = {}  # skip_special_tokens -> token_bytes' table

    def check_vocab(self, model_vocab: int) -> None:
        """Refuse a tokenizer whose ids do not fit the model's vocabulary."""
        if self.vocab_size > model_vocab:
            raise ModelMismatchError(f"{self.source}: the tokenizer has {self.vocab_size} ids, the model's "
                                     f"vocabulary only {model_vocab}")
        big = [i for i in self.eos_ids if i >= model_vocab]
        if big:
            raise ModelMismatchError(f"{self.source}: eos id {big[0]} is outside the model's vocabulary "
                                     f"({model_vocab})")

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``; ``add_special_tokens`` runs the tokenizer's post-processor (bos etc.)."""
        if not isinstance(text, str):
            raise FormatError(f"text must be a string, found {type(text).__name__}")
        if len(text) > MAX_TEXT_CHARS:
            raise FormatError(f"the text is longer than {MAX_TEXT_CHARS} characters")
        return [int(i) for i in self._tok.encode(text, add_special_tokens=add_special_tokens).ids]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        plain = [int(i) for i in ids]
        if plain and (min(plain) < 0 or max(plain) >= self.vocab_size):
            bad = next(i for i in plain if not 0 <= i < self.vocab_size)
            raise FormatError(f"token id {bad} is outside the tokenizer's {self.vocab_size} ids")
        return str(self._tok.decode(plain, skip_special_tokens=skip_special_tokens))

    def tokenizer_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text, declared tokens included (what a grammar library reads)."""
        return str(self._tok.to_str())

    def token_text(self, token: int) -> tuple[str, bytes]:
        """One token's text (special tokens spelled out) and its own bytes: through the byte-level
        alphabet when the tokenizer decodes byte-level (so a token that ends inside a character
        has its true bytes, its text then holding U+FFFD), else the UTF-8 of its text."""
        text = self.decode([token], skip_special_tokens=False)
        piece = self._tok.id_to_token(int(token))
        if piece is not None and int(token) not in self.special_ids and self._byte_level is not None:
            if all(c in self._byte_level for c in piece):
                return text, bytes(self._byte_level[c] for c in piece)
        return text, text.encode("utf-8")

    def token_bytes(self, *, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each id's bytes, such that ``decode(ids)`` is the UTF-8 decoding (errors replaced) of the ids'
        bytes joined, for a byte-level decoder (what it does: each token's characters mapped back to
        bytes through the alphabet, a token with a character outside it taken as its UTF-8, skipped
        special tokens giving none, then one lossy UTF-8 decoding); None for any other decoder, or
        when a check over every single id (one batched decode, made once per flag) finds a
        difference. :class:`kernels.model.text.stream.StreamDecoder` streams through it with one
        dictionary look-up a token instead of two decodes."""
        if skip_special_tokens not in self._byte_tables:
            self._byte_tables[skip_special_tokens] = self._byte_table(skip_special_tokens)
        return self._byte_tables[skip_special_tokens]

    def _byte_table(self, skip: bool) -> list[bytes] | None:
        alphabet = self._byte_level
        if alphabet is None:
            return None
        table: list[bytes] = []
        for token in range(self.vocab_size):
            piece = self._tok.id_to_token(token)
            if piece is None or (skip and token in self.special_ids):
                table.append(b"")
            elif all(c in alphabet for c in piece):
                table.append(bytes(alphabet[c] for c in piece))
            else:
                table.append(piece.encode("utf-8"))
        singles = self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=skip)
        if any(text != raw.decode("utf-8", "replace") for text, raw in zip(singles, table, strict=True)):
            return None
        return table

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        if self.template is None:
            raise FormatError(f"{self.source}: no chat template (tokenizer_config.json 'chat_template' or "
                              "chat_template.jinja)")
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """The conversation rendered and tokenised as ``apply_chat_template(..., tokenize=True)``."""
        return self.encode(self.render(messages, add_generation_prompt=add_generation_prompt))


def _flags_of(token: Any) -> tuple[str, tuple[bool, ...]]:
    return (str(token.content), (bool(token.single_word), bool(token.lstrip), bool(token.rstrip),
                                 bool(token.normalized), bool(token.special)))


def _add_declared_tokens(tok: Tokenizer, declared: Sequence[TokenSpec]) -> None:
    """Add the tokens a config declares that tokenizer.json lacks, as transformers does on load:
    added_tokens_decoder entries not already there (same content and flags), then named and
    extra special tokens whose text is not yet an added token (made special)."""
    present = {_flags_of(t) for t in tok.get_added_tokens_decoder().values()}
    known = {str(t.content) for t in tok.get_added_tokens_decoder().values()}
    to_add: list[AddedToken] = []
    for spec in declared:
        flags = dict(spec.flags)
        if spec.source != "added":
            if spec.content in known:
                continue
            flags["special"] = True
        token = AddedToken(spec.content, **flags)
        if spec.source == "added" and _flags_of(token) in present:
            continue
        to_add.append(token)
        known.add(spec.content)
    if to_add:
        tok.add_tokens(to_add)


def load_text(model_dir: str | os.PathLike[str]) -> ChatTokenizer:
    """The tokenizer and chat template of a checkpoint directory (one clear error if unusable)."""
    path = os.fspath(model_dir)
    if not os.path.isdir(path):
        raise NotFoundError(f"{path}: the model has no tokenizer files (text needs a checkpoint directory with "
                            f"{TOKENIZER_NAME}; use --prompt-ids with this model)")
    return ChatTokenizer(read_text_files(path))


__all__ = ["ChatTokenizer", "MAX_TEXT_CHARS", "load_text"]
