"""Ops in optimized HLO dumps whose result is >= MIN_MB, grouped by computation and op kind.

Usage: python hlo_big.py MIN_MB FILE...  (fused and wrapped computations are left out)
"""
import collections
import re
import sys

MIN = float(sys.argv[1]) * 2**20
SIZE = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(")
SKIPPED_COMPUTATIONS = ("%fused", "%wrapped", "%region")
SKIPPED_OPS = ("parameter", "bitcast", "get-tuple-element", "tuple")
for path in sys.argv[2:]:
    comp, seen = None, collections.Counter()
    for line in open(path):
        if not line.startswith(" ") and "{" in line and ("%" in line or "ENTRY" in line):
            comp = line.split("(")[0].strip()[:60]
        m = INSTRUCTION.match(line)
        if not m or m.group(3) not in SIZE:
            continue
        n = 1
        for d in filter(None, m.group(4).split(",")):
            n *= int(d)
        big = n * SIZE[m.group(3)] >= MIN
        if big and not comp.startswith(SKIPPED_COMPUTATIONS) and m.group(5) not in SKIPPED_OPS:
            seen[(comp, m.group(5), f"{m.group(3)}[{m.group(4)}]")] += 1
    print("==", path.rsplit("/", 1)[-1][:90])
    for (c, op, shape), k in sorted(seen.items()):
        print(f"  {k:4d} x {op:24s} {shape:28s} in {c}")
