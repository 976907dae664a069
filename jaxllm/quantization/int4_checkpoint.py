"""Reading 4-bit AWQ and GPTQ checkpoints (host side, numpy): the tensors each quantized linear
has, the checks a model and a tensor-parallel size must pass before any weight is read, and
the unpacking of any block of a linear into the one device layout,
:class:`jaxllm.layers.linear.Int4Weight`.

Per linear ``<prefix>`` with K inputs, N outputs, group size g (g = -1: g = K), G = K / g;
both formats are [in, out] (y = x @ W), unlike a float HF weight [out, in]::

    AWQ (AutoAWQ GEMM)  qweight i32[K, N/8]  packed along N, nibble 4i holds column
                                             8c + AWQ_ORDER[i] (interleaved)
                        qzeros  i32[G, N/8]  packed as qweight; zero points as they are
                        scales  f16[G, N]
    GPTQ                qweight i32[K/8, N]  packed along K in order: row 8r+j in nibble j
                        qzeros  i32[G, N/8]  packed along N in order; v1 ("gptq") stores
                                             each zero minus 1, v2 ("gptq_v2") as it is
                        scales  f16[G, N]
                        g_idx   i32[K]       group of each input row (k // g unless act-order)

    W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]

Both become ``Int4Weight`` (packed along K in order, zero points unpacked and effective), so
the matmul has one layout to dequantize. GPTQ's v1 zero is read as stored + 1 without
wrapping (a stored 15, the -1 of a true 0, is 16), as vLLM's and AutoGPTQ's kernels read it;
``sym`` GPTQ uses the implied zero 8, as vLLM's gptq_marlin does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.layers.linear import PER_WORD
from jaxllm.model_config import ModelConfig
from jaxllm.quantization.config import QuantizationConfig

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8c + AWQ_ORDER[i]
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(j) for j in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)
SYMMETRIC_ZERO = 8  # 2^(bits - 1) for 4 bits

GetTensor = Callable[[str], np.ndarray]


def nibbles(words: np.ndarray, which: np.ndarray) -> np.ndarray:
    """The 4-bit values at nibble ``which`` (broadcast against ``words``) of int32 words, as
    uint8."""
    return ((words.astype(np.int64) >> (4 * which.astype(np.int64))) & 0xF).astype(np.uint8)


def pack_rows(q: np.ndarray) -> np.ndarray:
    """u8[K, N] values in 0..15 -> i32[K/8, N], row 8r+j in nibble j of word row r (the device
    layout, and GPTQ's qweight)."""
    k, n = q.shape
    grouped = q.reshape(k // PER_WORD, PER_WORD, n).astype(np.uint32)
    shifts = (4 * np.arange(PER_WORD, dtype=np.uint32))[None, :, None]
    return np.bitwise_or.reduce(grouped << shifts, axis=1).view(np.int32)


def linear_in_out(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF module name within a layer -> (K, N) of that linear."""
    h, f, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    return {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv),
            "self_attn.v_proj": (h, kv), "self_attn.o_proj": (q, h),
            "mlp.gate_proj": (h, f), "mlp.up_proj": (h, f), "mlp.down_proj": (f, h)}


ROW_SPLIT = ("self_attn.o_proj", "mlp.down_proj")  # input axis split by tensor parallelism


def group_size(quant: QuantizationConfig, k: int) -> int:
    return k if quant.group_size == -1 else quant.group_size


def tensor_shapes(prefix: str, k: int, n: int,
                  quant: QuantizationConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of one quantized linear and their shapes."""
    groups = k // group_size(quant, k)
    qweight = (k, n // PER_WORD) if quant.method == "awq" else (k // PER_WORD, n)
    shapes = {prefix + ".qweight": qweight, prefix + ".qzeros": (groups, n // PER_WORD),
              prefix + ".scales": (groups, n)}
    if quant.method == "gptq":
        shapes[prefix + ".g_idx"] = (k,)
    return shapes


def check_int4_layout(config: ModelConfig, quant: QuantizationConfig,
                      tensor_parallel_size: int = 1) -> None:
    """Raises ValueError naming the linear, the size and the rule when the checkpoint's
    quantization cannot hold ``config``'s linears, or when a tensor-parallel split of a
    linear's input axis (o_proj, down_proj) would cut a group or a packed word in two."""
    name = quant.describe()
    for module in quant.modules_to_not_convert:  # vLLM's rule: a substring of the prefix
        if any(module in prefix for prefix in quantized_prefixes(config)):
            raise ValueError(f"{name}: modules_to_not_convert names {module!r}, a decoder "
                             "projection; a checkpoint mixing float and 4-bit projections "
                             "is not supported")
    size = tensor_parallel_size
    for module, (k, n) in linear_in_out(config).items():
        g = group_size(quant, k)
        if k % g or g % PER_WORD:
            raise ValueError(f"{name}: {module} has {k} inputs, which groups of {g} rows "
                             f"packed {PER_WORD} to a word do not tile")
        if n % PER_WORD:
            raise ValueError(f"{name}: {module} has {n} outputs, not a multiple of "
                             f"{PER_WORD} (zero points pack {PER_WORD} columns to a word)")
        if size > 1 and module in ROW_SPLIT and (k // size) % PER_WORD:
            raise ValueError(
                f"--tensor-parallel-size {size}: {module}'s {k} inputs split into "
                f"{k // size} per device, which cuts its packed words of {PER_WORD} rows "
                f"({name})")
        if size > 1 and module in ROW_SPLIT and k // g > 1 and (k // size) % g:
            raise ValueError(
                f"--tensor-parallel-size {size}: {module}'s {k} inputs split into "
                f"{k // size} per device, which cuts its groups of {g} rows across devices "
                f"({name}); use a size that divides {k // g} groups")


class Int4Linear:
    """One quantized linear of a checkpoint, read in any block: rows (a slice of K or of G)
    by output columns (any index array into N)."""

    def __init__(self, prefix: str, k: int, quant: QuantizationConfig, load: GetTensor):
        self.prefix, self.k, self.quant, self.load = prefix, k, quant, load
        self.group = group_size(quant, k)
        self._checked_groups = False

    def _tensor(self, part: str) -> np.ndarray:
        return self.load(f"{self.prefix}.{part}")

    def values(self, rows: range, cols: np.ndarray) -> np.ndarray:  # u8[len(rows), n]
        if self.quant.method == "awq":
            words = self._tensor("qweight")[rows.start:rows.stop][:, cols // PER_WORD]
            which = np.asarray(AWQ_NIBBLE_OF_COLUMN)[cols % PER_WORD]
            return nibbles(words, which[None, :])
        if rows.start % PER_WORD or rows.stop % PER_WORD:
            raise ValueError(f"{self.prefix}: rows {rows} do not start and end on a word")
        words = self._tensor("qweight")[rows.start // PER_WORD:rows.stop // PER_WORD][:, cols]
        q = nibbles(words[:, None, :], np.arange(PER_WORD)[None, :, None])  # [K'/8, 8, N']
        return q.reshape(len(rows), len(cols))

    def packed(self, word_rows: range, cols: np.ndarray) -> np.ndarray:  # i32[len, len(cols)]
        rows = range(word_rows.start * PER_WORD, word_rows.stop * PER_WORD)
        return pack_rows(self.values(rows, cols))

    def scales(self, groups: range, cols: np.ndarray) -> np.ndarray:  # f16[len(groups), n]
        self._check_groups()
        return self._tensor("scales")[groups.start:groups.stop][:, cols]

    def zeros(self, groups: range, cols: np.ndarray) -> np.ndarray:  # u8[len(groups), n]
        self._check_groups()
        if self.quant.symmetric:
            return np.full((len(groups), len(cols)), SYMMETRIC_ZERO, np.uint8)
        words = self._tensor("qzeros")[groups.start:groups.stop][:, cols // PER_WORD]
        order = AWQ_NIBBLE_OF_COLUMN if self.quant.method == "awq" else range(PER_WORD)
        zeros = nibbles(words, np.asarray(order)[cols % PER_WORD][None, :])
        return zeros + np.uint8(self.quant.zero_offset)

    def _check_groups(self) -> None:
        """GPTQ's g_idx must put row k in group k // g (no act-order permutation)."""
        if self.quant.method != "gptq" or self._checked_groups:
            return
        g_idx = np.asarray(self._tensor("g_idx"))
        if not np.array_equal(g_idx, np.arange(self.k) // self.group):
            raise ModelLoadError(f"{self.prefix}.g_idx is not k // {self.group} (act-order "
                                 "groups); such GPTQ checkpoints are not supported yet")
        self._checked_groups = True



def quantized_prefixes(config: ModelConfig) -> Iterable[str]:
    for i in range(config.num_hidden_layers):
        for module in linear_in_out(config):
            yield f"model.layers.{i}.{module}"
