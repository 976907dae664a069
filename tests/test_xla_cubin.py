"""benchmarks/xla_cubin.py: the cubins read out of a serialized GPU executable (snappy streams,
ELF images), checked on hand-made bytes; the real executable needs jax's CUDA plugin."""

import importlib.util
import pickle
import struct
import sys

import pytest
from deviceless import needs_cuda_plugin
from jaxllm.benchmarks import xla_cubin


def _literal(data: bytes) -> bytes:
    assert 0 < len(data) <= 60
    return bytes([(len(data) - 1) << 2]) + data


def _copy1(length: int, offset: int) -> bytes:  # a 1-byte-offset copy: 4..11 bytes, < 2048 back
    return bytes([1 | ((length - 4) << 2) | ((offset >> 8) << 5), offset & 0xFF])


def _copy2(length: int, offset: int) -> bytes:
    return bytes([2 | ((length - 1) << 2)]) + offset.to_bytes(2, "little")


def test_snappy_stream_literals_and_overlapping_copies():
    # "abcd" + a copy of 8 from 4 back (overlapping itself) + "xy" + 3 from 10 back
    body = _literal(b"abcd") + _copy1(8, 4) + _literal(b"xy") + _copy2(3, 10)
    expected = b"abcdabcdabcdxy" + b"abc"
    stream = bytes([len(expected)]) + body
    assert xla_cubin.snappy_stream(b"junk" + stream + b"tail", 4) == expected
    # a long literal: its length - 1 in the byte after tag 60
    long = bytes(range(100))
    assert xla_cubin.snappy_stream(bytes([100, 60 << 2, 99]) + long, 0) == long
    with pytest.raises(ValueError, match="offset"):  # a copy reaching before the output
        xla_cubin.snappy_stream(bytes([8]) + _literal(b"ab") + _copy1(6, 3), 0)


def _elf(payload: bytes) -> bytes:
    """A 64-bit ELF header with one section of ``payload`` right after the section table."""
    header = bytearray(64)
    header[:4] = xla_cubin.ELF
    shoff, shsize = 64, 64
    struct.pack_into("<QQ", header, 0x20, 0, shoff)
    struct.pack_into("<HHHH", header, 0x36, 56, 0, shsize, 1)
    section = bytearray(shsize)
    struct.pack_into("<QQ", section, 0x18, shoff + shsize, len(payload))
    return bytes(header + section) + payload


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(0x80 | (n & 0x7F))
        n >>= 7
    return bytes(out + bytes([n]))


def _stream(data: bytes) -> bytes:  # snappy, all literals
    return _varint(len(data)) + b"".join(_literal(data[i:i + 60])
                                         for i in range(0, len(data), 60))


def test_executable_cubins_nested_streams_and_elf_ends(monkeypatch):
    first, second = _elf(b"kernel-one"), _elf(b"the second kernel")
    inner = _stream(xla_cubin.INNER + b"\x00" * 3 + first + b"pad" + second + b"tail")
    outer = _stream(xla_cubin.OUTER + b"\x12" + inner)  # the inner stream as bytes in it
    payload = b"ifrt metadata" + outer + b"after"

    # serialize_executable.serialize's first item: a pickle holding the payload
    monkeypatch.setattr("jax.experimental.serialize_executable.serialize",
                        lambda compiled: (pickle.dumps((b"small", payload)), None, None))
    assert xla_cubin.executable_cubins(object()) == [first, second]

    monkeypatch.setattr("jax.experimental.serialize_executable.serialize",
                        lambda compiled: (pickle.dumps(b"x" * 2000), None, None))
    with pytest.raises(ValueError, match="one snappy stream"):
        xla_cubin.executable_cubins(object())


@needs_cuda_plugin
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="the cuobjdump that reads the cubin comes with triton")
def test_the_gemv_as_xla_compiles_it_takes_one_fma_a_weight():
    """kernel_sass --compiler xla: the engine's qkv GEMV at one token read from XLA's own
    executable: one FFMA a weight (fma.rn.f32 in inline PTX: XLA contracts no multiply-add)."""
    import jax
    from jaxllm.benchmarks import kernel_sass

    # as the engine compiles (conftest turns XLA's optimizations off for tiny models; the
    # GEMV then computes each x load's address in the loop: ~3.9 instructions a weight)
    jax.config.update("jax_disable_most_optimizations", False)
    result = kernel_sass.main(["--kernel", "gemv", "--n", "6144", "--compiler", "xla",
                               "--triton-python", sys.executable])
    weights = result["weights_per_thread"]
    opcodes = result["main_loop"]["opcodes"]
    assert opcodes["FFMA"] >= 0.95 * weights and opcodes.get("FADD", 0) < 0.05 * weights
    assert result["instructions_per_weight"] < 2.7, opcodes


@needs_cuda_plugin
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="the cuobjdump that reads the cubin comes with triton")
def test_xla_starts_each_kernel_waiting_and_the_gemv_can_signal_its_dependents(tmp_path):
    """Programmatic dependent launch as XLA compiles the engine's kernels: each starts with
    griddepcontrol.wait (ACQBULK; XLA's default), and only a GEMV configured to
    (trigger_dependents) signals the next kernel's launch (PREEXIT), once, at its start."""
    from jaxllm.benchmarks import kernel_sass

    def sass(config: str) -> list[str]:
        out = tmp_path / "gemv.sass"
        kernel_sass.main(["--kernel", "gemv", "--n", "4096", "--compiler", "xla",
                          "--triton-python", sys.executable, "--gemv-config", config,
                          "--sass-out", str(out)])
        return kernel_sass._opcodes(out.read_text())

    plain = sass("block_n=256,num_warps=2")
    signalling = sass("block_n=256,num_warps=2,trigger_dependents=True")
    assert plain[:8].count("ACQBULK") == 1 and "PREEXIT" not in plain
    assert signalling.count("PREEXIT") == 1 and signalling.index("PREEXIT") < 16
