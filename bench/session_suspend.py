"""bench/session.py's suspend figure (b): ``suspend()`` after one more decoded token against a raw
write + fsync of one record, the same session staged instead of written behind, and the floor of
two ordered barriers, each side timed after the disk was idle for as long as a decode step."""
from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from sessionstore.kvfile import Dims, wait_for_unmaps
from sessionstore.sessions import Session, make_digest


def bench_suspend(s: Session, directory: str, reps: int) -> dict:
    """suspend() after one more token vs raw write + fsync of one record; plus the floor."""
    rec = Dims(**s.manifest.dims)
    record = os.urandom(45_556 if rec.n_layers == 78 else 4096)
    raw_path = os.path.join(directory, "raw-record.bin")
    floor_path = os.path.join(directory, "floor.bin")
    reps = max(reps, 4)
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    floor_fd = os.open(floor_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    side_fd = os.open(floor_path + ".colisum", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(floor_fd, bytes(40 + 64 * len(record)))  # allocated, initialised blocks
    os.write(side_fd, bytes(64 + 8 * 64))
    os.fsync(floor_fd)
    os.fsync(side_fd)
    helper = ThreadPoolExecutor(1)
    decode_s: list[float] = []
    s.options = replace(s.options, verify=False)
    rng = np.random.default_rng(1)
    floor_n = 0

    def settle() -> None:
        wait_for_unmaps()  # our deferred unmap must not run during the baseline (nor ours)

    def raw() -> float:
        settle()
        t0 = time.perf_counter()
        os.write(fd, record)
        os.fsync(fd)
        return time.perf_counter() - t0

    def floor(sidecar: bool) -> float:
        """Two ordered barriers, as the commit protocol needs at the least: the record
        overwritten in place + fdatasync, then the 4-byte commit word + fdatasync; with
        ``sidecar``, an 8-byte entry + 64-byte header overwritten and fdatasynced concurrently
        with the first barrier (in a helper thread), as the checksum rule asks."""
        nonlocal floor_n
        settle()
        t0 = time.perf_counter()
        wait = None
        if sidecar:
            os.pwrite(side_fd, record[:8], 64 + 8 * (floor_n % 64))
            os.pwrite(side_fd, record[:64], 0)
            wait = helper.submit(os.fdatasync, side_fd)
        os.pwrite(floor_fd, record, 40 + (floor_n % 64) * len(record))
        os.fdatasync(floor_fd)
        if wait is not None:
            wait.result()
        floor_n += 1
        os.pwrite(floor_fd, floor_n.to_bytes(4, "little"), 32)
        os.fdatasync(floor_fd)
        return time.perf_counter() - t0

    phases: dict[str, list[float]] = {"kv_commit": [], "state_wait": [], "state_write": [],
                                      "release": [], "unmap_deferred": []}

    def suspend_only() -> float:
        t0 = time.perf_counter()
        s.suspend()
        took = time.perf_counter() - t0
        wait_for_unmaps()
        return took

    def suspend() -> float:
        t0 = time.perf_counter()
        s.suspend()  # commit (kv commit, then the manifest) + release of cache, mapping, lock
        took = time.perf_counter() - t0
        t1 = time.perf_counter()
        wait_for_unmaps()  # after the timing: how long the background unmap took
        phases["unmap_deferred"].append(time.perf_counter() - t1)
        ct, st = s.commits.timing, s.suspend_timing
        phases["kv_commit"].append(ct["kv_commit_s"])
        phases["state_wait"].append(ct["state_wait_s"])
        phases["state_write"].append(ct["state_write_s"])
        phases["release"].append(st["release_s"])
        return took

    times: dict[str, list[float]] = {"raw": [], "floor": [], "floor_side": [], "ours": [],
                                     "ours_staged": []}
    digest_s: list[float] = []
    try:
        for _ in range(reps):
            # Every side is timed in the same state: after the disk was idle for as long as a
            # decode step (the first barrier after a pause costs 2-4x the next ones here).
            for name, write_behind in (("ours", True), ("ours_staged", False)):
                s.options = replace(s.options, write_behind=write_behind)  # the writer's mode, from this resume on
                s.ensure_resident()
                t0 = time.perf_counter()
                logits = s.append_tokens([int(rng.integers(2, rec.vocab))], commit=False)  # +1 token
                decode_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                make_digest(logits, s.files.live_cache.length - 1)  # what the decode step paid for it (hot)
                digest_s.append(time.perf_counter() - t0)
                idle = min(max(decode_s[-1], 0.5), 1.5)
                settle()
                if name == "ours":
                    times[name].append(suspend())
                else:
                    times[name].append(suspend_only())
            for name, fn in (("raw", raw), ("floor", lambda: floor(False)),
                             ("floor_side", lambda: floor(True))):
                settle()
                time.sleep(idle)
                times[name].append(fn())
    finally:
        s.options = replace(s.options, write_behind=True)
        helper.shutdown()
        for f in (fd, floor_fd, side_fd):
            os.close(f)
    base_s, ours_s = statistics.median(times["raw"]), statistics.median(times["ours"])
    staged_s = statistics.median(times["ours_staged"])
    floor_s, floor_side_s = statistics.median(times["floor"]), statistics.median(times["floor_side"])
    return {"suspend_ratio": ours_s / base_s, "suspend_s": ours_s, "raw_write_fsync_s": base_s,
            "suspend_floor_s": floor_s, "suspend_floor_ratio": floor_s / base_s,
            "suspend_floor_sidecar_s": floor_side_s, "suspend_floor_sidecar_ratio": floor_side_s / base_s,
            "decode_step_s": statistics.median(decode_s),
            "suspend_staged_s": staged_s, "suspend_staged_ratio": staged_s / base_s,
            "digest_in_decode_s": statistics.median(digest_s),
            **{f"suspend_{k}_s": statistics.median(v) for k, v in phases.items()}}


__all__ = ["bench_suspend"]
