"""The dispatcher: usage errors and our errors are one line on stderr with a non-zero exit."""
from __future__ import annotations

import struct

import pytest

from tools.coli_kv import main


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
