"""bench.long_chat (issue 37 part 5: does a long chat stay on topic?): its score and a short run end to end."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.long_chat import token_f1, topic_chats

REPO = Path(__file__).resolve().parents[2]


def test_token_f1_scores_the_token_multisets() -> None:
    assert token_f1([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_f1([1, 2], [3, 4]) == 0.0 and token_f1([], [1]) == 0.0
    assert token_f1([1, 1, 2, 5], [1, 2, 2, 6]) == pytest.approx(0.5)  # 2 common of 4 and of 4


def test_each_chat_walks_one_topics_sections_in_page_order() -> None:
    chats = topic_chats(3, 10)
    assert len(chats) == 3 and all(len(c) == 10 for c in chats)
    assert len({c[0] for c in chats}) == 3  # three different topics


@pytest.mark.timeout(300)
def test_a_short_run_reports_its_keys() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.long_chat", "--json", "--chats", "1", "--turns", "2",
                          "--max-new", "12"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["chats"] == 1 and res["turns"] == 2 and res["context_tokens_max"] > 10
    for key in ("turn_f1_1", "turn_f1_2", "fresh_f1_mean", "early_f1_mean", "late_f1_mean"):
        assert 0.0 <= res[key] <= 1.0, key
    assert res["early_f1_mean"] == res["turn_f1_1"] and res["late_f1_mean"] == res["turn_f1_2"]
    assert res["late_over_fresh"] == pytest.approx(res["late_f1_mean"] / res["fresh_f1_mean"])


def test_bad_arguments_end_in_one_error_line() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.long_chat", "--turns", "1"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 2 and "--turns" in out.stderr.strip().splitlines()[-1]
