"""``coli-kv``: the command-line entry point.

Each sub-command lives in its own module ``tools/cmd_<name>.py`` exposing
``register(subparsers) -> None``; the parser it adds sets ``func=handler`` where
``handler(args) -> int``. Errors of ours (:class:`ColiError`) become one line on stderr
and a non-zero exit; anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from tools import early_core

# Sub-command modules, in help order. A module that is absent is skipped, so the CLI
# works while the project grows.
COMMAND_MODULES = (
    "tools.cmd_inspect",
    "tools.cmd_verify",
    "tools.cmd_convert",
    "tools.cmd_generate",
    "tools.cmd_chat",
    "tools.cmd_sessions",
    "tools.cmd_slots",
    "tools.cmd_demo",
    "tools.cmd_fleet_demo",
    "tools.cmd_migrate",
    "tools.cmd_serve",
)


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a usage error as ONE line on stderr (exit 2), like our other errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="coli-kv",
        description="Inspect, convert and verify .coli_kv latent-KV files; run persistent MLA sessions.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)
    return parser


def _remote_errors() -> tuple[type[BaseException], ...]:
    """Network/object-store failures (endpoint down, bad credentials) from the optional S3 stack:
    the migration room's one list of them, imported only when an error escapes."""
    from sessionstore.migration import store_errors

    return store_errors()


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(argv) if argv is not None else sys.argv[1:]
    if early_core.wants_core(args_in):  # before our imports: the core's run beside them (tools/early_core.py)
        early_core.start()
    try:
        return _main(args_in)
    finally:
        early_core.discard()  # a core the server did not take (a refused argument, an error)


def _main(argv: list[str]) -> int:
    from kernels.errors import ColiError  # here, not at the top: see main

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except ColiError as exc:
        print(f"coli-kv {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"coli-kv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 141
    except OSError as exc:  # unreadable file, full disk, permission: one line, no traceback
        print(f"coli-kv {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except _remote_errors() as exc:
        print(f"coli-kv {args.command}: error: remote object store: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
