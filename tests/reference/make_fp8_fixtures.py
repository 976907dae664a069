"""Writes ``tests/fixtures/quant/fp8_<strategy>/``: two tiny checkpoints in compressed-tensors'
FP8 ``float-quantized`` format (llm-compressor's FP8_DYNAMIC scheme: e4m3 weights, dynamic
per-token e4m3 activations), made from the float checkpoints in ``tests/fixtures/tiny`` by the
real library, for ``tests/test_quant_fp8_checkpoint.py``.

- ``fp8_channel`` from ``llama3_rope_scaling`` (2 KV heads), one weight scale per output row.
- ``fp8_tensor`` from ``qwen2_bias`` (1 KV head, q/k/v biases), one scale per tensor.

Each projection's scale comes from compressed-tensors 0.20.1's ``calculate_qparams`` over the
weight's min/max (what its observers compute for a weight-only calibration), the e4m3 values
from its ``quantize``, and the config from its ``QuantizationConfig`` (the preset scheme
``FP8_DYNAMIC``; only the weight strategy changes for the per-tensor case). Beside each
checkpoint, ``reference.npz`` holds, for the test to compare with:

- ``<prefix>.dequantized``: every projection's weight as compressed-tensors' ``dequantize``
  gives it back (float32, [out, in]);
- ``input_ids`` and ``logits``: the model's logits through transformers' own Llama/Qwen2
  code with those dequantized weights and each projection's input fake-quantized per token
  by compressed-tensors' ``compute_dynamic_scales_and_zp`` and ``fake_quantize`` (what
  vLLM's FP8_DYNAMIC computes).

    .venv-ref/bin/pip install --no-deps compressed-tensors==0.20.1   # beside requirements.txt
    .venv-ref/bin/python tests/reference/make_fp8_fixtures.py        # from the repo root
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "..", "fixtures", "tiny")
OUT = os.path.join(HERE, "..", "fixtures", "quant")
CASES = {"fp8_channel": ("llama3_rope_scaling", "channel"),
         "fp8_tensor": ("qwen2_bias", "tensor")}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out |= load_file(os.path.join(path, name))
    return out


def quantize_weight(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [out, in], scale [out, 1] or [1]) as compressed-tensors computes them."""
    dims = 1 if args.strategy == "channel" else None
    if dims is None:
        lo, hi = weight.amin().reshape(1), weight.amax().reshape(1)
    else:
        lo, hi = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    scale, zero_point = calculate_qparams(lo, hi, args)
    q = quantize(weight, scale, zero_point, args, dtype=torch.float8_e4m3fn)
    return q, scale.to(torch.float32)


def make(name: str, source: str, strategy: str) -> None:
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    scheme.weights.strategy = strategy
    src = os.path.join(TINY, source)
    out_dir = os.path.join(OUT, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    state = tensors(src)
    stored, reference = {}, {}
    for key, value in state.items():
        prefix = key.removesuffix(".weight")
        if prefix.split(".")[-1] in PROJECTIONS and key.endswith(".weight"):
            q, scale = quantize_weight(value.to(torch.float32), scheme.weights)
            stored[key], stored[prefix + ".weight_scale"] = q, scale
            deq = dequantize(q, scale, None, scheme.weights).to(torch.float32)
            reference[prefix + ".dequantized"] = deq.numpy()
            state[key] = deq  # the float model the logits below run
        else:
            stored[key] = value.contiguous()
    save_file(stored, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="float-quantized",
                            ignore=["lm_head"], quantization_status="compressed")
    config["quantization_config"] = qc.model_dump(mode="json") | {
        "quant_method": "compressed-tensors"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    # transformers' forward over the dequantized weights, each projection's input quantized
    # per token to e4m3 and back, as the FP8_DYNAMIC scheme runs.
    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)

    def fake_quantize_input(module, args):
        x, acts = args[0], scheme.input_activations
        scale, zero_point = compute_dynamic_scales_and_zp(x, acts, module)
        return (fake_quantize(x, scale, zero_point, acts),)

    for module_name, module in model.named_modules():
        if module_name.split(".")[-1] in PROJECTIONS:
            module.register_forward_pre_hook(fake_quantize_input)
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, config["vocab_size"], 24))
    with torch.no_grad():
        logits = model(ids[None]).logits[0].numpy()
    np.savez_compressed(os.path.join(out_dir, "reference.npz"), input_ids=ids.numpy(),
                        logits=logits, **reference)
    print(name, "from", source, strategy, {k: tuple(v.shape) for k, v in list(stored.items())[:4]})


if __name__ == "__main__":
    for name, (source, strategy) in CASES.items():
        make(name, source, strategy)
