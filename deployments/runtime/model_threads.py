"""The threads a worker runs its model on: a first lane that takes every call it can, side lanes for calls
that arrive while it is busy, the CPU threads split among the calls.

Why not the actor's own call threads: a Ray actor with ``max_concurrency`` runs each call on one of a pool
of threads, and OpenMP sizes every new thread at OMP_NUM_THREADS (Ray sets it to the actor's ``num_cpus``,
1 here), whatever ``torch.set_num_threads`` said in the constructor's thread. The target's passes took ~15%
longer served than in process that way (oneDNN's bf16 linear layers 2x; docs/decisions/model-threads.md).
Why a split: one request alone should get every thread (its latency), concurrent
requests should not oversubscribe the cores (throughput). A call gets ``threads // sharing``, at least 1.
``sharing`` counts the calls running here, plus one while other requests are at the other model, whose
passes use the same cores. Each share sizes both OpenMP and MKL, which keeps its own count.

Why one lasting lane, with the model loaded on it, and side lanes that end: libgomp keeps a team of threads
for every thread that has run a parallel region with more than one thread. Once the teams hold more threads
than the process has CPUs, libgomp stops spinning between parallel regions, and each region then waits on a
futex to wake its team. That cost comes with every region, so it hurts small passes most: the int8
drafter's token took 50 ms instead of 20 ms (docs/decisions/model-threads.md). So only the first lane
keeps a team. The constructor's thread runs no model work. A side lane's thread ends once the first lane is
free again, and its team goes with it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch


def _torch_library(name: str) -> ctypes.CDLL | None:
    """A shared library torch loaded from its own lib folder (``name`` in its file name), or None."""
    torch_lib = str(Path(torch.__file__).parent / "lib")
    try:
        mapped = Path("/proc/self/maps").read_text().split()
    except OSError:  # not Linux
        return None
    paths = sorted({path for path in mapped if name in Path(path).name and path.startswith(torch_lib)})
    return ctypes.CDLL(paths[0]) if paths else None


def torch_openmp() -> ctypes.CDLL | None:
    """torch's own OpenMP runtime (its CPU wheels ship libgomp), or None where it has none or is not Linux.

    Its ``omp_set_num_threads`` sizes the calling thread only, unlike ``torch.set_num_threads`` (which also
    changes the process-wide default and clears oneDNN's primitive cache)."""
    return _torch_library("libgomp")


def torch_mkl_threads() -> Callable[[int], int] | None:
    """MKL's per-thread thread count setter in torch's CPU library (the C one, by value; the lower-case
    names are MKL's Fortran interface, by pointer), or None where torch has no MKL.

    MKL's BLAS (torch's CPU attention, float32 matmuls) sizes its parallel regions from MKL's own count,
    which ``omp_set_num_threads`` leaves alone; without this, a one-thread share still ran them on two."""
    library = _torch_library("libtorch_cpu")
    return getattr(library, "MKL_Set_Num_Threads_Local", None) if library is not None else None


def usable_cpus() -> int:
    """The CPUs libgomp counts for this process (its affinity mask)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ModelThreads:
    """Runs model work on threads of its own; each call gets its share of ``threads`` CPU threads.

    The first lane lives as long as the worker and takes every call it can. A call that arrives while it is
    busy gets a side lane (up to ``lanes - 1``), a thread that lives while the first lane stays busy and
    calls wait. When it ends, libgomp frees its team. Its team is also capped at the CPUs the first lane
    leaves spare."""

    def __init__(self, name: str, lanes: int, threads: int | None = None,
                 at_other_model: Callable[[], int] = lambda: 0):
        self.name = name
        self.at_other_model = at_other_model  # requests between this worker's calls, whose passes take its cores
        self.threads = threads or torch.get_num_threads()
        self.lanes = lanes
        spare_cpus = max(0, usable_cpus() - self.threads)
        self.side_lane_threads = min(self.threads, 1 + spare_cpus // max(1, lanes - 1))
        self._openmp = torch_openmp()
        self._mkl_threads = torch_mkl_threads()
        self._waiting: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self._changed = threading.Condition()
        self._first_lane_busy = False
        self._side_lanes = 0
        self._running = 0
        self._stopped = False
        self._first = threading.Thread(target=self._first_lane, name=f"{name}_0", daemon=True)
        self._first.start()

    def __enter__(self) -> "ModelThreads":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self, timeout_s: float = 60.0) -> None:
        """End the lanes once the calls already queued are done, waiting up to ``timeout_s`` for the first. For
        a process that goes on (tests, an application embedding a worker): each lane's libgomp team goes with its
        thread, and teams left over past the CPU count make every parallel region of the process wake its team
        on a futex (the module docstring): beside 22 leftover lanes a token cost 1.46-1.64x
        (docs/decisions/model-threads.md)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        if self._first is not threading.current_thread():
            self._first.join(timeout_s)

    def run(self, work: Callable[..., Any], *args) -> tuple[Any, float]:
        """``work(*args)`` on a lane: its result and its seconds there (time queued for a lane not counted)."""
        done: Future = Future()
        with self._changed:
            if self._stopped:
                raise RuntimeError(f"{self.name}: the model threads were stopped")
            self._waiting.append((done, work, args))
            self._open_side_lane()
            self._changed.notify_all()
        return done.result()

    def _open_side_lane(self) -> None:
        """Under ``_changed``: a side lane for a waiting call the busy first lane cannot take."""
        if self._first_lane_busy and self._waiting and self._side_lanes < self.lanes - 1:
            self._side_lanes += 1
            threading.Thread(target=self._side_lane, name=f"{self.name}_side", daemon=True).start()

    def _first_lane(self) -> None:
        current = self._size_lane()
        while True:
            with self._changed:
                while not self._waiting:
                    if self._stopped:
                        return  # the thread ends, and libgomp frees its team
                    self._changed.wait()
                call = self._waiting.popleft()
                self._first_lane_busy = True
                self._running += 1
                share = self._share(self.threads)
                self._open_side_lane()
            current = self._run_call(call, share, current)
            with self._changed:
                self._first_lane_busy = False

    def _side_lane(self) -> None:
        current = self._size_lane()
        while True:
            with self._changed:
                if not (self._waiting and self._first_lane_busy):
                    self._side_lanes -= 1
                    return  # the thread ends, and libgomp frees its team
                call = self._waiting.popleft()
                self._running += 1
                share = self._share(self.side_lane_threads)
            current = self._run_call(call, share, current)

    def _share(self, most: int) -> int:
        """Under ``_changed``: the threads of a call starting now, at most ``most``. Requests at the other model
        (being served, not in a call here) have its passes take the same cores: one more call. Counted as
        requests in calls here, a batched call of n requests read as n - 1 elsewhere and ran every pass on
        one thread of two (docs/decisions/model-threads.md)."""
        sharing = self._running + (1 if self.at_other_model() else 0)
        return max(1, min(most, self.threads // sharing))

    def _size_lane(self) -> int:
        torch.set_num_threads(self.threads)  # without per-thread control (no libgomp found), the whole share
        # torch sizes a thread at the process-wide count on its first parallel op, undoing an earlier
        # omp_set_num_threads; get_num_threads does that first sizing now
        return torch.get_num_threads()

    def _run_call(self, call: tuple[Future, Callable[..., Any], tuple], share: int, current: int) -> int:
        """Runs one call at ``share`` threads; the lane's thread count after it."""
        done, work, args = call
        if self._openmp is not None and share != current:
            self._openmp.omp_set_num_threads(share)
            if self._mkl_threads is not None:
                self._mkl_threads(share)
            current = share
        try:
            if done.set_running_or_notify_cancel():
                started = time.perf_counter()
                result = work(*args)
                done.set_result((result, time.perf_counter() - started))
        except BaseException as error:  # the caller gets it; the lane lives on
            done.set_exception(error)
        finally:
            with self._changed:
                self._running -= 1
                self._changed.notify_all()
        return current
