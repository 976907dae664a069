"""What one full garbage collection costs the engine's thread with N running sequences, with
and without ``gc.freeze()`` after start-up (the objects that exist once the engine is built:
JAX's, the weights' pytree, the KV pool's block objects).

Python's oldest-generation collection walks every tracked object; with ~1,000 running
sequences it comes every few dozen steps (``host_step`` shows its share per step) and stalls
that step. Uses ``host_step``'s tiny model and its batch of prompts.

    PYTHONPATH=. python -m jaxllm.benchmarks.gc_pause --num-seqs 1024 --output-json out.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import time


def full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=1024)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help="decode steps before measuring")
    parser.add_argument("--prefix-caching", choices=["off", "on"], default="on")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    from jaxllm.benchmarks import host_step
    from jaxllm.benchmarks.provenance import source_commit, write_json

    engine = host_step.make_engine(args.num_seqs, args.context, args.steps,
                                   args.prefix_caching == "on", async_scheduling=True)
    engine.stream_outputs = False
    record = {"start_up": {"tracked": len(gc.get_objects()),
                           "full_collection_ms": round(full_collection_ms(), 2)}}
    gc.freeze()  # what exists after start-up: the engine's own objects included
    record["frozen"] = gc.get_freeze_count()
    host_step.fill_batch(engine, args.num_seqs, args.context)
    for _ in range(args.steps):
        engine.step()
    record["running_start_up_frozen"] = {"tracked": len(gc.get_objects()),
                                         "full_collection_ms": round(full_collection_ms(), 2)}
    gc.unfreeze()
    record["running_nothing_frozen"] = {"tracked": len(gc.get_objects()),
                                        "full_collection_ms": round(full_collection_ms(), 2)}
    for key in ("start_up", "running_start_up_frozen", "running_nothing_frozen"):
        print(f"{key:24s} tracked objects {record[key]['tracked']:8d}   full collection "
              f"{record[key]['full_collection_ms']:8.1f} ms")
    record.update(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  commit=source_commit(), args=vars(args))
    write_json(record, args.output_json)


if __name__ == "__main__":
    main()
