"""The peak memory of a stretch of CPU work, seen two ways, sampled every millisecond by a thread.

* ``rss``: the growth of the process's resident set -- what the operating system gives it,
  including memory the C allocator has freed but kept (glibc returns heap memory to the OS
  only from the top of the heap, so the resident set stays near its high-water mark);
* ``allocated``: the growth of the bytes handed out by ``malloc`` and not yet freed (glibc's
  ``mallinfo2``: in-use heap chunks plus mmapped chunks, over every arena) -- the live
  tensors and buffers, the CPU counterpart of CUDA's ``max_memory_allocated``.

Both are measured from the moment the sampler starts (the heap trimmed first). Neither sees a
spike shorter than the sampling interval. Outside glibc ``allocated`` is None.

    with PeakSampler() as peak:
        work()
    peak.rss, peak.allocated  # bytes
"""
from __future__ import annotations

import ctypes
import gc
import threading


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None


class PeakSampler:
    def __init__(self, interval: float = 1e-3):
        import psutil

        self._proc, self._interval, self._libc = psutil.Process(), interval, _libc()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.rss = self.allocated = None

    def _allocated(self) -> int | None:
        if self._libc is None:
            return None
        m = self._libc.mallinfo2()
        return m.uordblks + m.hblkhd

    def start(self) -> "PeakSampler":
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)
        self._rss0 = self._rss_max = self._proc.memory_info().rss
        self._alloc0 = self._alloc_max = self._allocated()
        self._thread.start()
        return self

    def _sample(self):
        self._rss_max = max(self._rss_max, self._proc.memory_info().rss)
        if self._alloc0 is not None:
            self._alloc_max = max(self._alloc_max, self._allocated())

    def _run(self):
        while not self._done.wait(self._interval):
            self._sample()

    def stop(self) -> "PeakSampler":
        self._done.set()
        self._thread.join()
        self._sample()
        self.rss = self._rss_max - self._rss0
        self.allocated = None if self._alloc0 is None else self._alloc_max - self._alloc0
        return self

    def __enter__(self) -> "PeakSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
