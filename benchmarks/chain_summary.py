"""``python -m jaxllm.benchmarks.chain_summary DIR``: one table of the result JSONs a GPU chain
(``benchmarks/gpu_chain.sh``) wrote in DIR: throughput runs (with jaxllm's ratio over each
HF baseline of the same workload, and over TP = 1), decode-step latency rows and TP
profiles. A throughput run whose output-token count differs from the requested one is marked
and gives no ratio."""

from __future__ import annotations

import glob
import json
import os
import sys


def _load(directory: str) -> list[tuple[str, dict]]:
    found = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        name = os.path.basename(path)[:-5]
        if "." in name:  # a throughput child's own file (side.<backend>.json): in the summary
            continue
        with open(path) as f:
            found.append((name, json.load(f)))
    return found


def throughput_lines(runs: list[tuple[str, dict]]) -> list[str]:
    lines = [f"{'run':<26} {'backend':<10} {'TP':>2} {'out tok/s':>9} {'timed s':>7} "
             f"{'out tok':>8} {'GiB':>6} {'KV wst':>7}"]
    by_workload: dict = {}
    for name, summary in runs:
        a = summary["args"]
        tp = a.get("tensor_parallel_size", 1)
        workload = (a["model"], a["dataset_name"], a["num_prompts"], a["input_len"],
                    a["output_len"])
        for backend, r in summary["results"].items():
            ok = r["total_output_tokens"] == r["requested_output_tokens"]
            peak, waste = r.get("peak_memory_bytes"), r.get("kv_waste")
            lines.append(
                f"{name:<26} {backend:<10} {tp:>2} {r['output_tokens_per_second']:>9.1f} "
                f"{r['elapsed_time']:>7.1f} {r['total_output_tokens']:>8} "
                f"{'-' if peak is None else f'{peak / 2**30:.1f}':>6} "
                f"{'-' if waste is None else f'{waste:.1%}':>7} {summary['commit']} "
                f"{'' if ok else 'WRONG TOKEN COUNT'}")
            if ok:  # no ratio from a run that did other work than asked
                key = backend if backend != "jaxllm" or tp == 1 else f"jaxllm TP={tp}"
                by_workload.setdefault(workload, {}).setdefault(
                    key, (r["output_tokens_per_second"], name))
    for w, res in by_workload.items():
        label = f"{w[0]} {w[1]} {w[2]} prompts"
        for ours in sorted(k for k in res if k.startswith("jaxllm")):
            for base in ("jaxllm", "hf", "hf-tuned", "hf-cb"):
                if base in res and base != ours:
                    lines.append(f"{label}: {ours} / {base} = {res[ours][0] / res[base][0]:.2f}x"
                                 f" ({res[ours][1]} / {res[base][1]})")
    return lines


def latency_lines(runs: list[tuple[str, dict]]) -> list[str]:
    lines = [f"{'run':<26} {'TP':>2} {'batch':>5} {'step ms':>8} {'launch':>7} "
             f"{'roofline':>8} {'% roof':>7} {'tok/s':>9}"]
    for name, result in runs:
        for r in result["rows"]:
            lines.append(f"{name:<26} {result.get('tensor_parallel_size', 1):>2} "
                         f"{r['batch_size']:>5} {r['step_ms']:>8.3f} {r['launch_ms']:>7.3f} "
                         f"{r['roofline_ms']:>8.3f} {r['pct_of_roofline']:>6.1f}% "
                         f"{r['output_tokens_per_s']:>9.1f}")
    return lines


def profile_lines(runs: list[tuple[str, dict]]) -> list[str]:
    lines = []
    for name, p in runs:
        kernels = p["kernel_ms_per_step"]
        total = sum(kernels.values())
        share = f"{100 * kernels.get('collective', 0) / total:.1f}%" if total else "n/a"
        lines.append(f"{name}: TP={p['tensor_parallel_size']} batch {p['batch_size']}, "
                     f"collectives {p['collectives']}, kernel ms/step {kernels}, "
                     f"collective share {share}")
    return lines


def main(directory: str) -> None:
    runs = _load(directory)
    kinds = {"throughput": [r for r in runs if "results" in r[1]],
             "latency": [r for r in runs if "rows" in r[1]],
             "profile": [r for r in runs if "collectives" in r[1]]}
    for lines in (throughput_lines(kinds["throughput"]) if kinds["throughput"] else [],
                  latency_lines(kinds["latency"]) if kinds["latency"] else [],
                  profile_lines(kinds["profile"])):
        if lines:
            print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
