"""``coli-kv convert SRC DST --to v1|v2|v3 [--tq-bits B] [--tq-codec int4|polar] [--force]``:
rewrite a file as v1, v2 or v3, never in place."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kernels.errors import CorruptionError
from sessionstore.kvfile import convert_file, parse_version, target_codec, verify_file
from tools._common import unsound_line


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("convert", help="write a v1 (f32), v2 (fp8) or v3 (4-bit) copy of a .coli_kv file")
    parser.add_argument("src", help="source .coli_kv file (read only)")
    parser.add_argument("dst", help="destination path (never the source)")
    parser.add_argument("--to", required=True, choices=("v1", "v2", "v3"), help="target version")
    parser.add_argument("--tq-bits", type=int, choices=range(2, 7), metavar="B", default=None,
                        help="v3: bits per code, 2..6 (default 4)")
    parser.add_argument("--tq-codec", choices=("int4", "polar"), default=None,
                        help="v3: rotated int4 (4 bits only; the default at 4 bits) or PolarQuant "
                             "(the default otherwise)")
    parser.add_argument("--force", action="store_true", help="replace an existing DST")
    parser.add_argument("--unverified", action="store_true",
                        help="convert even a source that `coli-kv verify` calls unsound (salvage: DST's"
                             " fresh sidecar then vouches for the damaged records)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.set_defaults(func=run)


def check_source(path: str) -> None:
    """Refuse an unsound source (checksum mismatch, token out of range): a converted copy gets a
    fresh sidecar, which would vouch for the damage and hide it from every later check."""
    report = verify_file(path)
    if not report.sound:
        raise CorruptionError(f"{unsound_line(report)}; refusing to convert it (see `coli-kv verify`,"
                              " or --unverified to salvage it anyway)")


def run(args: argparse.Namespace) -> int:
    codec = target_codec(parse_version(args.to), args.tq_bits, args.tq_codec)  # bad options: before any read
    if not args.unverified:
        check_source(args.src)
    bar = None
    progress = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=0, unit="rec", desc="convert", file=sys.stderr)

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

    try:
        result = convert_file(args.src, args.dst, args.to, codec=codec, force=args.force, progress=progress,
                              check_source=False)  # check_source() ran (or --unverified)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps({"src": result.src, "dst": result.dst, "from_version": result.from_version,
                          "to_version": result.to_version, "to_kv_dtype": result.to_kv_dtype,
                          "nrec": result.nrec,
                          "bytes_written": result.bytes_written, "sidecar": result.sidecar,
                          "seconds": round(result.seconds, 6)}))
    else:
        print(f"wrote {result.dst}: v{result.from_version} -> v{result.to_version} ({result.to_kv_dtype}), "
              f"{result.nrec} records, "
              f"{result.bytes_written} bytes; sidecar {result.sidecar}")
    return 0
