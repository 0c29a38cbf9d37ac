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
from tools.blas_threads import default_to_one_blas_thread

# Sub-command modules, in help order, with the commands each registers: a command line that names
# one imports that module alone (a server's start does not import every other command's room); help,
# or no command, imports them all. A module that is absent is skipped, so the CLI works while the
# project grows. (A test holds each module's registered commands equal to its entry here.)
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "tools.cmd_inspect": ("inspect",),
    "tools.cmd_verify": ("verify",),
    "tools.cmd_convert": ("convert",),
    "tools.cmd_generate": ("generate",),
    "tools.cmd_chat": ("chat",),
    "tools.cmd_sessions": ("ls", "rm", "fork"),
    "tools.cmd_slots": ("import-slot", "export-slot"),
    "tools.cmd_demo": ("demo",),
    "tools.cmd_fleet_demo": ("fleet-demo",),
    "tools.cmd_migrate": ("export", "import", "push", "pull", "lease"),
    "tools.cmd_serve": ("serve",),
}


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a usage error as ONE line on stderr (exit 2), like our other errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The CLI's parser: every command's, or only the one ``argv`` names first (its module alone imported)."""
    parser = _OneLineErrorParser(
        prog="coli-kv",
        description="Inspect, convert and verify .coli_kv latent-KV files; run persistent MLA sessions.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    named = [name for name, commands in COMMAND_MODULES.items() if argv and argv[0] in commands]
    for name in named or COMMAND_MODULES:
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
    default_to_one_blas_thread()  # before numpy's first import, here and in the core's process (tools/blas_threads.py)
    if early_core.wants_core(args_in):  # before our imports: the core's run beside them (tools/early_core.py)
        early_core.start()
    try:
        return _main(args_in)
    finally:
        early_core.discard()  # a core the server did not take (a refused argument, an error)


def _main(argv: list[str]) -> int:
    from kernels.errors import ColiError  # here, not at the top: see main

    parser = build_parser(argv)
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
