"""The cubins inside a GPU executable XLA compiled on a machine without a GPU.

The engine's Pallas kernels reach the GPU through XLA's own Triton pipeline, not through
``triton.compile``: XLA compiles the Triton IR with the Triton inside jaxlib, under its own
options (no floating-point contraction: a multiply and an add stay two instructions, where
``triton.compile`` fuses them into an FMA), then ptxas. So the code a GPU runs is read here from
the executable itself: ``jax.experimental.serialize_executable`` of a deviceless compile
(``step_kernels.deviceless_gpu``) holds XLA's ExecutableAndOptionsProto as a raw snappy stream,
whose GpuExecutableProto is a snappy stream again, whose binary holds one ELF cubin a kernel.

Only executables stored as one stream are read (a kernel with its few XLA ops around it);
large ones (a whole engine step) are stored in chunks, and :func:`executable_cubins` says so.
"""

from __future__ import annotations

import io
import pickletools
import struct

OUTER = b"\n\x1dxla.ExecutableAndOptionsProto"  # each stream's first literal starts so
INNER = b"\n\x1axla.gpu.GpuExecutableProto"
ELF = b"\x7fELF"


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def snappy_stream(data: bytes, start: int) -> bytes:
    """The raw snappy stream at ``start`` (its uncompressed length as a varint, then literal
    and copy elements) decompressed, reading only as far as that length; IndexError or
    ValueError when ``start`` is not one."""
    size, i = _varint(data, start)
    out = bytearray()
    while len(out) < size:
        tag = data[i]
        i += 1
        kind, upper = tag & 3, tag >> 2
        if kind == 0:  # a literal: its length - 1 in the tag, or in 1-4 bytes after it
            if upper >= 60:
                extra = upper - 59
                upper = int.from_bytes(data[i:i + extra], "little")
                i += extra
            out += data[i:i + upper + 1]
            i += upper + 1
            continue
        if kind == 1:  # copies: a length and an offset back into the output
            length, offset = (upper & 7) + 4, ((upper >> 3) << 8) | data[i]
            i += 1
        else:
            width = 2 if kind == 2 else 4
            length, offset = upper + 1, int.from_bytes(data[i:i + width], "little")
            i += width
        if not 0 < offset <= len(out):
            raise ValueError(f"snappy copy offset {offset} outside {len(out)} bytes")
        for _ in range(length):  # byte by byte: a copy may overlap what it writes
            out.append(out[-offset])
    return bytes(out)


def _stream_starting_with(data: bytes, literal: bytes) -> bytes | None:
    """The snappy stream whose first literal is ``literal`` (found as plain bytes: a stream's
    first element is a literal), tried from each possible start of its length and tag; the
    longest that decodes."""
    at = data.find(literal)
    best = None
    for start in range(max(0, at - 8), at) if at >= 0 else ():
        try:
            out = snappy_stream(data, start)
        except (IndexError, ValueError):
            continue
        if out.startswith(literal) and (best is None or len(out) > len(best)):
            best = out
    return best


def _elf_images(data: bytes) -> list[bytes]:
    """Every ELF image in ``data``, each cut at the end of its furthest header or section."""
    images, i = [], 0
    while (start := data.find(ELF, i)) >= 0:
        phoff, shoff = struct.unpack_from("<QQ", data, start + 0x20)
        phsize, phnum, shsize, shnum = struct.unpack_from("<HHHH", data, start + 0x36)
        end = max(phoff + phsize * phnum, shoff + shsize * shnum)
        for k in range(shnum):  # sh_offset, sh_size of each section
            offset, size = struct.unpack_from("<QQ", data, start + shoff + k * shsize + 0x18)
            end = max(end, offset + size)
        images.append(data[start:start + end])
        i = start + len(ELF)
    return images


def executable_cubins(compiled) -> list[bytes]:
    """The cubins of a compiled GPU executable (``jax.stages.Compiled``)."""
    from jax.experimental import serialize_executable

    blob = bytes(serialize_executable.serialize(compiled)[0])
    payload = max((bytes(arg) for _, arg, _ in pickletools.genops(io.BytesIO(blob))
                   if isinstance(arg, (bytes, bytearray))), key=len)
    outer = _stream_starting_with(payload, OUTER)
    inner = outer and _stream_starting_with(outer, INNER)
    if not inner:
        raise ValueError("the executable is not stored as one snappy stream (a large program "
                         "is stored in chunks): compile the kernel alone")
    return _elf_images(inner)


def compile_deviceless(fn, args):
    """``jax.jit(fn)`` over ``args`` (ShapeDtypeStructs) compiled for an H200, no GPU needed
    (a Python with jax's CUDA plugin; JAX_PLATFORMS=cpu is fine)."""
    import jax
    from jax.sharding import SingleDeviceSharding
    from jaxllm.benchmarks.step_kernels import deviceless_gpu, tracing_for_gpu

    placed = SingleDeviceSharding(deviceless_gpu())
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed) for a in args]
    with tracing_for_gpu():
        lowered = jax.jit(fn).lower(*args)
    return lowered.compile()
