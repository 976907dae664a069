"""pallas_kernels/grid_barrier.py and its benchmark's phase chains: the chains' sums against
XLA's in the interpreter; the barrier refused there (programs run one after another); its
sm_90 code as XLA compiles it (the CUDA plugin); the barrier's chains on a GPU."""

import importlib.util
import os
import subprocess

import jax
import jax.numpy as jnp
import pytest
from deviceless import needs_cuda_plugin
from jaxllm.benchmarks import grid_barrier as bench

STEPS = (2, 1, 3)


def _data(programs: int, steps=STEPS):
    return jax.random.randint(jax.random.key(0), (len(steps), programs, max(steps), *bench.TILE),
                              -1000, 1000, jnp.int32)


@pytest.mark.parametrize("mode", ["kernels", "unsynced"])
def test_phase_chains_match_xla_in_the_interpreter(mode):
    data = _data(programs=4)
    out, ok = bench.phases_program(mode, STEPS, 4, interpret=True)(data)
    expected = bench.reference(data, STEPS, synced=mode == "kernels")
    assert out.shape == (3, 4, bench.TILE[1])
    assert bool(jnp.all(out == expected)) and bool(jnp.all(ok == 1))
    # the synced chain reads the next program's previous phase: it differs from the floor's
    assert not bool(jnp.all(bench.reference(data, STEPS, synced=True)
                            == bench.reference(data, STEPS, synced=False)))


@pytest.mark.parametrize("mode", ["barrier", "prefetch"])
def test_the_barrier_is_refused_in_the_interpreter(mode):
    with pytest.raises(ValueError, match="resident at once"):
        bench.phases_program(mode, STEPS, 4, interpret=True)


def test_phase_steps_split_each_phase_over_the_programs_tiles():
    tile_mb = bench.TILE[0] * bench.TILE[1] * 4 / 1e6
    assert bench.phase_steps([132 * tile_mb * 4, 0.001], 2, 132) == (4, 1, 4, 1)
    with pytest.raises(ValueError, match="not one of"):
        bench.phases_program("fused", STEPS, 4)


def _sass(mode: str, tmp_path) -> list[str]:
    import triton
    from jaxllm.benchmarks import kernel_sass, xla_cubin

    fn = bench.phases_program(mode, (4, 3), 132)
    compiled = xla_cubin.compile_deviceless(
        fn, [jax.ShapeDtypeStruct((2, 132, 4, *bench.TILE), jnp.int32)])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    for cubin in xla_cubin.executable_cubins(compiled):
        path = tmp_path / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout
        if f"phases_{mode}" in sass:
            return kernel_sass._opcodes(sass)
    raise AssertionError(f"no phases_{mode} kernel in the executable")


@needs_cuda_plugin
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="the cuobjdump that reads the cubin comes with triton")
def test_the_barrier_as_xla_compiles_it_for_sm90(tmp_path):
    """One thread arrives (a GPU-scope fence, then the atomic add), every thread polls with
    strong loads, one re-acquires (the atomic add of 0, the L1 invalidated); with prefetch the
    next phase's tile (8 16-byte loads a thread) is asked for before the arrival."""
    ops = _sass("barrier", tmp_path)
    arrive = ops.index("ATOMG.E.ADD.STRONG.GPU")
    assert ops[arrive - 3:arrive].count("MEMBAR.ALL.GPU") == 1 and ops[arrive + 1] == "CCTL.IVALL"
    assert ops.count("ATOMG.E.ADD.STRONG.GPU") == 2 and ops.count("LDG.E.STRONG.SYS") == 1
    prefetched = _sass("prefetch", tmp_path)
    arrive = prefetched.index("ATOMG.E.ADD.STRONG.GPU")
    assert prefetched[arrive - 30:arrive].count("LDG.E.128") == 8


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the barrier needs a GPU")
@pytest.mark.parametrize("mode", bench.MODES)
def test_the_chains_match_xla_on_the_gpu(mode):
    programs = jax.devices()[0].core_count
    steps = (3, 1, 5, 2)
    data = _data(programs, steps)
    out, ok = bench.phases_program(mode, steps, programs)(data)
    expected = bench.reference(data, steps, synced=mode != "unsynced")
    assert bool(jnp.all(ok == 1)), "a program gave up waiting at a barrier"
    assert bool(jnp.all(out == expected))
