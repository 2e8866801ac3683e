"""Hands the C heap's free pages back to the system now and then, in a model worker's process.

Why: under an hour of mixed traffic the drafter's RSS climbed ~3.5 MiB/min while its live heap stayed flat
(jemalloc's heap profiles; docs/deploy.md, "Memory allocator of the model workers"): glibc keeps the pages of
freed buffers of many sizes, in several threads' arenas, mapped. ``MALLOC_MMAP_THRESHOLD_=65536`` gives each
big buffer back as it is freed, but then every one is mapped and faulted in anew: the realistic pair ran 21%
slower with it (docs/decisions/heap-trim.md). glibc's ``malloc_trim(0)`` gives back the free
pages of every arena in one call, a cost paid once per interval instead of once per buffer. Under another
allocator (jemalloc preloaded: its own decay returns pages) or another C library the call is a no-op or absent.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("ray.serve")


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` of this process, or None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def resident_bytes() -> int:
    """This process's resident set (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class HeapTrimmer:
    """``trim()`` once, or ``start()`` a daemon thread that trims every ``interval_s`` seconds (0: never) until
    ``stop()``."""

    interval_s: float
    trims: int = 0
    seconds: float = 0.0  # spent in malloc_trim, all calls together
    released_bytes: int = 0  # resident memory the calls gave back, all together (about: other threads run on)

    def __post_init__(self) -> None:
        self._trim = _malloc_trim()
        self._stop = threading.Event()

    def stop(self) -> None:
        """End the thread ``start`` began (at its next wake-up; a trim in progress finishes)."""
        self._stop.set()

    def trim(self) -> int:
        """Give the free pages back now; the resident bytes that freed (0 if none, or no malloc_trim)."""
        if self._trim is None:
            return 0
        before, tick = resident_bytes(), time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - tick
        released = max(0, before - resident_bytes())
        self.trims += 1
        self.released_bytes += released
        return released

    def start(self) -> threading.Thread | None:
        if self.interval_s <= 0 or self._trim is None:
            if self.interval_s > 0:
                log.info("heap trimming off: this C library has no malloc_trim")
            return None

        def run() -> None:
            while not self._stop.wait(self.interval_s):
                self.trim()

        thread = threading.Thread(target=run, name="heap-trimmer", daemon=True)
        thread.start()
        return thread

    def stats(self) -> dict:
        return {"heap_trims": self.trims, "heap_trim_seconds": round(self.seconds, 4),
                "heap_trim_released_bytes": self.released_bytes}
