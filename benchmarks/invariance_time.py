"""The invariance matrix's cost, measured on this machine: one world start, then every axis.

Prints the world's start-up, the time per axis (a run shared by two axes, such as the base
layout itself, is charged to the first), the number of variant runs and the total wall time,
against the goal of 3 minutes for smoke's samples against builtin on 2 cores; then the matrix.

    python benchmarks/invariance_time.py [--suite smoke] [--target builtin] [--axis LIST]
"""

from __future__ import annotations

import argparse
import time

from shardcheck.harness.controller.commands.invariance import AXES, check_invariance
from shardcheck.harness.controller.reports.invariance_report import render
from shardcheck.scenarios import get_suite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="smoke")
    ap.add_argument("--target", default="builtin")
    ap.add_argument("--axis", default=",".join(AXES))
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = check_invariance(get_suite(args.suite), args.target, axes=args.axis.split(","))
    wall = time.perf_counter() - t0
    startup = sum(result.info.startup_seconds)
    print(f"{args.suite} suite's samples, target {args.target}: {len(result.runs)} variant runs, "
          f"world start-up {startup:.1f}s ({len(result.info.startup_seconds)} start)")
    for axis, seconds in result.axis_seconds.items():
        print(f"  {axis:<8} {seconds:6.1f}s")
    print(f"  total wall {wall:.1f}s (goal: under 180s)")
    print()
    print(render(result))


if __name__ == "__main__":
    main()
