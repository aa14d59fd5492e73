#!/usr/bin/env python3
"""Where a GPU run's kernel time goes: reads the ncu.csv that scripts/gpu-run.sh writes (Nsight
Compute's raw page, one row per kernel launch with gpu__time_duration.sum) and prints, per
kernel name, how many launches, their total and mean time and the share of the total, largest
first; with --last N, the same for the last N launches alone (a decode step's worth: the
default model's eager batch-1 step is about 340 launches).

    scripts/ncu-summary.py ncu.csv [--last 340] [--top 25]
"""

import argparse
import csv
import re
import sys
from collections import defaultdict


def rows(path):
    """(kernel name, grid, block, nanoseconds) per launch, in launch order."""
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    reader = csv.reader(lines)
    header = next(reader)
    units = next(reader)
    col = {name: i for i, name in enumerate(header)}
    t = col["gpu__time_duration.sum"]
    scale = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}
    factor = scale.get(units[t].strip(), 1.0)
    out = []
    for r in reader:
        if len(r) <= t or not r[t]:
            continue
        value = float(r[t].replace(",", ""))
        out.append((r[col["Kernel Name"]], r[col.get("Grid Size", 0)], r[col.get("Block Size", 0)],
                    value * factor))
    return out


def short(name):
    """The kernel's name without template arguments and parameter lists."""
    name = re.sub(r"\(.*", "", name)
    return name if len(name) <= 70 else name[:67] + "..."


def table(launches, top, title):
    total = sum(ns for *_, ns in launches)
    by = defaultdict(lambda: [0, 0.0])
    for name, _, _, ns in launches:
        by[short(name)][0] += 1
        by[short(name)][1] += ns
    print(f"== {title}: {len(launches)} launches, {total / 1e3:.1f} us of kernel time")
    print(f"{'kernel':<70} {'n':>5} {'total us':>10} {'mean us':>8} {'share':>6}")
    for name, (n, ns) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{name:<70} {n:>5} {ns / 1e3:>10.1f} {ns / n / 1e3:>8.2f} {100 * ns / total:>5.1f}%")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--last", type=int, default=0, help="also summarise the last N launches")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    launches = rows(a.csv)
    if not launches:
        sys.exit(f"{a.csv}: no kernel rows")
    table(launches, a.top, "every profiled launch")
    if a.last:
        table(launches[-a.last:], a.top, f"the last {a.last} launches")


if __name__ == "__main__":
    main()
