"""Durable streaming's default has one home, ``sessions.DURABLE_STREAM`` (issue 39: on, since
``bench.durable_stream`` holds its goal): ``serve`` and ``chat`` take it when given neither flag,
``--durable-stream`` and ``--no-durable-stream`` each win over it, and a server's config says the same."""
from __future__ import annotations

import pytest

from sessionstore.service.http.server import ServeConfig
from sessionstore.sessions import DURABLE_STREAM
from tools.coli_kv import build_parser

BASE = {"serve": ["serve", "--http", "127.0.0.1:0", "--root", "r", "--model", "m"],
        "chat": ["chat", "--root", "r", "--model", "m", "--session", "s"]}


@pytest.mark.parametrize("command", sorted(BASE))
@pytest.mark.parametrize(("flags", "durable"), [([], DURABLE_STREAM), (["--no-durable-stream"], False),
                                                (["--durable-stream"], True)])
def test_the_flags_win_over_the_one_default(command: str, flags: list[str], durable: bool) -> None:
    args = build_parser().parse_args([*BASE[command], *flags])
    assert args.durable_stream is durable


def test_a_server_config_takes_the_same_default() -> None:
    assert ServeConfig(root="r", model="m").durable_stream is DURABLE_STREAM
