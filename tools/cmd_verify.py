"""``coli-kv verify PATH [--json]``: structure, NaN codes, inert rows, sidecar checksums.

Exit 0 only if the file is sound; 3 when it is corrupt. A stale or torn tail, an absent sidecar
and records the sidecar does not cover are reported but never make the file unsound.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from sessionstore.kvfile import VerifyReport, verify_file
from tools._common import unsound_line

EXIT_UNSOUND = 3


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("verify", help="check a .coli_kv file and its checksum sidecar")
    parser.add_argument("path", help=".coli_kv file to check (never modified)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--no-sidecar", action="store_true", help="skip the checksum sidecar")
    parser.set_defaults(func=run)


def _print_human(report: VerifyReport) -> None:
    print(f"file      {report.path}")
    print(f"version   v{report.version}, {report.nrec} complete records of {report.record_bytes} bytes "
          f"(header nrec {report.header_nrec}), stale tail {report.stale_tail_bytes} bytes")
    counts = report.counts
    print(f"rows      NaN codes {counts['lc_nan_codes']}+{counts['rc_nan_codes']}, inert rows "
          f"{counts['lc_inert_rows']}+{counts['rc_inert_rows']} (Lc+Rc), non-finite "
          f"{counts['nonfinite_values'] + counts['index_nonfinite']}, tokens out of range "
          f"{counts['tokens_out_of_range']}")
    if report.sidecar is not None:
        side = report.sidecar
        extra = f", {side.get('vouched', 0)} vouched, {side.get('mismatched', 0)} mismatched" \
            if "vouched" in side else ""
        print(f"sidecar   {side['status']}{extra}")
    for note in report.notes:
        print(f"note      {note}")
    for warning in report.warnings:
        print(f"warning   {warning}")
    for problem in report.problems:
        print(f"PROBLEM   {problem}")
    print("result    " + ("sound" if report.sound else "UNSOUND"))


def run(args: argparse.Namespace) -> int:
    report = verify_file(args.path, check_sidecar=not args.no_sidecar)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        _print_human(report)
    if report.sound:
        return 0
    print(f"coli-kv verify: error: {unsound_line(report)}", file=sys.stderr)
    return EXIT_UNSOUND
