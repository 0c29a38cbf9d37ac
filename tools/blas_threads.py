"""numpy's BLAS on one thread in every ``coli-kv`` process, unless the user chose a thread count.

The products that go through BLAS here are small: a decode step's attention is a matrix-vector
product per tile, a prefill chunk's a few hundred rows. OpenBLAS's default pool (one thread per
core) spins while it waits for its threads, so when the cores are busy with anything else (the API
process, another server, a test worker) each product waits for a thread to be scheduled: a decode
step of a 4,096-token DeepSeek-V3-shaped session (78 layers; bench.serve's resume session) took
5-10 s with the default pool on a loaded 2-core machine and 0.5-0.75 s with one thread. The engine
core runs the model on one thread anyway, and the API process beside it needs a core.

OpenBLAS reads its thread count when numpy is first imported, so this runs before that: first thing
in :func:`tools.coli_kv.main`, whose environment the engine core's process inherits. Standard library
only. A user who sets ``OPENBLAS_NUM_THREADS`` (or ``GOTO_NUM_THREADS`` / ``OMP_NUM_THREADS``, which
OpenBLAS reads in that order) keeps that choice.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

# the variables OpenBLAS takes its thread count from, in the order it reads them
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


def default_to_one_blas_thread(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``OPENBLAS_NUM_THREADS=1`` in ``environ`` unless one of :data:`BLAS_THREAD_VARIABLES` is set
    (to anything but an empty string); True when it was set here."""
    if any(environ.get(name) for name in BLAS_THREAD_VARIABLES):
        return False
    environ["OPENBLAS_NUM_THREADS"] = "1"
    return True
