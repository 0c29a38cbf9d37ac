"""Driving the crash-state explorer (FORMAT.md 3.9): every crash point of a recorded protocol,
at 512 B and 4 KiB sectors, its states (:func:`tests.support.crash_states.states`) materialized
one after the other into one scratch directory and handed to a protocol's check.

The check gets the directory and the crash point's committed bound: the records committed
before the crash, the larger of the last acknowledged commit (``mark("ack", n)``) and what the
state with every pending op dropped holds (its fsynced commit word, read by ``bound``); a
protocol may pass its own ``acked`` (a negative bound: "may not exist yet"). Sampling is
deterministic: ``random.Random(f"{seed}:{sector}:{k}")`` per crash point, and every crash
point gets the same budget of distinct states (fewer when it has fewer).
"""
from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.crash_states import CrashPoint, Tree, final_tree, materialize, states
from tests.support.crash_trace import Op, Recorder

SECTORS = (512, 4096)
Check = Callable[[str, int], None]  # (directory, committed bound) -> None; raises AssertionError
Bound = Callable[[str], int]  # (directory of the all-dropped state) -> records its commit word holds


@dataclass
class Exploration:
    """What one exploration tried and found."""

    protocol: str
    ops: int = 0
    points: int = 0
    states: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.protocol}: {self.states} crash states over {self.points} crash points "
                f"({self.ops} recorded ops, sectors {'/'.join(map(str, SECTORS))} B) in "
                f"{self.seconds:.1f} s, {len(self.failures)} failing")


def record(root: str, setup: Callable[[str], object], protocol: Callable[[str, Recorder], object]) -> Recorder:
    """``setup(root)`` (not recorded), then ``protocol(root, recorder)`` recorded; the record is
    checked to rebuild the directory the protocol left, byte for byte."""
    os.makedirs(root)
    setup(root)
    rec = Recorder(Path(root))
    with rec.active():
        protocol(root, rec)
    rec.check_replay(final_tree)
    return rec


def last_ack(ops: list[Op], k: int, before: int = 0) -> int:
    """The last ``mark("ack", n)`` among the first ``k`` ops (``before`` if none)."""
    acks = [op.value for op in ops[:k] if op.kind == "mark" and op.label == "ack"]
    return acks[-1] if acks else before


def explore(protocol: str, rec: Recorder, check: Check, *, budget: int, seed: int = 26,
            bound: Bound | None = None, acked: Callable[[list[Op], int], int] = last_ack,
            keep_failures: int = 5, strict_rename: bool = False) -> Exploration:
    """Check up to ``budget`` distinct states at every crash point (0 .. len(ops)) and sector
    size. The check's bound is ``acked(ops, k)`` (by default the last acknowledged commit),
    raised to ``bound`` of the all-dropped state when given. ``strict_rename``: a rename across
    directories is durable only once both directories were fsynced (:class:`CrashPoint`)."""
    result = Exploration(protocol, ops=len(rec.ops))
    t0 = time.perf_counter()
    seen: set[bytes] = set()
    with tempfile.TemporaryDirectory(dir=_scratch_root()) as scratch:
        where = os.path.join(scratch, "state")
        for sector in SECTORS:
            for k in range(len(rec.ops) + 1):
                point = CrashPoint(rec.snapshot, rec.ops, k, sector, strict_rename=strict_rename)
                result.points += 1
                low = point.tree(point.extreme(keep=False))
                committed = acked(rec.ops, k)
                if bound is not None:
                    materialize(low, where)
                    committed = max(committed, bound(where))
                rng = random.Random(f"{seed}:{sector}:{k}")
                for tree in states(point, rng, budget, seen, salt=committed.to_bytes(4, "little", signed=True)):
                    result.states += 1
                    failure = _check_one(check, tree, where, committed)
                    if failure is not None:
                        op = rec.ops[k - 1] if k else None
                        result.failures.append(
                            f"crash after op {k} ({op.kind if op else 'start'}), sector {sector}, "
                            f"committed {committed}: {failure}")
                        if len(result.failures) >= keep_failures:
                            result.seconds = time.perf_counter() - t0
                            return result
    result.seconds = time.perf_counter() - t0
    return result


def _check_one(check: Check, tree: Tree, where: str, committed: int) -> str | None:
    materialize(tree, where)
    try:
        check(where, committed)
    except Exception as exc:  # every way a state fails is reported, with its tree
        names = {p: (None if d is None else len(d)) for p, d in sorted(tree.items())}
        return f"{type(exc).__name__}: {exc} [tree: {names}]"
    return None


def _scratch_root() -> str | None:
    """A RAM file system when there is one (states are written and read back many times)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


__all__ = ["Exploration", "SECTORS", "explore", "last_ack", "record"]
