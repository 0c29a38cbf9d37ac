"""A real server and the ``openai`` client, the conversation sent whole each turn (as chat clients
and aiperf do): when the last reply's text re-tokenises to other ids than were generated, the turn
still reuses the whole history (no truncate, nothing fed again), and its tokens are the in-process
reference's; an edited reply truncates and re-feeds as before."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kernels.model.sampling import Sampler
from sessionstore.sessions.conversation_chat import ReferenceChat
from sessionstore.sessions.turn_loop import common_prefix
from tests.service.serverkit import ServerProc

LETTERS = "he"  # single-letter tokens a reply is pushed to: "h" then "e" re-tokenise merged ("he")


def _bias(tok: Any) -> dict[int, float]:
    ids = sorted({tok.encode(c)[0] for c in LETTERS})
    return {i: 100.0 for i in ids}


def _chat(server: ServerProc, messages: list[dict[str, str]], bias: dict[int, float]) -> Any:
    """The final chunk of a streamed chat turn on session s1 (its usage set on it), and the text."""
    client = server.openai()
    model = str(client.models.list().data[0].id)
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, stream=True, temperature=0.0,
        logit_bias={str(k): v for k, v in bias.items()}, extra_body={"session": "s1"},
        stream_options={"include_usage": True})
    text, last, usage = "", None, None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        last = chunk
        text += chunk.choices[0].delta.content or ""
    assert last is not None and usage is not None
    last.usage, last.text = usage, text
    return last


def _epoch(root: Path) -> int:
    return int(json.loads((root / "sessions" / "s1" / "manifest.json").read_text())["epoch"])


def test_full_history_turns_reuse_the_whole_history(tmp_path: Path, text_model_dir: Path,
                                                    text_model: tuple[Any, Any]) -> None:
    model, tok = text_model
    bias = _bias(tok)
    ref = ReferenceChat(model, tok, "fp8", Sampler(logit_bias=tuple(sorted(bias.items()))))
    root = tmp_path / "root"
    with ServerProc(root, text_model_dir) as server:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
        before: list[int] = []
        differed = 0
        for turn in range(3):
            last = _chat(server, msgs, bias)
            ids = list(last.choices[0].token_ids)
            assert ids == ref.respond(msgs, 10), f"turn {turn}"
            assert last.usage.prompt_tokens == len(ref.prompt)
            if turn:
                assert ref.prompt[:len(before)] == before  # the reference spliced the same way
                assert last.session["reused_prefix"] == len(before) - 1  # every row of the history
                assert last.usage.prompt_tokens_details.cached_tokens == len(before) - 1
                assert _epoch(root) == 0  # never truncated
                differed += common_prefix(before, tok.chat_ids(msgs)) < len(before) - 1
            before = ref.history
            msgs = [*msgs, {"role": "assistant", "content": last.text}, {"role": "user", "content": f"and {turn}?"}]
        assert differed >= 1  # a reply re-tokenised to other ids, and was kept as generated
        # an edited reply: the rendering decides, truncating where it parts from the history
        msgs[-2] = {"role": "assistant", "content": msgs[-2]["content"] + "!"}
        last = _chat(server, msgs, bias)
        full = tok.chat_ids(msgs)
        assert last.usage.prompt_tokens == len(full)
        assert last.session["reused_prefix"] == common_prefix(before[:-1], full) < len(before) - 1
        assert _epoch(root) == 1
