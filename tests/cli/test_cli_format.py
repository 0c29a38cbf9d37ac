"""coli-kv inspect / verify / convert: output, exit codes, read-only, one-line errors."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sessionstore.kvfile.header import HEADER_SIZE, record_bytes
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import write_sidecar_for
from tests.kvfile.test_layout_fixtures import (
    ENGINE_DIMS,
    ENGINE_TOKENS,
    INDEXER_DIMS,
    f32_rows,
    fp8_rows,
    struct_header,
    write_kv,
)
from tools.coli_kv import main

REPO = Path(__file__).resolve().parents[2]
JSON_KEYS = {"version", "n_layers", "kv_lora", "qk_rope", "index_head_dim", "n_index_layers", "vocab",
             "nrec", "record_bytes", "file_bytes", "stale_tail_bytes", "tokens", "warnings"}


def _json_last_line(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_inspect_json_keys_and_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = fp8_rows(INDEXER_DIMS, ENGINE_TOKENS)
    rows.lc_scale[:, 0] = np.linspace(0.1, 0.5, 45, dtype=np.float32)
    rows.rc_scale[3, 1] = -1.0
    path = write_kv(tmp_path / "kv", 2, INDEXER_DIMS, rows, nrec=40, tail=b"x" * 3)
    assert main(["inspect", str(path), "--json"]) == 0
    info = _json_last_line(capsys.readouterr().out)
    assert JSON_KEYS <= set(info)
    rec = record_bytes(2, INDEXER_DIMS)
    assert (info["version"], info["n_layers"], info["kv_lora"], info["qk_rope"]) == (2, 2, 8, 4)
    assert (info["index_head_dim"], info["n_index_layers"], info["vocab"]) == (6, 2, 1000)
    assert (info["nrec"], info["record_bytes"]) == (40, rec)
    assert info["file_bytes"] == HEADER_SIZE + 45 * rec + 3
    assert info["stale_tail_bytes"] == 5 * rec + 3
    assert info["tokens"] == list(range(11, 19)) and info["tokens_last"] == list(range(43, 51))
    layer0 = info["layers"][0]["lc_scale"]
    assert layer0["min"] == pytest.approx(0.1) and layer0["max"] == pytest.approx(float(rows.lc_scale[39, 0]))
    assert layer0["median"] == pytest.approx(float(np.median(rows.lc_scale[:40, 0])))
    assert info["layers"][1]["rc_inert_rows"] == 1
    assert any("inert rows" in w for w in info["warnings"])


def test_inspect_all_tokens_and_human_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_kv(tmp_path / "kv", 1, ENGINE_DIMS, f32_rows(ENGINE_DIMS, ENGINE_TOKENS))
    assert main(["inspect", str(path), "--json", "--tokens"]) == 0
    assert _json_last_line(capsys.readouterr().out)["tokens"] == list(range(11, 56))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "v1 (f32 rows)" in out and "45 complete" in out and "11 12 13" in out


def test_inspect_is_read_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_kv(tmp_path / "kv", 2, INDEXER_DIMS, fp8_rows(INDEXER_DIMS, ENGINE_TOKENS), nrec=44,
                    tail=b"tail")
    os.utime(path, ns=(1_000_000_000, 2_000_000_000))
    before = path.read_bytes()
    for argv in (["inspect", str(path)], ["inspect", str(path), "--json", "--tokens"],
                 ["verify", str(path)], ["verify", str(path), "--json"]):
        main(argv)
    capsys.readouterr()
    assert path.read_bytes() == before
    assert path.stat().st_mtime_ns == 2_000_000_000
    assert sorted(os.listdir(tmp_path)) == ["kv"]  # no sidecar, lock or temp file created


def test_verify_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_kv(tmp_path / "kv", 2, INDEXER_DIMS, fp8_rows(INDEXER_DIMS, ENGINE_TOKENS))
    with open_kv(path) as kv:
        write_sidecar_for(kv)
    assert main(["verify", str(path), "--json"]) == 0
    report = _json_last_line(capsys.readouterr().out)
    assert report["sound"] is True and report["sidecar"]["status"] == "ok"
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 3] ^= 1
    path.write_bytes(bytes(data))
    assert main(["verify", str(path)]) == 3
    out = capsys.readouterr().out
    assert "UNSOUND" in out and "CORRUPTION" in out


def test_convert_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_kv(tmp_path / "src", 1, ENGINE_DIMS, f32_rows(ENGINE_DIMS, ENGINE_TOKENS))
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), "--to", "v2", "--json"]) == 0
    result = _json_last_line(capsys.readouterr().out)
    assert (result["nrec"], result["to_version"]) == (45, 2)
    assert main(["convert", str(src), str(dst), "--to", "v2"]) != 0
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["convert", str(src), str(dst), "--to", "v1", "--force"]) == 0
    capsys.readouterr()
    assert main(["verify", str(dst)]) == 0


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (path, expected fragment of the one-line error)."""
    good = write_kv(tmp_path / "good", 2, ENGINE_DIMS, fp8_rows(ENGINE_DIMS, ENGINE_TOKENS))
    cases: dict[str, tuple[bytes | None, str]] = {
        "wrong_magic": (b"GGUF" + b"\0" * 60, "unknown magic"),
        "short_header": (struct_header(b"COLIKV2\0", ENGINE_DIMS, 1, 1)[:21], "short header"),
        "negative_dims": (struct.pack("<8s8i", b"COLIKV1\0", -2, 8, 4, 0, 0, 1000, 1, 0), "n_layers = -2"),
        "huge_dims": (struct.pack("<8s8i", b"COLIKV1\0", 2, 2**31 - 1, 4, 0, 0, 1000, 1, 0), "exceeds the limit"),
        "size_overflow": (struct.pack("<8s8i", b"COLIKV1\0", 1024, 65536, 65536, 0, 0, 1000, 1, 0),
                          "record size"),
        "colidv41": (b"COLIDV41" + b"\0" * 100, "COLIDV41"),
        "v3_bad_tag": (struct.pack("<8s8i", b"COLIKV3\0", 2, 8, 4, 0, 0, 1000, 1, (2 << 8) | 4), "v3 format tag"),
        "v3_width": (struct.pack("<8s8i", b"COLIKV3\0", 2, 12, 4, 0, 0, 1000, 1, (1 << 8) | 4), "power of two"),
        "empty": (b"", "empty file"),
    }
    out: dict[str, tuple[str, str]] = {}
    for name, (data, fragment) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        out[name] = (str(path), fragment)
    (tmp_path / "link").symlink_to(good)
    out["symlink"] = (str(tmp_path / "link"), "symlink")
    os.mkfifo(tmp_path / "fifo")
    out["fifo"] = (str(tmp_path / "fifo"), "FIFO")
    out["directory"] = (str(tmp_path), "directory")
    out["unreadable"] = (str(good / "child"), "no such file")  # parent is a file (root ignores chmod 000)
    out["device"] = ("/dev/zero", "character device")
    return out


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_headers_the_engine_loads_read_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      command: str) -> None:
    """A v2 tag word other than 1, a negative nrec, indexer width > 0 with no indexer layers: the
    engine loads these, so inspect/verify read them (exit 0) and warn; nothing is refused."""
    d = ENGINE_DIMS
    rec = 4 + d.n_layers * (d.kv_lora + d.qk_rope + 8)
    cases = {
        "tagged": (struct_header(b"COLIKV2\0", ENGINE_DIMS, 1, 0x574D4B31) + b"\0" * rec, "tag 0x574d4b31"),
        "negative": (struct_header(b"COLIKV2\0", ENGINE_DIMS, -3, 1) + b"\0" * rec, "nrec = -3"),
        "index_width": (struct.pack("<8s8i", b"COLIKV2\0", d.n_layers, d.kv_lora, d.qk_rope, 16, 0,
                                    d.vocab, 1, 1) + b"\0" * rec, "index_head_dim = 16"),
    }
    for name, (data, fragment) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        code = main([command, str(path), "--json"])
        captured = capsys.readouterr()
        assert code == 0, (name, captured.err)
        assert fragment in captured.out, (name, captured.out)
        assert "Traceback" not in captured.err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_bad_input_is_one_line_no_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            command: str) -> None:
    for name, (path, fragment) in _bad_inputs(tmp_path).items():
        code = main([command, path, "--json"])
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert code != 0, name
        assert len(lines) == 1 and fragment in lines[0], (name, captured.err)
        assert "Traceback" not in captured.err and captured.out == "", name


def test_nrec_beyond_file_warns_not_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_kv(tmp_path / "kv", 2, ENGINE_DIMS, fp8_rows(ENGINE_DIMS, ENGINE_TOKENS), nrec=2**31 - 1)
    assert main(["inspect", str(path), "--json"]) == 0
    info = _json_last_line(capsys.readouterr().out)
    assert info["nrec"] == 45 and any("cut inside" in w for w in info["warnings"])


def test_subprocess_cli(tmp_path: Path) -> None:
    path = write_kv(tmp_path / "kv", 2, INDEXER_DIMS, fp8_rows(INDEXER_DIMS, ENGINE_TOKENS))
    env = {**os.environ, "COLI_LOG": "off"}
    run = subprocess.run([sys.executable, "-m", "tools", "inspect", str(path), "--json"], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert _json_last_line(run.stdout)["nrec"] == 45
    bad = tmp_path / "bad"
    bad.write_bytes(b"COLIDV41" + b"\0" * 40)
    for command in ("inspect", "verify"):
        run = subprocess.run([sys.executable, "-m", "tools", command, str(bad)], cwd=REPO,
                             capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 2
        assert run.stderr.count("\n") == 1 and "COLIDV41" in run.stderr and "Traceback" not in run.stderr
    run = subprocess.run([sys.executable, "-m", "tools", "convert", str(path), str(tmp_path / "out"),
                          "--to", "v1"], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""  # no progress bar when stderr is not a terminal


def test_convert_shows_progress_only_on_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_kv(tmp_path / "src", 1, ENGINE_DIMS, f32_rows(ENGINE_DIMS, ENGINE_TOKENS))
    assert main(["convert", str(src), str(tmp_path / "a"), "--to", "v2"]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["convert", str(src), str(tmp_path / "b"), "--to", "v2"]) == 0
    err = capsys.readouterr().err
    assert "convert" in err and "45/45" in err
