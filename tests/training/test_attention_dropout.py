"""training.train_glm_mini's ``--attention-dropout``: a regulariser while training (the long-window retrain of
issue 37 part 5 sees a 110k-token corpus dozens of times), never part of the saved model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from training.train_glm_mini import load_checkpoint, parse_args, save, set_attention_dropout

MODEL = Path(__file__).resolve().parents[2] / "models" / "glm-mini"


def test_dropout_acts_in_train_mode_only_and_is_not_saved(tmp_path: Path) -> None:
    tok, model = load_checkpoint(MODEL)
    ids = torch.tensor([tok.encode("The for statement is used to iterate over a sequence.").ids])
    set_attention_dropout(model, 0.5)
    model.train()
    torch.manual_seed(0)
    first = model(input_ids=ids).logits
    second = model(input_ids=ids).logits
    assert not torch.equal(first, second)  # a fresh mask every forward
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    save(model, tok, tmp_path, {}, [])
    assert json.loads((tmp_path / "config.json").read_text())["attention_dropout"] == 0.0
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)


@pytest.mark.parametrize("value", ["-0.1", "1.0"])
def test_a_dropout_outside_0_1_ends_in_one_error_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--attention-dropout", value])
    assert exc.value.code == 2
    assert "--attention-dropout" in capsys.readouterr().err.strip().splitlines()[-1]
