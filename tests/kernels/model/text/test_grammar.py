"""response_format grammars (llguidance) as a turn's token constraint: whatever the logits, every
draw ends in JSON that matches the schema; what cannot be enforced is refused by name."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="the grammar extra (llguidance) enforces response_format")

from kernels.model.logits import TurnDraw
from kernels.model.sampling import Sampler
from kernels.model.text import load_text
from kernels.model.text.grammar import GrammarCompiler, GrammarError
from tests.kernels.model.text.textkit import write_text_model

SCHEMA = {"type": "object", "required": ["n", "colour"], "additionalProperties": False,
          "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5},
                         "colour": {"enum": ["red", "blue"]}}}


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> tuple[GrammarCompiler, Any]:
    tok = load_text(write_text_model(Path(tmp_path_factory.mktemp("grammar")), "glm"))
    return GrammarCompiler(tok, tok.vocab_size + 5), tok  # a model vocabulary past the tokenizer's


def _draw_all(compiler: GrammarCompiler, tok: Any, fmt: dict[str, Any], seed: int) -> str:
    """Random logits each step (no model): the grammar alone decides what is valid."""
    grammar = compiler.compile(fmt)
    draw = TurnDraw(Sampler(temperature=1.0, seed=seed), stop_ids=frozenset(tok.eos_ids), constraint=grammar)
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for position in range(400):
        token = draw(rng.standard_normal(compiler.vocab).astype(np.float32), position)  # logits: [V] f32
        if token in tok.eos_ids:
            return str(tok.decode(out))
        out.append(token)
    raise AssertionError(f"no eos within 400 tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("seed", range(6))
def test_every_draw_matches_the_schema(compiler: tuple[GrammarCompiler, Any], seed: int) -> None:
    grammars, tok = compiler
    value = json.loads(_draw_all(grammars, tok, {"type": "json_schema", "json_schema": {"schema": SCHEMA}}, seed))
    assert set(value) == {"n", "colour"} and -5 <= value["n"] <= 5 and value["colour"] in ("red", "blue")


def test_text_is_unconstrained_and_bad_formats_are_refused(compiler: tuple[GrammarCompiler, Any]) -> None:
    grammars, _ = compiler
    assert grammars.compile({"type": "text"}) is None
    for bad in ({"type": "json_schema", "json_schema": {"schema": {"if": {}}}}, {"type": "xml"},
                {"type": "json_schema", "json_schema": {"schema": [1]}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "made-up"}}}):
        with pytest.raises(GrammarError):
            grammars.compile(bad)
