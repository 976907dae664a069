"""Allocation failures, host or device, turned into one error that says what was being
allocated and which settings size it (vLLM's advice for the same failures)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jaxllm.errors import OutOfMemoryError

# What to change, per phase of the engine's life.
ADVICE = {
    "loading the weights": "use a smaller --dtype or --quantization, or more devices "
                           "(--tensor-parallel-size)",
    "allocating the KV cache": "lower --gpu-memory-utilization or "
                               "--num-gpu-blocks-override",
    "allocating the host swap space": "lower --swap-space",
    "compiling the step programs": "lower --gpu-memory-utilization (leaving the steps room "
                                   "for their temporaries), --max-num-batched-tokens or "
                                   "--max-num-seqs",
    "running a step": "lower --gpu-memory-utilization, --max-num-batched-tokens or "
                      "--max-num-seqs",
}


def is_out_of_memory(error: BaseException) -> bool:
    """A host MemoryError, or an XLA allocation failure (RESOURCE_EXHAUSTED)."""
    return isinstance(error, MemoryError) or (
        type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
        and "RESOURCE_EXHAUSTED" in str(error))


@contextlib.contextmanager
def out_of_memory_explained(phase: str) -> Iterator[None]:
    """Re-raises an allocation failure inside the block as :class:`OutOfMemoryError` naming
    ``phase`` (a key of ADVICE) and what to change; other errors pass unchanged."""
    try:
        yield
    except OutOfMemoryError:
        raise
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:300].rstrip(".")
        raise OutOfMemoryError(f"out of memory while {phase}: {detail}. To fit, "
                               f"{ADVICE[phase]}.") from e
