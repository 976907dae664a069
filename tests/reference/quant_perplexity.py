"""Prints the perplexity table of benchmarks/RESULTS.md's issue 16 sections: SmolLM2-135M
(embedded GGUF, float32) over the whole committed text, as float32, int8, FP8 and 4-bit
AWQ/GPTQ checkpoints written by ``make_awq_smollm2.py`` (round-to-nearest, no calibration),
through the same paged forward as ``tests/test_quantization.py``::

    .venv/bin/python tests/reference/quant_perplexity.py [--out-dir DIR]   # ~3 min, 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import conftest  # noqa: E402,F401  (the tests' settings: highest matmul precision, set before jax)
from make_awq_smollm2 import write_smollm2  # noqa: E402
from test_quantization import TEXT, _perplexity  # noqa: E402

import jaxllm  # noqa: E402

# (label, method, group, symmetric)
INT4 = (("AWQ int4, group 64", "awq", 64, False), ("AWQ int4, group 32", "awq", 32, False),
        ("GPTQ int4 sym, group 64 (RTN)", "gptq", 64, True))


def write(out_dir: str, method: str, group: int, symmetric: bool) -> str:
    path = os.path.join(out_dir, f"{method}_g{group}{'_sym' if symmetric else ''}")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        write_smollm2(path, method, group, symmetric)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=None, help="where the checkpoints go (kept)")
    args = parser.parse_args()
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="jaxllm-int4-")
    base = jaxllm.load_model(None, dtype="float32")
    with open(TEXT) as f:
        ids = base.tokenizer(f.read())["input_ids"]
    models = [("float32 (dequantized Q4_1)", lambda: base),
              ("int8 per output channel", lambda: base.with_quantization("int8")),
              ("FP8 W8A8 (dynamic)", lambda: base.with_quantization("fp8"))]
    models += [(label, lambda m=m, g=g, s=s: jaxllm.load_model(write(out_dir, m, g, s),
                                                               dtype="float32"))
               for label, m, g, s in INT4]
    print(f"{len(ids)} tokens; checkpoints in {out_dir}")
    print("| weights | perplexity | ratio |\n|---|---:|---:|")
    reference = None
    for label, make in models:
        start = time.time()
        ppl = _perplexity(make(), ids)
        reference = reference or ppl
        print(f"| {label} | {ppl:.4f} | {ppl / reference:.4f} |  ({time.time() - start:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
