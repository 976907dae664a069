"""Peak device memory, one definition for every backend of ``bench throughput``: the bytes held
by live device buffers, read by a thread every ``interval_s`` during the timed run (after
warm-up), reported as the largest reading. JAX: ``device.memory_stats()['bytes_in_use']`` (XLA's
allocator: weights, the KV pool, and a running program's temporaries); torch:
``torch.cuda.memory_allocated()``. Where the platform keeps no such count (CPU) the peak is None,
printed as n/a. A figure planned from the compiled programs is reported beside it, never in its
place.

Standard library only: the hf child interpreter runs a copy of this file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

INTERVAL_S = 0.02


class PeakSampler:
    """``with PeakSampler(read) as s: ...`` then ``s.peak``: the largest of ``read()``'s values
    (taken at entry, every ``interval_s`` and at exit); None when ``read()`` gives None."""

    def __init__(self, read: Callable[[], int | None], interval_s: float = INTERVAL_S):
        self.read = read
        self.interval_s = interval_s
        self.peak: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        value = self.read()
        if value is not None:
            self.peak = value if self.peak is None else max(self.peak, int(value))
            self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> PeakSampler:
        self.sample()
        if self.peak is not None:  # nothing to watch on a platform without the statistic
            self._thread = threading.Thread(target=self._loop, name="peak-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def result(self, source: str) -> dict:
        """``peak_memory_bytes`` and what it is (``source``: the statistic read)."""
        kind = (f"device memory in use ({source}), largest of {self.samples} samples taken every "
                f"{1e3 * self.interval_s:g} ms during the timed run" if self.peak is not None
                else f"n/a: no device memory statistics on this platform ({source})")
        return {"peak_memory_bytes": self.peak, "peak_memory_kind": kind}


def host_peak_rss_bytes() -> int:
    """The process's peak resident set (an extra: host memory, not device memory)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
