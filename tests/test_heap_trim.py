"""deployments/runtime/heap_trim.py: malloc_trim gives a fragmented heap's free pages back (glibc on Linux)."""

import ctypes
import platform

import pytest

from deployments.runtime.heap_trim import HeapTrimmer, resident_bytes

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


@glibc_only
def test_trim_gives_back_freed_heap_pages_that_glibc_keeps():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunk = 64 * 1024  # below glibc's mmap threshold: from the heap, as the workers' mid-size buffers
    buffers = [libc.malloc(chunk) for _ in range(1600)]  # 100 MiB
    for buffer in buffers:
        ctypes.memset(buffer, 1, chunk)  # resident
    for buffer in buffers[:-1]:
        libc.free(buffer)  # the last stays: the freed space is below it, so glibc cannot shrink the heap's top
    trimmer = HeapTrimmer(interval_s=0)
    try:
        before = resident_bytes()
        released = trimmer.trim()
        assert released > 50 * 2**20, (before, released)
        assert resident_bytes() < before - 50 * 2**20
        assert trimmer.stats()["heap_trims"] == 1
        assert trimmer.stats()["heap_trim_released_bytes"] == released
    finally:
        libc.free(buffers[-1])


def test_no_thread_when_off():
    assert HeapTrimmer(interval_s=0).start() is None
