"""``coli-kv inspect PATH [--json] [--tokens]``: what a .coli_kv file holds. Read-only, always."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np

from kernels.tq import usable_radius
from sessionstore.kvfile import RecordScan, open_kv, scan_records, sidecar_path, usable_scales

TOKENS_SHOWN = 8  # first and last few token ids without --tokens


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("inspect", help="show a .coli_kv file's header, tokens and row statistics")
    parser.add_argument("path", help=".coli_kv file to read (never modified)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--tokens", action="store_true", help="list every token id")
    parser.set_defaults(func=run)


def _stats(scales: np.ndarray, version: int = 2) -> dict[str, float | None]:
    """min/median/max over the usable scales (v2: 0 < scale < 3.4e38; v3 radii: 0 < r < 3.4e38)
    of one layer: [nrec] f32."""
    mask = usable_scales(scales) if version == 2 else usable_radius(scales) & (scales != 0)  # [nrec] bool
    usable = scales[mask]  # [u] f32
    if usable.size == 0:
        return {"min": None, "median": None, "max": None}
    return {"min": float(usable.min()), "median": float(np.median(usable)), "max": float(usable.max())}


def _layers(scan: RecordScan, version: int) -> list[dict[str, Any]]:
    layers = []
    for i, counts in enumerate(scan.layers):
        entry: dict[str, Any] = {"layer": i}
        if version in (2, 3) and scan.lc_scales is not None and scan.rc_scales is not None:
            entry.update(lc_scale=_stats(scan.lc_scales[:, i], version), rc_scale=_stats(scan.rc_scales[:, i], version),
                         lc_inert_rows=counts.lc_inert_rows, rc_inert_rows=counts.rc_inert_rows,
                         lc_nan_codes=counts.lc_nan_codes, rc_nan_codes=counts.rc_nan_codes)
        else:
            entry.update(nonfinite_values=counts.nonfinite_values)
        layers.append(entry)
    return layers


def inspect_file(path: str, *, all_tokens: bool = False) -> dict[str, Any]:
    """The facts ``inspect`` prints, as a JSON-ready dict."""
    with open_kv(path) as reader:
        d = reader.dims
        tokens = reader.tokens  # [nrec] i32 view
        shown_all = all_tokens or reader.nrec <= 2 * TOKENS_SHOWN
        scan = scan_records(reader)
        warnings = list(reader.warnings)
        if reader.header.nrec == 0:
            warnings.append("nrec = 0: nothing to resume")
        if scan.tokens_out_of_range:
            warnings.append(f"{scan.tokens_out_of_range} token id(s) outside [0, {d.vocab})")
        nan = scan.total("lc_nan_codes") + scan.total("rc_nan_codes")
        inert = scan.total("lc_inert_rows") + scan.total("rc_inert_rows")
        if nan:
            warnings.append(f"{nan} NaN codes (read as 0)")
        if inert:
            what = "radius 0 or unusable" if reader.version == 3 else "scale non-finite or <= 0"
            warnings.append(f"{inert} inert rows ({what}, read as zero rows)")
        if scan.total("nonfinite_values") or scan.index_nonfinite:
            warnings.append(f"{scan.total('nonfinite_values') + scan.index_nonfinite} non-finite f32 values")
        codec = reader.header.codec
        return {
            "path": reader.path, "version": reader.version, "kv_dtype": reader.header.kv_dtype,
            "tag": reader.header.tag, "codec": codec.kind if codec is not None else None,
            "bits": codec.bits if codec is not None else None, "n_layers": d.n_layers,
            "kv_lora": d.kv_lora, "qk_rope": d.qk_rope, "index_head_dim": d.index_head_dim,
            "n_index_layers": d.n_index_layers, "vocab": d.vocab, "header_nrec": reader.header.nrec,
            "nrec": reader.nrec, "record_bytes": reader.record_bytes, "file_bytes": reader.file_bytes,
            "stale_tail_bytes": reader.stale_tail_bytes,
            "tokens": (tokens if shown_all else tokens[:TOKENS_SHOWN]).tolist(),
            "tokens_last": [] if shown_all else tokens[-TOKENS_SHOWN:].tolist(),
            "tokens_all": shown_all,
            "sidecar": "present" if os.path.lexists(sidecar_path(reader.path)) else "absent",
            "layers": _layers(scan, reader.version), "warnings": warnings,
        }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _print_human(info: dict[str, Any]) -> None:
    kind = {1: "v1 (f32 rows)", 2: "v2 (fp8 e4m3 rows)", 3: "v3 (4-bit rows)"}[info["version"]]
    if info["version"] == 3:
        name = "rotated int4" if info["codec"] == "int4" else f"PolarQuant {info['bits']}-bit"
        kind = f"v3 ({name} rows, tag {info['tag']:#x})"
    print(f"file          {info['path']}")
    print(f"version       {kind}")
    print(f"dims          n_layers={info['n_layers']} kv_lora={info['kv_lora']} qk_rope={info['qk_rope']} "
          f"index_head_dim={info['index_head_dim']} n_index_layers={info['n_index_layers']} vocab={info['vocab']}")
    print(f"records       {info['nrec']} complete (header nrec {info['header_nrec']}), "
          f"{info['record_bytes']} bytes each")
    print(f"file          {info['file_bytes']} bytes, stale tail {info['stale_tail_bytes']} bytes")
    print(f"sidecar       {info['sidecar']}")
    head = " ".join(map(str, info["tokens"]))
    tail = " ".join(map(str, info["tokens_last"]))
    print(f"tokens        {head}" + ("" if info["tokens_all"] else f" ... {tail}"))
    for layer in info["layers"]:
        if "lc_scale" in layer:
            lc, rc = layer["lc_scale"], layer["rc_scale"]
            what = "radius" if info["version"] == 3 else "scale"
            print(f"layer {layer['layer']:>3}     Lc {what} {_fmt(lc['min'])}/{_fmt(lc['median'])}/{_fmt(lc['max'])}  "
                  f"Rc {what} {_fmt(rc['min'])}/{_fmt(rc['median'])}/{_fmt(rc['max'])} (min/median/max)  "
                  f"inert {layer['lc_inert_rows']}+{layer['rc_inert_rows']}")
        elif layer["nonfinite_values"]:
            print(f"layer {layer['layer']:>3}     {layer['nonfinite_values']} non-finite values")
    for warning in info["warnings"]:
        print(f"warning       {warning}")


def run(args: argparse.Namespace) -> int:
    info = inspect_file(args.path, all_tokens=args.tokens)
    if args.json:
        print(json.dumps(info))
    else:
        _print_human(info)
    return 0
