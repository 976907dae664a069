"""``python -m jaxllm.benchmarks.command_buffer_log LOG``: what XLA's command buffers (CUDA
graphs) did in a run logged with ``TF_CPP_MIN_LOG_LEVEL=0
TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,command_buffer_cmd=1``: how often a
graph was executed, how often it was re-recorded first because a buffer it uses moved, how
many of its buffer allocations moved, how many of its commands were re-recorded and how many
skipped (XLA re-records only the commands that use a moved allocation), and the host time the
re-recording took.

Why: an engine step's launch holds the host 2-4 ms at batch 1 (RESULTS.md), and XLA
re-records a graph whenever one of its allocations changed address since its last run
(``CommandBufferThunk::ExecuteOnStream``). Which allocations move each step (the step's new
batch and sampled tokens only, or the temporaries and so every command) decides whether
keeping the step's inputs at fixed addresses would take the re-recording off the launch.

Counted lines (XLA's own messages): "Execute command buffer", "... Update command buffer ...
updated_allocs=N" (an update, or a graph's first record where the message says
is_first_record=1), "Updated command buffer in T μs; num_commands=C", "Updated C commands in
T μs (skipped S command updates)" (the command executor's count, in whichever of its source
files this jaxlib has), "Evicted N command buffer thunk command buffers" (a newly loaded
executable drops every graph). The commands a step's moved allocations touch say which
allocations cost the launch: the temporaries are one allocation that every command uses. A
line starting "### " (``launch_anatomy`` writes one before each timed case) starts a
section: each is summed apart."""

from __future__ import annotations

import argparse
import collections
import re

from jaxllm.benchmarks.provenance import write_json

_UPDATE = re.compile(r"Update command buffer.*?updated_allocs=(\d+)(?:.*?is_first_record=(\d))?")
_UPDATED = re.compile(r"Updated command buffer in (\d+) \S+; num_commands=(\d+)")
_EVICTED = re.compile(r"Evicted (\d+) command buffer")
_SKIPPED = re.compile(r"Updated (\d+) commands in \d+ \S+ \(skipped (\d+) command updates\)")


def summarize_sections(lines) -> dict[str, dict]:
    """Section name ("" before the first "### " line) -> ``summarize`` of its lines."""
    sections: dict[str, list[str]] = {"": []}
    current = sections[""]
    for line in lines:
        if line.startswith("### "):
            current = sections.setdefault(line[4:].strip(), [])
        else:
            current.append(line)
    return {name: summarize(part) for name, part in sections.items() if part or name}


def summarize(lines) -> dict:
    """Counts over a log's lines (see the module docstring); ``by_size``: per graph size
    (num_commands), its updates and their host time."""
    executes = evicted = commands_recorded = commands_skipped = 0
    moved = collections.Counter()  # updated_allocs of each update -> how many updates
    by_size: dict[int, dict] = {}
    for line in lines:
        if "Execute command buffer" in line:
            executes += 1
        elif (m := _UPDATE.search(line)) and m.group(2) != "1":
            moved[int(m.group(1))] += 1
        elif m := _UPDATED.search(line):
            size = by_size.setdefault(int(m.group(2)), {"updates": 0, "update_us": 0})
            size["updates"] += 1
            size["update_us"] += int(m.group(1))
        elif m := _EVICTED.search(line):
            evicted += int(m.group(1))
        elif m := _SKIPPED.search(line):
            commands_recorded += int(m.group(1)) - int(m.group(2))
            commands_skipped += int(m.group(2))
    updates = sum(moved.values())
    update_us = sum(s["update_us"] for s in by_size.values())
    return {"executes": executes, "updates": updates, "update_us": update_us,
            "updates_per_execute": updates / executes if executes else None,
            "update_us_per_execute": update_us / executes if executes else None,
            "updated_allocs": dict(sorted(moved.items())), "evicted": evicted,
            "commands_recorded": commands_recorded, "commands_skipped": commands_skipped,
            "by_size": dict(sorted(by_size.items()))}


def print_summary(s: dict) -> None:
    print(f"graph executions {s['executes']}, updates before one {s['updates']} "
          f"({s['updates_per_execute'] or 0:.2f} an execution), re-recording "
          f"{s['update_us'] / 1e3:.1f} ms in all ({s['update_us_per_execute'] or 0:.0f} us an "
          f"execution), graphs evicted {s['evicted']}")
    print(f"commands re-recorded {s['commands_recorded']}, skipped {s['commands_skipped']} "
          "(the command executor's count, where its log was on)")
    print("allocations moved per update: " + ", ".join(
        f"{n}: {count}x" for n, count in s["updated_allocs"].items()))
    print(f"{'commands in graph':>18} {'updates':>8} {'us each':>8}")
    for size, u in s["by_size"].items():
        print(f"{size:>18} {u['updates']:>8} {u['update_us'] / u['updates']:>8.0f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    with open(args.log, errors="replace") as f:
        sections = summarize_sections(f)
    for name, summary in sections.items():
        print(f"--- {name or '(before the first section)'}")
        print_summary(summary)
    write_json({"benchmark": "command_buffer_log", "log": args.log, "sections": sections},
               args.output_json)


if __name__ == "__main__":
    main()
