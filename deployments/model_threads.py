"""The threads a worker runs its model on: a few lanes, the CPU threads split among the calls running.

Why not the actor's own call threads: a Ray actor with ``max_concurrency`` runs each call on one of a pool
of threads, and OpenMP sizes every new thread at OMP_NUM_THREADS (Ray sets it to the actor's ``num_cpus``,
1 here), whatever ``torch.set_num_threads`` said in the constructor's thread. The target's passes took ~15%
longer served than in process that way (oneDNN's bf16 linear layers 2x; benchmarks/results/
serve-before-thread-fix). Why several lanes and a split: one request alone should get every thread (its
latency), concurrent requests should not oversubscribe the cores (2 calls x 2 threads on 2 cores) nor wait
for each other's passes (throughput): a call gets ``threads // calls running``, at least 1.
"""

from __future__ import annotations

import ctypes
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch


def torch_openmp() -> ctypes.CDLL | None:
    """torch's own OpenMP runtime (its CPU wheels ship libgomp), or None where it has none or is not Linux.

    Its ``omp_set_num_threads`` sizes the calling thread only, unlike ``torch.set_num_threads`` (which also
    changes the process-wide default and clears oneDNN's primitive cache)."""
    torch_lib = str(Path(torch.__file__).parent / "lib")
    try:
        mapped = Path("/proc/self/maps").read_text().split()
    except OSError:
        return None
    paths = sorted({path for path in mapped if "libgomp" in path and path.startswith(torch_lib)})
    return ctypes.CDLL(paths[0]) if paths else None


class ModelThreads:
    """Runs model work on ``lanes`` threads of its own; each call gets its share of ``threads`` CPU threads."""

    def __init__(self, name: str, lanes: int, threads: int | None = None):
        self.threads = threads or torch.get_num_threads()
        self.lanes = lanes
        self._openmp = torch_openmp()
        self._pool = ThreadPoolExecutor(lanes, thread_name_prefix=name, initializer=self._size_lane)
        self._running = 0
        self._guard = threading.Lock()
        self._lane = threading.local()

    def _size_lane(self) -> None:
        torch.set_num_threads(self.threads)  # without per-thread control (no libgomp found), the whole share
        self._lane.share = self.threads

    def _set_share(self, share: int) -> None:
        if self._openmp is not None and share != self._lane.share:
            self._openmp.omp_set_num_threads(share)
            self._lane.share = share

    def run(self, work: Callable[..., Any], *args) -> tuple[Any, float]:
        """``work(*args)`` on a lane: its result and its seconds there (time queued for a lane not counted)."""
        def on_lane() -> tuple[Any, float]:
            with self._guard:
                self._running += 1
                share = max(1, self.threads // self._running)
            try:
                self._set_share(share)
                started = time.perf_counter()
                return work(*args), time.perf_counter() - started
            finally:
                with self._guard:
                    self._running -= 1

        return self._pool.submit(on_lane).result()
