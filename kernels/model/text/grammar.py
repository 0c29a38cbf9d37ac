"""Structured output: ``response_format`` (``json_object``, ``json_schema``) as a token constraint for
a turn's draw, through llguidance (the ``grammar`` extra).

Why llguidance: one small MIT wheel with no dependencies (xgrammar needs torch; outlines-core
builds an index per schema up front), it reads the ``tokenizers`` JSON this tokenizer already
holds, computes each step's mask in microseconds without precompiling the vocabulary, and names the
schema features it does not implement, which the API turns into a 400. vLLM offers it as a backend.

The JSON is compact (no whitespace between tokens: ``whitespace_flexible`` off), so once the value
is complete the only token allowed is an eos id and the turn ends there.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from kernels.errors import FormatError

if TYPE_CHECKING:
    import llguidance

    from kernels.model.text.tokenizer import ChatTokenizer


class GrammarError(FormatError):
    """A ``response_format`` this server cannot enforce (an unsupported schema feature, a bad schema)."""


class TokenGrammar:
    """One turn's constraint (:class:`kernels.model.logits.TokenConstraint`): the tokens the grammar
    allows next, and each drawn token consumed."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self.matcher, self.vocab = matcher, vocab

    def allowed(self) -> np.ndarray:
        """The ids the grammar allows next: [V] bool (an eos id once the value is complete)."""
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # [ceil(V/32)*4] u8
        bits: np.ndarray = np.unpackbits(packed, bitorder="little")[:self.vocab].astype(bool)  # [V] bool
        return bits

    def consume(self, token: int) -> None:
        """Advance past the drawn ``token`` (it was allowed: the mask was applied before the draw)."""
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")


class GrammarCompiler:
    """``response_format`` objects -> :class:`TokenGrammar` for one tokenizer and a model of
    ``vocab`` ids (the logits' size); its llguidance tokenizer is built once."""

    def __init__(self, tokenizer: ChatTokenizer, vocab: int) -> None:
        try:
            import llguidance
        except ImportError:  # the optional extra is missing
            raise GrammarError("response_format needs the grammar extra (llguidance); this server has "
                               "none installed") from None
        self._llg = llguidance
        self.vocab = vocab
        self.tokenizer = llguidance.LLTokenizer(tokenizer.tokenizer_json(), n_vocab=vocab,
                                                eos_token=list(tokenizer.eos_ids))

    def compile(self, response_format: dict[str, Any]) -> TokenGrammar | None:
        """The constraint of ``response_format`` (OpenAI's: ``{"type": "text"}`` -> None, ``{"type":
        "json_object"}`` -> any JSON object, ``{"type": "json_schema", "json_schema": {"schema": ...}}``);
        GrammarError names what cannot be enforced."""
        schema = schema_of(response_format)
        if schema is None:
            return None
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(  # compact JSON: its end is the turn's end
                json.dumps(schema), defaults={"whitespace_flexible": False})
        except ValueError as exc:
            raise GrammarError(f"response_format: {exc}") from None
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"response_format: the schema cannot be enforced: {matcher.get_error()[:300]}")
        return TokenGrammar(matcher, self.vocab)


def schema_of(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks for (None: free text); GrammarError when malformed."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise GrammarError("response_format.json_schema.schema must be a JSON schema object")
        return schema
    raise GrammarError(f"response_format.type must be text, json_object or json_schema, found {kind!r}")


__all__ = ["GrammarCompiler", "GrammarError", "TokenGrammar", "schema_of"]
