"""``python -m jaxllm.benchmarks.write_checkpoint MODEL OUT``: a Hugging Face checkpoint
(``config.json``, sharded bfloat16 ``*.safetensors`` and their index) of a preset's shape with
random weights, written locally.

Why: issue 16's warm-restart figures compare starting from dummy weights, from an orbax
checkpoint and from HF safetensors, and no Hub download is possible on the GPU machine. The
values are finite random bf16 (normal, std ``--std``) drawn once into a pool and sliced at
varying offsets into every tensor: loading cost depends on bytes and layout, not on the
values, and drawing 16 GB of fresh normals would take minutes of host time.

    python -m jaxllm.benchmarks.write_checkpoint llama-3-8b /tmp/llama-3-8b-hf --shard-gib 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import ml_dtypes
import numpy as np

POOL_ELEMENTS = 1 << 24  # 32 MiB of bf16 values to slice tensors from


def hf_config(cfg) -> dict:
    """``config.json`` fields that :meth:`ModelConfig.from_hf_config` reads back to ``cfg``."""
    rope = cfg.rope_scaling
    out = {"architectures": [cfg.architecture], "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
           "num_hidden_layers": cfg.num_hidden_layers,
           "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
           "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
           "max_position_embeddings": cfg.max_position_embeddings,
           "tie_word_embeddings": cfg.tie_word_embeddings,
           "attention_bias": cfg.attention_bias, "bos_token_id": cfg.bos_token_id,
           "eos_token_id": list(cfg.eos_token_ids), "torch_dtype": "bfloat16"}
    if rope.rope_type != "default":
        out["rope_scaling"] = {"rope_type": rope.rope_type, **{
            k: v for k, v in dataclasses.asdict(rope).items() if k != "rope_type"}}
    if cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
    return out


def _tensor(pool: np.ndarray, shape: tuple[int, ...], offset: int) -> np.ndarray:
    size = int(np.prod(shape))
    reps = -(-(offset % pool.size + size) // pool.size)
    flat = np.tile(pool, reps) if reps > 1 else pool
    start = offset % pool.size
    return np.ascontiguousarray(flat[start:start + size]).reshape(shape)


def _shards(shapes: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    """Tensor names per file, in order, each file at most ``shard_bytes`` (or one tensor)."""
    shards, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(cfg, out_dir: str, *, shard_bytes: int, seed: int = 0,
                     std: float = 0.02) -> dict:
    """Writes the checkpoint, one file's tensors in host memory at a time; returns its tensor
    count, bytes and files."""
    from safetensors.numpy import save_file

    from jaxllm.loading.assemble import expected_hf_shapes

    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL_ELEMENTS, np.float32) * std).astype(ml_dtypes.bfloat16)
    shapes = expected_hf_shapes(cfg)
    order = {name: i for i, name in enumerate(shapes)}
    shards = _shards(shapes, shard_bytes)
    files, weight_map, total = [], {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # Norm weights at 1, as a trained model's are near: the forward stays finite.
        tensors = {name: np.ones(shapes[name], ml_dtypes.bfloat16)
                   if name.endswith("norm.weight")
                   else _tensor(pool, shapes[name], 7919 * order[name]) for name in names}
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        files.append(file)
        weight_map |= dict.fromkeys(names, file)
        total += sum(t.nbytes for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(cfg), f, indent=1)
    return {"tensors": len(shapes), "bytes": total, "files": files}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a preset name (jaxllm.presets) or a config.json")
    parser.add_argument("out_dir")
    parser.add_argument("--shard-gib", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02)
    args = parser.parse_args(argv)
    from jaxllm.model_config import ModelConfig
    from jaxllm.presets import PRESETS

    if args.model in PRESETS:
        cfg = PRESETS[args.model]
    elif os.path.isfile(args.model):
        with open(args.model) as f:
            cfg = ModelConfig.from_hf_config(json.load(f))
    else:
        parser.error(f"{args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    if args.shard_gib <= 0:
        parser.error(f"--shard-gib {args.shard_gib} must be > 0")
    start = time.perf_counter()
    written = write_checkpoint(cfg, args.out_dir, shard_bytes=int(args.shard_gib * 2**30),
                               seed=args.seed, std=args.std)
    print(f"wrote {written['tensors']} tensors, {written['bytes'] / 2**30:.2f} GiB in "
          f"{len(written['files'])} files to {args.out_dir} in "
          f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
