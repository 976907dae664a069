"""``python -m jaxllm.benchmarks {throughput,serve,latency} ...`` (also ``jaxllm bench ...``)."""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "throughput": ("jaxllm.benchmarks.throughput", "offline throughput: jaxllm vs the baselines"),
    "serve": ("jaxllm.benchmarks.serve_client", "load-test an OpenAI-compatible server"),
    "latency": ("jaxllm.benchmarks.latency", "decode step time vs the memory roofline"),
    "soak": ("jaxllm.benchmarks.soak", "a long run of jaxllm serve under steady mixed load: "
                                       "memory growth, lost requests, KV left after drain"),
}


def build_parser(prog: str = "python -m jaxllm.benchmarks") -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_args(p)
        p.set_defaults(handler=mod.run)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m jaxllm.benchmarks") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(prog).parse_args(argv)
    args.argv = argv[1:]  # the subcommand's own flags (throughput re-runs them per backend)
    try:
        args.handler(args)
    except ValueError as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
