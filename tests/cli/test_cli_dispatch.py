"""The dispatcher: usage errors and our errors are one line on stderr with a non-zero exit."""
from __future__ import annotations

import argparse
import importlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tools.coli_kv import COMMAND_MODULES, main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [
    ["generate", "--bogus"],
    ["inspect"],
    ["convert", "a", "b", "--to", "v9"],
    ["no-such-command"],
])
def test_usage_errors_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "error:" in err and "--help" in err


def test_v2_header_alone_with_nrec_is_not_called_forked(tmp_path, capsys):
    """A v2 file cut to exactly its header is torn (zero complete records), not a forked format."""
    path = tmp_path / "cut.coli_kv"
    path.write_bytes(b"COLIKV2\0" + struct.pack("<8i", 2, 8, 4, 0, 0, 256, 7, 1))
    code = main(["inspect", str(path), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "forked" not in out + err
    assert '"header_nrec": 7' in out and '"nrec": 0' in out


def test_unreachable_object_store_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    code = main(["lease", "--root", str(tmp_path / "root"), "--remote", "s3://bucket/prefix"])
    err = capsys.readouterr().err
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "remote object store" in err, err


def test_each_command_module_registers_the_commands_the_dispatcher_lists() -> None:
    """build_parser imports only the module of the command named: its list must be what the module adds."""
    for name, commands in COMMAND_MODULES.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).register(sub)
        assert tuple(sub.choices) == commands, name


def test_a_named_command_imports_no_other_command_module(capsys: pytest.CaptureFixture[str]) -> None:
    """``coli-kv serve`` (a server's start) imports no other command's module (nor the rooms only they need)."""
    probe = ("import sys, contextlib, io\nfrom tools.coli_kv import main\n"
             "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
             "    main(['serve', '--help'])\n"
             "print(sorted(m for m in sys.modules if m.startswith('tools.cmd_')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert out.strip() == "['tools.cmd_serve']", out
    with pytest.raises(SystemExit) as exc:  # its help still lists every command
        main(["--help"])
    assert exc.value.code == 0
    listed = capsys.readouterr().out
    assert all(c in listed for commands in COMMAND_MODULES.values() for c in commands), listed
