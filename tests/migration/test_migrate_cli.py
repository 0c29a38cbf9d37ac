"""`coli-kv export` / `import` / `lease` in-process: outputs, exit codes, one-line errors."""
from __future__ import annotations

import json

import pytest

from sessionstore.sessions.store import SessionStore
from tests.support.migrate import make_session, tree_state
from tools.coli_kv import main


@pytest.fixture
def src_root(tmp_path):
    store = SessionStore(tmp_path / "A")
    make_session(store, "chat", 25)
    return store.root


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_export_into_a_directory_then_import_with_json(tmp_path, src_root, capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert main(["export", "--root", str(src_root), "chat", str(out_dir), "--json"]) == 0
    exported = last_json(capsys.readouterr().out)
    bundle = out_dir / "chat.colibundle"
    assert exported["dest"] == str(bundle) and bundle.is_file()
    assert exported["tokens"] == 25 and exported["raw_bytes"] > 0
    assert [p.name for p in out_dir.iterdir()] == ["chat.colibundle"]  # no .partial left
    assert main(["import", "--root", str(tmp_path / "B"), str(bundle), "--as", "chat-copy",
                 "--json"]) == 0
    imported = last_json(capsys.readouterr().out)
    assert imported["session_id"] == "chat-copy" and imported["tokens"] == 25
    assert SessionStore(tmp_path / "B").read_manifest("chat-copy").id == "chat-copy"


def test_export_refuses_to_overwrite_without_force(tmp_path, src_root, capsys):
    dest = tmp_path / "b.colibundle"
    dest.write_bytes(b"precious")
    assert main(["export", "--root", str(src_root), "chat", str(dest)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to overwrite" in err
    assert dest.read_bytes() == b"precious"
    assert main(["export", "--root", str(src_root), "chat", str(dest), "--force"]) == 0
    assert dest.read_bytes()[:8] == b"COLIBNDL"


def test_export_of_an_unknown_session_leaves_no_partial_file(tmp_path, src_root, capsys):
    dest = tmp_path / "x.colibundle"
    assert main(["export", "--root", str(src_root), "nope", str(dest)]) == 2
    assert "no session 'nope'" in capsys.readouterr().err
    assert list(tmp_path.glob("x.colibundle*")) == []


def test_export_to_stdout_refuses_json(src_root, capsys):
    assert main(["export", "--root", str(src_root), "chat", "-", "--json"]) == 2
    assert "--json" in capsys.readouterr().err


def test_file_url_round_trip(tmp_path, src_root, capsys):
    url = f"file://{tmp_path / 'u.colibundle'}"
    assert main(["export", "--root", str(src_root), "chat", url]) == 0
    assert main(["import", "--root", str(tmp_path / "B"), url]) == 0
    assert SessionStore(tmp_path / "B").info("chat").tokens == 25


def test_failed_import_is_one_line_and_leaves_the_store_unchanged(tmp_path, src_root, capsys):
    bundle = tmp_path / "c.colibundle"
    assert main(["export", "--root", str(src_root), "chat", str(bundle)]) == 0
    data = bytearray(bundle.read_bytes())
    data[len(data) // 2] ^= 0x20
    bundle.write_bytes(bytes(data))
    target = SessionStore(tmp_path / "B")
    make_session(target, "keep", 3)
    before = tree_state(target.root)
    capsys.readouterr()
    code = main(["import", "--root", str(target.root), str(bundle)])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1
    assert err.startswith("coli-kv import: error: ") and "byte" in err
    assert tree_state(target.root) == before


def test_import_of_a_missing_file_into_a_new_root_leaves_nothing(tmp_path, capsys):
    assert main(["import", "--root", str(tmp_path / "B"), str(tmp_path / "none")]) == 2
    assert "no such bundle" in capsys.readouterr().err
    assert not (tmp_path / "B").exists()


def test_bad_compress_argument_is_a_usage_error(src_root, tmp_path):
    with pytest.raises(SystemExit):
        main(["export", "--root", str(src_root), "chat", str(tmp_path / "z"), "--compress", "99"])


def test_lease_listing_release_and_refusal(tmp_path, src_root, s3_bucket, capsys):
    remote = s3_bucket.url("cli-lease")  # SeaweedFS, a real S3 server
    assert main(["push", "--root", str(src_root), "--remote", remote, "--host-id", "A", "chat",
                 "--keep-lease"]) == 0
    capsys.readouterr()
    assert main(["lease", "--root", str(src_root), "--remote", remote, "--json"]) == 0
    [lease] = last_json(capsys.readouterr().out)["leases"]
    assert lease["session_id"] == "chat" and lease["owner"] == "A" and lease["live"]
    assert main(["pull", "--root", str(tmp_path / "B"), "--remote", remote, "--host-id", "B",
                 "chat"]) == 4
    assert "held live by host 'A'" in capsys.readouterr().err
    assert main(["lease", "--root", str(src_root), "--remote", remote, "--host-id", "A", "chat",
                 "--release"]) == 0
    assert main(["pull", "--root", str(tmp_path / "B"), "--remote", remote, "--host-id", "B",
                 "chat", "--json"]) == 0
    assert last_json(capsys.readouterr().out)["lease"]["owner"] == "B"


def _gen(root, *extra: str) -> list[str]:
    return ["generate", "--root", str(root), "--session", "s", "--json", *extra]


def test_generate_through_the_fleet_continues_token_exact_on_another_host(tmp_path, s3_bucket, capsys):
    remote = ["--remote", s3_bucket.url("cli-generate")]  # SeaweedFS, a real S3 server
    first = ["--model", "tiny", "--prompt-ids", "72,101,108,108,111", "--max-new", "6",
             "--temperature", "0.8", "--seed", "3"]
    assert main(_gen(tmp_path / "U", *first)) == 0  # the uninterrupted reference, no fleet
    ref_1 = last_json(capsys.readouterr().out)["tokens"]
    assert main(_gen(tmp_path / "U", "--max-new", "5")) == 0
    ref_2 = last_json(capsys.readouterr().out)["tokens"]

    assert main(_gen(tmp_path / "A", *first, *remote, "--host-id", "host-a")) == 0
    out = last_json(capsys.readouterr().out)
    assert out["tokens"] == ref_1 and out["remote"]["lease"] == "released"
    # host B has never seen the session: it is pulled, continued, pushed; B keeps the lease
    assert main(_gen(tmp_path / "B", "--max-new", "5", *remote, "--host-id", "host-b",
                     "--keep-lease")) == 0
    out = last_json(capsys.readouterr().out)
    assert out["tokens"] == ref_2 and out["remote"]["lease"] == "held"
    before = tree_state(tmp_path / "A")
    assert main(_gen(tmp_path / "A", "--max-new", "1", *remote, "--host-id", "host-a")) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "held live by host 'host-b'" in err
    assert tree_state(tmp_path / "A") == before  # refused: host A's store is untouched
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1", *remote]) == 2
    assert "--remote needs --root and --session" in capsys.readouterr().err


def test_generate_with_an_unreachable_fleet_store_is_one_line_and_leaves_no_store(tmp_path, capsys,
                                                                                 monkeypatch):
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        code = main(_gen(tmp_path / "fresh", "--model", "tiny", "--prompt-ids", "1,2",
                         "--remote", "s3://fleet/nowhere"))
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "Could not connect" in err
    assert not (tmp_path / "fresh").exists()
