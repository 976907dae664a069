"""Named attention shapes shared by the kernel tests and ``benchmarks/kernels.py``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HeadShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


HEAD_SHAPES = {
    "llama3_8b": HeadShape(32, 8, 128),  # GQA 4:1 (Llama 3 8B, Mistral 7B)
    "llama2_7b": HeadShape(32, 32, 128),  # MHA
    "smollm2_135m": HeadShape(9, 3, 64),  # GQA 3:1, group padded to 4
    "small_gqa": HeadShape(8, 2, 64),
    "small_mha": HeadShape(4, 4, 64),
    "odd_group": HeadShape(6, 1, 64),  # group 6, padded to 8 / 16
}

# The lengths every kernel test runs: around page boundaries and long contexts.
AWKWARD_LENGTHS = (1, 3, 15, 16, 17, 513, 1023)
