"""Session ids and store paths stay confined to the root."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.errors import ColiError, FormatError, LimitError
from sessionstore.sessions.paths import (
    MAX_ID_LENGTH,
    InvalidSessionIdError,
    check_component,
    confined,
    is_valid_session_id,
    resolve_root,
    validate_session_id,
)


@pytest.mark.parametrize("good", ["a", "chat-1", "A.b_c-9", "0", "x" * MAX_ID_LENGTH])
def test_valid_ids(good: str) -> None:
    assert validate_session_id(good) == good


@pytest.mark.parametrize("bad", ["", ".", "..", "../x", "a/b", "a\\b", "/abs", ".hidden", "-x",
                                 "a\0b", "a\nb", "tab\there", "ü", "a b", "..a", "_x", "a:b"])
def test_invalid_ids_refused(bad: str) -> None:
    with pytest.raises(InvalidSessionIdError):
        validate_session_id(bad)
    assert not is_valid_session_id(bad)


def test_non_string_and_too_long() -> None:
    with pytest.raises(InvalidSessionIdError):
        validate_session_id(5)  # type: ignore[arg-type]
    with pytest.raises(LimitError):
        validate_session_id("x" * (MAX_ID_LENGTH + 1))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_accepted_id_is_one_plain_component(text: str) -> None:
    try:
        sid = validate_session_id(text)
    except ColiError:
        return
    assert os.path.basename(sid) == sid and sid not in (".", "..")
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in sid)


def test_confined_refuses_symlinked_component(tmp_path) -> None:
    root = resolve_root(tmp_path / "root")
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "sessions").symlink_to(outside)
    with pytest.raises(FormatError, match="symlink"):
        confined(root, "sessions", "abc")


def test_confined_refuses_dotdot_and_separators(tmp_path) -> None:
    root = resolve_root(tmp_path)
    for bad in ("..", ".", "a/b", ""):
        with pytest.raises(InvalidSessionIdError):
            confined(root, "sessions", bad)
    assert confined(root, "sessions", "ok") == root / "sessions" / "ok"


def test_check_component_kinds(tmp_path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "d").mkdir()
    (tmp_path / "l").symlink_to(tmp_path / "d")
    assert check_component(tmp_path / "d", want="dir")
    assert check_component(tmp_path / "f", want="file")
    assert not check_component(tmp_path / "missing", want="dir")
    with pytest.raises(FormatError, match="symlink"):
        check_component(tmp_path / "l", want="dir")
    with pytest.raises(FormatError, match="expected a directory"):
        check_component(tmp_path / "f", want="dir")


def test_root_that_is_a_regular_file_is_refused_by_name(tmp_path) -> None:
    from kernels.errors import NotFoundError
    from sessionstore.sessions.store import SessionStore

    f = tmp_path / "plain-file"
    f.write_bytes(b"x")
    for create in (True, False):
        with pytest.raises(FormatError, match=r"plain-file is not a directory"):
            resolve_root(f, create=create)
        with pytest.raises(FormatError, match=r"plain-file is not a directory"):
            SessionStore(f, create=create)
    with pytest.raises(FormatError, match="not a directory"):  # a file inside the path
        resolve_root(f / "below")
    with pytest.raises(NotFoundError, match="missing is not a directory"):
        resolve_root(tmp_path / "missing", create=False)
    assert f.read_bytes() == b"x"
