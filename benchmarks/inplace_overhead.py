"""The in-place check's cost, measured in one run on this machine.

Runs the smoke suite against the builtin target on one world, alternating runs without and with
the ``input_mutated`` check (the copies kept, the comparisons after forward and backward, and the
dispatch mode that finds the first in-place write), and prints the scenario time of each (world
start-up excluded, median of the repeats) and their ratio. Goal: at most 1.1x.

    python benchmarks/inplace_overhead.py [--repeat N] [--suite smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

from shardcheck.harness import runner
from shardcheck.harness.report import SilentReport
from shardcheck.harness.world import World
from shardcheck.scenarios import get_suite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--suite", default="smoke")
    ap.add_argument("--target", default="builtin")
    args = ap.parse_args()
    scenarios = get_suite(args.suite)
    times: dict[bool, list[float]] = {False: [], True: []}
    t0 = time.perf_counter()
    with World(runner.world_size_for(scenarios), timeout=60) as world:
        startup = time.perf_counter() - t0
        runner.run(scenarios, args.target, reporter=SilentReport(), world=world)  # warm: imports, groups, caches
        for _ in range(args.repeat):
            for inplace in (False, True):
                result = runner.run(scenarios, args.target, reporter=SilentReport(), world=world, inplace=inplace)
                times[inplace].append(sum(v.seconds for v in result.verdicts))
                if result.exit_code != 0:
                    raise SystemExit(f"{args.suite} failed (inplace={inplace}): "
                                     f"{[v.headline() for v in result.verdicts if v.status == 'fail'][:3]}")
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.suite} suite, target {args.target}, {len(scenarios)} scenarios, {args.repeat} repeats, "
          f"world start-up {startup:.1f}s (excluded)")
    print(f"  scenario time without the in-place check: {off:.3f}s  (runs: {', '.join(f'{t:.2f}' for t in times[False])})")
    print(f"  scenario time with it:                    {on:.3f}s  (runs: {', '.join(f'{t:.2f}' for t in times[True])})")
    print(f"  ratio: {on / off:.3f}x  (goal: at most 1.1x)")


if __name__ == "__main__":
    main()
