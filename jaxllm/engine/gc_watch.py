"""The collector in a serving process: its start-up heap frozen, long collections logged.

:func:`settle` is for a process's own entry point (the engine core, the API server): it
moves what start-up allocated out of the collector's generations (``gc.freeze``), so a full
collection walks only what serving allocates, and installs :func:`install`'s watch. Not for a
process that also runs other work (a test or a notebook holding several engines).
:func:`frozen_heap` is the offline run's form (``LLM.generate``, the offline benchmarks): the
heap is frozen for the run only, so what dies in a cycle afterwards is still collected.

A full collection of a serving process's heap can take ~100-200 ms (benchmarks/gc_pause.py),
far above a decode step; when a latency percentile jumps, the log says whether a collection
was there. ``JAXLLM_GC_WARN_MS`` sets the threshold (default 50 ms; 0 turns the watch off).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

DEFAULT_WARN_MS = 50.0
_settled = False  # settle() ran: the process's start-up heap stays frozen for good
_frozen_runs = 0  # frozen_heap's nesting: the outermost freezes and thaws


def settle(logger: logging.Logger, where: str) -> None:
    """Freeze what start-up allocated, then watch the collections (see the module docstring)."""
    global _settled
    gc.collect()
    gc.freeze()
    _settled = True
    install(logger, where)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside: what was allocated before is out of the collector's generations. An offline
    run's full collection then walks only the run's own objects, not the engine's start-up
    heap (its programs, the model's pytrees): 1.3 s of one H200 FP8 run (RESULTS.md,
    2026-12-06). Freezing and thawing are list splices, not walks; garbage made before the
    run waits until after it. A no-op in a settled process (:func:`settle`) and inside
    another frozen run. Not told by ``gc.get_freeze_count()``: CPython 3.12 starts with a
    few hundred objects frozen (375 here), which the thaw after the run returns to the
    oldest generation with the rest."""
    global _frozen_runs
    if _settled or _frozen_runs:
        yield
        return
    gc.freeze()
    _frozen_runs += 1
    try:
        yield
    finally:
        _frozen_runs -= 1
        gc.unfreeze()


def install(logger: logging.Logger, where: str) -> Callable | None:
    """Warn on ``logger`` for every collection longer than the threshold (once a process);
    returns the callback installed (None: off, or already installed)."""
    warn_ms = float(os.environ.get("JAXLLM_GC_WARN_MS", DEFAULT_WARN_MS))
    if warn_ms <= 0 or any(getattr(cb, "_jaxllm_gc_watch", False) for cb in gc.callbacks):
        return None
    started = [0.0]

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        ms = 1e3 * (time.perf_counter() - started[0])
        if ms >= warn_ms:
            logger.warning("%s: a generation-%d garbage collection took %.0f ms (%d objects "
                           "collected)", where, info.get("generation", -1), ms,
                           info.get("collected", 0))

    watch._jaxllm_gc_watch = True
    gc.callbacks.append(watch)
    return watch
