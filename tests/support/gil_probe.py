"""How late a sleeping thread wakes while another thread works: the measure of whether that work
keeps the GIL (an idle event loop's thread waits for it to run again)."""
from __future__ import annotations

import os
import threading
import time


def probe_while(work: threading.Thread, nap: float = 5e-4) -> list[float]:
    """Start ``work`` and, until it ends, sleep ``nap`` then call ``os.stat`` over and over: how late
    (seconds past ``nap``) each wake-up was."""
    late = []
    work.start()
    while work.is_alive():
        t0 = time.perf_counter()
        time.sleep(nap)
        os.stat(".")
        late.append(time.perf_counter() - t0 - nap)
    work.join()
    return late
