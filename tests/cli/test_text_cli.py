"""``generate --prompt / --messages`` and ``chat`` on bad input: one clear line, a non-zero exit,
the session (kv file, manifest, conversation) unchanged and no new session or store left behind."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the text extra (tokenizers) builds the test tokenizer")

from kernels.model import GLM_MINI_NAME, SHIPPED_MODELS_DIR
from kernels.model.text import load_text
from sessionstore.sessions import SessionStore
from sessionstore.sessions.conversation_file import read_record
from tests.kernels.model.text.textkit import write_text_model
from tools.coli_kv import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model(tmp_path_factory.mktemp("cli-model"), "chatml")


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.suffix != ".lock"}


def _one_error(capsys: pytest.CaptureFixture[str], rc: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1, (rc, err)
    assert err[0].startswith("coli-kv ") and "Traceback" not in err[0]
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    return err[0]


def _messages(path: Path, messages: object) -> str:
    path.write_text(json.dumps(messages), encoding="utf-8")
    return str(path)


def test_generate_text_and_ids(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = load_text(model_dir)
    msgs = [{"role": "user", "content": "Hello \u00e9"}]
    m = _messages(tmp_path / "m.json", msgs)
    assert main(["generate", "--model", str(model_dir), "--messages", m, "--max-new", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["prompt_tokens"] == len(tok.chat_ids(msgs)) and out["text"] == tok.decode(out["tokens"])
    root = tmp_path / "s"
    assert main(["generate", "--root", str(root), "--session", "x", "--model", str(model_dir), "--messages", m,
                 "--max-new", "6", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["text"] == tok.decode(summary["tokens"])
    record = read_record(SessionStore(root).session_dir("x"))
    assert record is not None and record.messages == [*msgs, {"role": "assistant", "content": summary["text"]}]
    assert main(["generate", "--root", str(root), "--session", "x", "--prompt", "raw words", "--max-new", "3"]) == 0
    assert read_record(SessionStore(root).session_dir("x")) is None  # raw tokens: no stale conversation
    capsys.readouterr()


def _existing(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "store"
    m = _messages(tmp_path / "first.json", [{"role": "user", "content": "Hi"}])
    assert main(["generate", "--root", str(root), "--session", "s", "--model", str(model_dir), "--messages", m,
                 "--max-new", "3"]) == 0
    capsys.readouterr()
    return root, _snapshot(SessionStore(root).session_dir("s"))


BAD_FILES = {
    "invalid_utf8": (b'[{"role": "user", "content": "\xff\xfe"}]', "not valid JSON"),
    "bad_json": (b'[{"role": "user", "content": ', "not valid JSON"),
    "not_a_list": (b'{"role": "user"}', "must be a JSON list"),
    "bad_role": (b'[{"role": "robot", "content": "x"}]', "role 'robot'"),
    "no_content": (b'[{"role": "user"}]', "string 'content'"),
    "empty": (b"[]", "empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_messages_file(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    root, before = _existing(tmp_path, model_dir, capsys)
    raw, needle = BAD_FILES[case]
    (tmp_path / "bad.json").write_bytes(raw)
    rc = main(["generate", "--root", str(root), "--session", "s", "--messages", str(tmp_path / "bad.json")])
    _one_error(capsys, rc, needle)
    assert _snapshot(SessionStore(root).session_dir("s")) == before
    rc = main(["generate", "--root", str(tmp_path / "new"), "--session", "n", "--model", str(model_dir),
               "--messages", str(tmp_path / "bad.json")])
    _one_error(capsys, rc, needle)
    assert not (tmp_path / "new").exists()


def _broken_model(tmp_path: Path, model_dir: Path, damage: str) -> Path:
    bad = tmp_path / f"model-{damage}"
    shutil.copytree(model_dir, bad)
    if damage == "malformed":
        (bad / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 5}}')
    elif damage == "unknown":
        (bad / "tokenizer.json").rename(bad / "tokenizer.model")
    elif damage == "template_syntax":
        cfg = json.loads((bad / "tokenizer_config.json").read_text())
        cfg["chat_template"] = "{% for m in messages %}{{ m.content }"
        (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize("damage,needle", [("malformed", "not a tokenizers tokenizer.json"),
                                           ("unknown", "only tokenizer.json is supported"),
                                           ("template_syntax", "not a valid Jinja template")])
def test_bad_tokenizer_or_template_files(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch, damage: str, needle: str) -> None:
    bad = _broken_model(tmp_path, model_dir, damage)
    m = _messages(tmp_path / "m.json", [{"role": "user", "content": "Hi"}])
    rc = main(["generate", "--root", str(tmp_path / "new"), "--session", "n", "--model", str(bad), "--messages", m])
    _one_error(capsys, rc, needle)
    assert not (tmp_path / "new").exists()
    rc = main(["generate", "--model", str(bad), "--messages", m])
    _one_error(capsys, rc, needle)
    root, before = _existing(tmp_path, model_dir, capsys)  # an existing session asked to use it
    rc = main(["generate", "--root", str(root), "--session", "s", "--model", str(bad), "--messages", m])
    _one_error(capsys, rc, needle)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    rc = main(["chat", "--root", str(root), "--session", "s", "--model", str(bad)])
    _one_error(capsys, rc, needle)
    assert _snapshot(SessionStore(root).session_dir("s")) == before


def test_raising_template_and_context(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, before = _existing(tmp_path, model_dir, capsys)
    m = _messages(tmp_path / "m.json", [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    rc = main(["generate", "--root", str(root), "--session", "s", "--messages", m])
    _one_error(capsys, rc, "the system message must come first")
    rc = main(["generate", "--root", str(root), "--session", "s", "--prompt", "word " * 5000])
    _one_error(capsys, rc, "past the model's context")
    big = _messages(tmp_path / "big.json", [{"role": "user", "content": "word " * 5000}])
    rc = main(["generate", "--root", str(root), "--session", "s", "--messages", big])
    _one_error(capsys, rc, "past the model's context")
    rc = main(["generate", "--root", str(root), "--session", "s", "--prompt", "x", "--prompt-ids", "1,2"])
    _one_error(capsys, rc, "exclusive")
    assert _snapshot(SessionStore(root).session_dir("s")) == before


def test_chat_bad_line_is_one_error(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    root, before = _existing(tmp_path, model_dir, capsys)
    monkeypatch.setattr("sys.stdin", io.StringIO("word " * 5000 + "\nnever reached\n"))
    rc = main(["chat", "--root", str(root), "--session", "s", "--max-new", "4"])
    _one_error(capsys, rc, "past the model's context")
    assert _snapshot(SessionStore(root).session_dir("s")) == before
    monkeypatch.setattr("sys.stdin", io.StringIO("/nonsense\n"))
    _one_error(capsys, main(["chat", "--root", str(root), "--session", "s"]), "unknown command")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # a chat that says nothing leaves no session
    assert main(["chat", "--root", str(root), "--session", "quiet", "--model", str(model_dir)]) == 0
    assert not SessionStore(root).exists("quiet")


def test_chat_default_model(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --model a new chat uses the shipped glm-mini; where it is not shipped, one line says so."""
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    rc = main(["chat", "--root", str(tmp_path / "r"), "--session", "d", "--max-new", "3"])
    if (SHIPPED_MODELS_DIR / GLM_MINI_NAME / "config.json").is_file():
        assert rc == 0 and capsys.readouterr().out.startswith("assistant> ")
    else:
        _one_error(capsys, rc, GLM_MINI_NAME, "not in this checkout")
        assert not (tmp_path / "r").exists()


def test_glm_mini_name_resolves_to_the_shipped_dir(tmp_path: Path, model_dir: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.model as km

    shipped = tmp_path / "models"
    shutil.copytree(model_dir, shipped / GLM_MINI_NAME)
    monkeypatch.setattr(km, "SHIPPED_MODELS_DIR", shipped)
    assert km.resolve_model(GLM_MINI_NAME) == str(shipped / GLM_MINI_NAME)
    assert km.load_model(GLM_MINI_NAME).config.vocab_size == load_text(model_dir).vocab_size
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    assert main(["chat", "--root", str(tmp_path / "r"), "--session", "d", "--max-new", "3"]) == 0  # default
    assert SessionStore(tmp_path / "r").read_manifest("d").model.path == str((shipped / GLM_MINI_NAME).resolve())
    assert main(["generate", "--root", str(tmp_path / "r"), "--session", "t", "--model", GLM_MINI_NAME,
                 "--prompt-ids", "5,6,7", "--max-new", "2"]) == 0
    capsys.readouterr()


def test_chat_sampler_flags(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A new chat stores its sampler flags; a later chat keeps them unless given; a bad one is refused."""
    root = tmp_path / "r"
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert main(["chat", "--root", str(root), "--session", "s", "--model", str(model_dir), "--max-new", "3",
                 "--temperature", "0.7", "--seed", "5"]) == 0
    sampler = SessionStore(root).read_manifest("s").sampler
    assert (sampler.temperature, sampler.seed) == (0.7, 5)
    monkeypatch.setattr("sys.stdin", io.StringIO("More\n"))
    assert main(["chat", "--root", str(root), "--session", "s", "--max-new", "3", "--top-k", "9"]) == 0
    sampler = SessionStore(root).read_manifest("s").sampler
    assert (sampler.temperature, sampler.seed, sampler.top_k) == (0.7, 5, 9)
    capsys.readouterr()
    before = _snapshot(SessionStore(root).session_dir("s"))
    monkeypatch.setattr("sys.stdin", io.StringIO("More\n"))
    _one_error(capsys, main(["chat", "--root", str(root), "--session", "s", "--top-p", "7"]), "top_p")
    assert _snapshot(SessionStore(root).session_dir("s")) == before


def test_fork_command_carries_the_conversation(tmp_path: Path, model_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = _existing(tmp_path, model_dir, capsys)
    source = read_record(SessionStore(root).session_dir("s"))
    assert main(["fork", "s", "whole", "--root", str(root)]) == 0
    assert main(["fork", "s", "cut", "--root", str(root), "--at", "3"]) == 0
    store = SessionStore(root)
    copied = read_record(store.session_dir("whole"))
    assert copied is not None and copied.messages == source.messages
    assert copied.agrees_with(store.history("whole"))
    assert read_record(store.session_dir("cut")) is None  # cut inside the conversation: no messages
    capsys.readouterr()
