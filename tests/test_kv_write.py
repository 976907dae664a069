"""``write_kv``: each real token's K/V lands at its slot of the layer, padded tokens (PAD_SLOT)
write nothing, whatever the step's size (a one-token step included, which the write pads to
two rows to keep XLA's scatter)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kv_pool import PAD_SLOT, KVPool, write_kv

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 4, 4, 2, 8


def expected(pool: np.ndarray, layer: int, slots: list[int], x: np.ndarray) -> np.ndarray:
    out = pool.copy()
    for row, slot in enumerate(slots):
        if slot != PAD_SLOT:
            out[layer, slot // BLOCK, slot % BLOCK] = x[row]
    return out


@pytest.mark.parametrize("slots", [[5], [PAD_SLOT], [0, PAD_SLOT, 15], [PAD_SLOT, PAD_SLOT]],
                         ids=["one_token", "one_padded_token", "three_tokens", "all_padded"])
def test_tokens_land_at_their_slots_and_padding_writes_nothing(slots):
    rng = np.random.default_rng(len(slots))
    shape = (LAYERS, BLOCKS, BLOCK, HEADS, DIM)
    k_pool, v_pool = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((len(slots), HEADS, DIM)).astype(np.float32) for _ in range(2))
    write = jax.jit(write_kv)
    pool = write(KVPool(jnp.asarray(k_pool), jnp.asarray(v_pool)), jnp.int32(1),
                 jnp.asarray(slots, jnp.int32), jnp.asarray(k), jnp.asarray(v))
    np.testing.assert_array_equal(np.asarray(pool.k), expected(k_pool, 1, slots, k))
    np.testing.assert_array_equal(np.asarray(pool.v), expected(v_pool, 1, slots, v))
