"""A grid-wide barrier inside one Pallas (Triton) kernel: what a persistent kernel needs
between the phases of a decoder layer, where each phase reads what every program wrote in the
phase before (the qkv projection's output before the attention, the attention's before o).

One barrier, every program of the grid::

    arrive   the program's threads synchronize (their stores issued), then one atomic add of
             1 to the counter: Triton's atomics are acq_rel at GPU scope, so it releases
    wait     volatile loads of the counter until it reaches ``target``, or ``max_polls``
             polls (the program then reports that it gave up, instead of spinning forever)
    leave    one atomic add of 0 (the acquire: later loads see every store released before
             the other programs' arrivals), then the threads synchronize again

as CUDA's cooperative ``grid.sync()`` does. The counter is never reset within a call: the
i-th barrier (from 1) waits for ``i * programs`` arrivals, so one zeroed counter serves them
all. It needs every program of the grid resident at once (a grid within the SMs' slots): a
program waiting for one not yet started would spin to ``max_polls``. The interpreter runs the
programs one after another, so :func:`grid_barrier` refuses interpret mode.

Timed on an H100 (``benchmarks/grid_barrier.py``, RESULTS.md 2026-12-07): between phases of
the Llama-3-8B AWQ layer's weight sizes a barrier cost 2.46 us back to back against 1.89 for
XLA's kernel boundary (which overlaps the next kernel's start with the tail, PDL); only 1 MB
phases gained. So no persistent layer kernel is built on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

DEFAULT_MAX_POLLS = 1 << 22  # ~seconds of polling: far past any phase, short of a hang
INTERPRET_REFUSAL = ("a grid barrier needs every program resident at once; the interpreter "
                     "runs them one after another")


def grid_barrier(count_ref, target, *, max_polls: int = DEFAULT_MAX_POLLS,
                 interpret: bool = False) -> jax.Array:
    """Wait until ``count_ref[0]`` (an i32 counter, zero at the call's start) has counted
    ``target`` arrivals, this program's included; a bool: False where it gave up after
    ``max_polls`` polls. ``count_ref`` is a [1] (or longer) int32 ref every program shares."""
    if interpret:
        raise ValueError(INTERPRET_REFUSAL)
    pltriton.debug_barrier()  # this program's stores issued before it arrives
    pltriton.atomic_add(count_ref, (0,), jnp.int32(1))

    def waiting(carry):
        polls, seen = carry
        return (seen < target) & (polls < max_polls)

    def poll(carry):
        polls, _ = carry
        seen = pltriton.load(count_ref.at[pl.ds(0, 1)], volatile=True)[0]
        return polls + 1, seen

    _, seen = jax.lax.while_loop(waiting, poll, (jnp.int32(0), jnp.int32(0)))
    pltriton.atomic_add(count_ref, (0,), jnp.int32(0))  # the acquire
    pltriton.debug_barrier()
    return seen >= target
