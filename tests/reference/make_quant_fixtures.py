"""Writes ``tests/fixtures/quant/int4_cases.npz``: synthetic 4-bit AWQ and GPTQ linears packed
by ``make_awq_smollm2.py``'s packers, and each one's weight dequantized by the real libraries'
own functions, for ``tests/test_quant_int4.py`` to compare jaxllm's loader against.

References (reference venv, see README.md; imported with their packages' heavy ``__init__``
bypassed, since only these functions are needed):

- AWQ: AutoAWQ 0.2.9 ``awq/utils/packing_utils.py`` ``dequantize_gemm`` (unpack, reverse the
  interleave, (q - z) * s in fp16); the packing is checked against GPTQModel 7.7.0's
  ``quantization/awq/utils/packing_utils.pack_awq``, an independent packer of the same layout.
- GPTQ: GPTQModel 7.7.0 ``utils/model_dequant.convert_gptq_file`` (reads a GPTQ safetensors
  file, applies the v1 zero offset when ``checkpoint_format`` is ``gptq``, dequantizes with
  ``g_idx``); the packing is checked with its ``unpack_rows`` / ``unpack_cols``.

GPTQModel wraps a v1 zero of 15 + 1 to 0 where vLLM's and AutoGPTQ's kernels read 16; the
cases keep every zero in 1..14 (what RTN gives Gaussian weights), where all agree. Symmetric
GPTQ is written with v1 zeros of 7, which the library reads as 8, the zero vLLM implies.

    .venv-ref/bin/python tests/reference/make_quant_fixtures.py   # from the repo root
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import tempfile
import types

import numpy as np
import torch
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_awq_smollm2 import (  # noqa: E402
    AWQ_ORDER,
    awq_tensors,
    gptq_tensors,
    quantization_config,
    rtn_int4,
)

OUT = os.path.join(HERE, "..", "fixtures", "quant", "int4_cases.npz")
K, N, TOKENS = 128, 64, 4
# name -> (method, group, symmetric, GPTQ v1 zeros)
CASES = {"awq_g32": ("awq", 32, False, True), "awq_g128": ("awq", 128, False, True),
         "gptq_v1_g32": ("gptq", 32, False, True), "gptq_v2_g64": ("gptq", 64, False, False),
         "gptq_sym_g32": ("gptq", 32, True, True), "gptq_v1_channel": ("gptq", -1, False, True)}


def load_file_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gptqmodel_modules():
    """GPTQModel's model_dequant and AWQ packing_utils without its package ``__init__``
    (which imports the whole quantization toolkit)."""
    root = importlib.util.find_spec("gptqmodel").submodule_search_locations[0]
    for name in ("gptqmodel", "gptqmodel.quantization"):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *name.split(".")[1:])]
        sys.modules[name] = package
    logger = types.ModuleType("gptqmodel.utils.logger")
    logger.setup_logger = lambda *a, **k: logging.getLogger("gptqmodel")
    sys.modules["gptqmodel.utils.logger"] = logger
    import gptqmodel.quantization.awq.utils.packing_utils as awq_packing
    import gptqmodel.utils.model_dequant as model_dequant

    return model_dequant, awq_packing


def autoawq_packing():
    root = importlib.util.find_spec("awq").submodule_search_locations[0]
    return load_file_module("autoawq_packing_utils",
                            os.path.join(root, "utils", "packing_utils.py"))


def main() -> None:
    model_dequant, gptq_awq_packing = gptqmodel_modules()
    awq = autoawq_packing()
    assert list(AWQ_ORDER) == awq.AWQ_ORDER
    rng = np.random.default_rng(16)
    out = {"x": rng.normal(size=(TOKENS, K)).astype(np.float32)}
    for name, (method, group, symmetric, v1) in CASES.items():
        g = K if group == -1 else group
        w = (rng.normal(size=(K, N)) * rng.uniform(0.02, 0.2, N)).astype(np.float32)
        q, scales, zeros = rtn_int4(w, g, symmetric)
        assert symmetric or (zeros.min() >= 1 and zeros.max() <= 14), name
        prefix = "model.layers.0.mlp.down_proj"
        if method == "awq":
            tensors = awq_tensors(prefix, q, scales, zeros)
            qweight, qzeros = gptq_awq_packing.pack_awq(torch.from_numpy(q.astype(np.int32)),
                                                        torch.from_numpy(zeros.astype(np.int32)),
                                                        4)
            assert np.array_equal(qweight.numpy(), tensors[prefix + ".qweight"]), name
            assert np.array_equal(qzeros.numpy(), tensors[prefix + ".qzeros"]), name
            ref = awq.dequantize_gemm(torch.from_numpy(tensors[prefix + ".qweight"]),
                                      torch.from_numpy(tensors[prefix + ".qzeros"]),
                                      torch.from_numpy(scales), 4, g)  # fp16 [K, N]
            ref = ref.numpy()
        else:
            tensors = gptq_tensors(prefix, q, scales, zeros, v1=v1)
            unpacked = model_dequant.unpack_rows(torch.from_numpy(tensors[prefix + ".qweight"]), 4)
            assert np.array_equal(unpacked.numpy(), q), name
            config = quantization_config("gptq", group, symmetric)
            config["checkpoint_format"] = "gptq" if v1 else "gptq_v2"
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "model.safetensors")
                save_file(tensors, path)
                dequantized = model_dequant.convert_gptq_file(path, torch.float16, config, "cpu")
            ref = dequantized[prefix + ".weight"].numpy().T  # [N, K] -> [K, N]
        qc = quantization_config(method, group, symmetric)
        if method == "gptq":
            qc["checkpoint_format"] = "gptq" if v1 else "gptq_v2"
        out[f"{name}/config"] = np.frombuffer(json.dumps(qc).encode(), np.uint8)
        for key, value in tensors.items():
            out[f"{name}/{key.rsplit('.', 1)[-1]}"] = value
        out[f"{name}/reference"] = ref.astype(np.float16)
        # How far RTN moved the weights (<= half a step where no value was clipped): a sanity
        # check that the case quantizes something.
        print(f"{name}: max |ref - w| {np.abs(ref.astype(np.float32) - w).max():.4f}, "
              f"max scale {scales.astype(np.float32).max():.4f}")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
