"""Chat over the real server and the real ``openai`` client, token-exact against one uninterrupted
in-process run: streamed replies; a conversation whose turns are separated by a suspend, an
eviction (``--max-resident 1``) and a server restart; concurrent clients on their own sessions;
stateless requests."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from kernels.model.sampling import Sampler
from sessionstore.sessions.conversation_chat import ReferenceChat
from tests.service.serverkit import ServerProc

SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 11}


def _model_id(server: ServerProc) -> str:
    return str(server.openai().models.list().data[0].id)


def _stream_chat(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int,
                 session: str | None, **sampling: Any) -> tuple[str, list[int], str, Any]:
    """(streamed text, token ids, finish reason, final chunk with choices) of one streamed chat
    completion; its usage (asked for with ``stream_options``) is set on that final chunk."""
    extra = {"session": session} if session is not None else {}
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True,
                                            extra_body=extra, stream_options={"include_usage": True}, **sampling)
    text, last, usage = "", None, None
    for chunk in stream:
        if not chunk.choices:  # the usage chunk, after the final one
            usage = chunk.usage
            continue
        last = chunk
        if chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert last is not None and last.choices[0].finish_reason in ("stop", "length") and usage is not None
    last.usage = usage
    return text, list(last.choices[0].token_ids), last.choices[0].finish_reason, last


def test_streamed_chat_matches_uninterrupted_run(tmp_path: Path, text_model_dir: Path,
                                                 text_model: tuple[Any, Any]) -> None:
    model, tok = text_model
    with ServerProc(tmp_path / "root", text_model_dir) as server:
        client, name = server.openai(), _model_id(server)
        ref = ReferenceChat(model, tok, "fp8", Sampler(**SAMPLED))
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
        for turn in range(3):
            text, ids, finish, last = _stream_chat(client, name, msgs, 24, "s1", **SAMPLED)
            want = ref.respond(msgs, 24)
            assert ids == want, f"turn {turn}"
            assert text == tok.decode(want)
            assert last.usage.completion_tokens == len(want)
            assert last.usage.prompt_tokens == len(tok.chat_ids(msgs))
            assert last.session["id"] == "s1" and last.session["created"] == (turn == 0)
            if turn:
                assert last.session["reused_prefix"] > 0  # the history was prefix-matched, not re-fed
            assert finish == ("stop" if want[-1] in tok.eos_ids else "length")
            msgs = [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": f"and {turn}?"}]
        info = server.get("/v1/sessions/s1").json()
        assert info["state"] == "resident" and info["kv_dtype"] == "fp8" and info["model"] == name


def test_turns_exact_across_suspend_eviction_and_restart(tmp_path: Path, text_model_dir: Path,
                                                         text_model: tuple[Any, Any]) -> None:
    model, tok = text_model
    server = ServerProc(tmp_path / "root", text_model_dir, "--max-resident", "1", "--kv", "f32").start()
    try:
        name = _model_id(server)
        refs = {"a": ReferenceChat(model, tok, "f32", Sampler(**SAMPLED)),
                "b": ReferenceChat(model, tok, "f32", Sampler())}
        sampling = {"a": SAMPLED, "b": {"temperature": 0.0}}
        msgs: dict[str, list[dict[str, str]]] = {sid: [{"role": "user", "content": f"hi from {sid}"}] for sid in refs}

        def turn(sid: str, n: int) -> None:
            text, ids, _, _ = _stream_chat(server.openai(), name, msgs[sid], 16, sid, **sampling[sid])
            assert ids == refs[sid].respond(msgs[sid], 16), f"session {sid} turn {n}"
            msgs[sid] = [*msgs[sid], {"role": "assistant", "content": text}, {"role": "user", "content": f"more {n}"}]

        def state(sid: str) -> str:
            return str(server.get(f"/v1/sessions/{sid}").json()["state"])

        turn("a", 0)
        assert server.post("/v1/sessions/a/suspend").json()["state"] == "suspended"
        turn("a", 1)  # resumed from the suspend
        turn("b", 0)  # one resident at most: a is evicted
        assert (state("a"), state("b")) == ("suspended", "resident")
        turn("a", 2)  # resumed from the eviction
        assert (state("a"), state("b")) == ("suspended", "resident")[::-1]
        assert server.stop() == 0
        server.start()  # the same root: every committed session is listed and resumes
        listed = {s["id"]: s for s in server.get("/v1/sessions").json()["data"]}
        assert set(listed) == {"a", "b"} and all(s["state"] == "suspended" for s in listed.values())
        turn("a", 3)
        turn("b", 1)
        metrics = server.get("/metrics").text
        assert "coli_sessions_evicted_total 1.0" in metrics  # b's second turn evicted a
    finally:
        server.stop()


def test_concurrent_clients_on_their_own_sessions_are_exact(tmp_path: Path, text_model_dir: Path,
                                                            text_model: tuple[Any, Any]) -> None:
    """16 clients, 4 turns each, decoded in shared batched steps (and evicted past 4 resident):
    every session's tokens equal its own uninterrupted run, whoever shared its steps."""
    model, tok = text_model
    n_clients, turns = 16, 4
    with ServerProc(tmp_path / "root", text_model_dir, "--max-resident", "4") as server:
        name = _model_id(server)
        results: dict[int, list[list[int]]] = {}
        transcripts: dict[int, list[list[dict[str, str]]]] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(n_clients)

        def client_run(i: int) -> None:
            try:
                client = server.openai()
                msgs = [{"role": "user", "content": f"client {i} says hello"}]
                got, seen = [], []
                start.wait()
                for t in range(turns):
                    seen.append(list(msgs))
                    text, ids, _, _ = _stream_chat(client, name, msgs, 12, f"c{i}", seed=i, temperature=0.7)
                    got.append(ids)
                    msgs = [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": f"t{t}"}]
                results[i], transcripts[i] = got, seen
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=client_run, args=(i,)) for i in range(n_clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        metrics = server.get("/metrics").text.splitlines()
        batched = _metric(metrics, "coli_decode_batch_size_count") - _metric(
            metrics, 'coli_decode_batch_size_bucket{le="1.0"}')
        assert batched > 0, "no decode step advanced two sessions together"
    for i in range(n_clients):
        ref = ReferenceChat(model, tok, "fp8", Sampler(temperature=0.7, seed=i))
        assert results[i] == [ref.respond(m, 12) for m in transcripts[i]], f"client {i}"


def _metric(lines: list[str], name: str) -> float:
    """The value of the sample line that starts with ``name`` (a name and its labels)."""
    return float(next(ln for ln in lines if ln.startswith(name + " ")).split()[-1])


def test_stateless_requests_store_nothing(tmp_path: Path, text_model_dir: Path,
                                          text_model: tuple[Any, Any]) -> None:
    model, tok = text_model
    with ServerProc(tmp_path / "root", text_model_dir) as server:
        client, name = server.openai(), _model_id(server)
        msgs = [{"role": "user", "content": "no session"}]
        reply = client.chat.completions.create(model=name, messages=msgs, max_tokens=10, seed=3, temperature=0.5)
        want = ReferenceChat(model, tok, "fp8", Sampler(temperature=0.5, seed=3)).respond(msgs, 10)
        assert reply.choices[0].token_ids == want
        assert reply.choices[0].message.content == tok.decode(want)
        assert reply.usage.completion_tokens == len(want)
        text = client.completions.create(model=name, prompt="plain text", max_tokens=6,
                                         extra_body={"ignore_eos": True})
        assert len(text.choices[0].token_ids) == 6 and text.choices[0].finish_reason == "length"
        assert server.get("/v1/sessions").json()["data"] == []
