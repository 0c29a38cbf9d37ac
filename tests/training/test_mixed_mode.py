"""training.train_glm_mini's mixed mode (issue 37 part 5): ``--mix-short-batch N`` trains one long window and
N short ones in every step, token-weighted; the curriculum (``--short-seq/--short-frac``) still works alone."""
from __future__ import annotations

import pytest

from training.train_glm_mini import mixed_parts, parse_args, tokens_seen


def test_mixed_mode_trains_both_lengths_in_every_step() -> None:
    args = parse_args(["--seq", "2048", "--batch", "1", "--mix-short-batch", "16"])
    assert args.short_seq == 128  # the shipped model's window when --short-seq is not given
    for progress in (0.0, 0.5, 0.99):
        assert mixed_parts(args, progress) == [(1, 2048), (16, 128)]
    assert tokens_seen(args, 10) == 10 * (2048 + 16 * 128)


def test_the_curriculum_and_the_plain_mode_are_unchanged() -> None:
    args = parse_args(["--seq", "1024", "--batch", "2", "--short-seq", "256", "--short-frac", "0.4"])
    assert mixed_parts(args, 0.1) == [(8, 256)]  # same tokens per step as the long part
    assert mixed_parts(args, 0.5) == [(2, 1024)]
    plain = parse_args(["--seq", "128", "--batch", "16"])
    assert mixed_parts(plain, 0.0) == [(16, 128)] and tokens_seen(plain, 3) == 3 * 16 * 128


@pytest.mark.parametrize("argv", [
    ["--mix-short-batch", "-1"],
    ["--seq", "2048", "--mix-short-batch", "4", "--short-seq", "256", "--short-frac", "0.5"],
    ["--seq", "128", "--mix-short-batch", "4", "--short-seq", "256"],
])
def test_bad_mixed_arguments_end_in_one_error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error:" in err[-1] and ("--mix-short-batch" in err[-1] or "--short-seq" in err[-1])
