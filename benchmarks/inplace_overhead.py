"""The in-place check's cost, measured in one run on this machine.

Runs the smoke suite against the builtin target on one world, round after round, in three
modes: without the ``input_mutated`` check; with it (the copies kept and the bit-for-bit
comparisons after forward and backward: what every run does); and with the dispatch mode that
names the first in-place write on for every scenario (what a run does only for a scenario whose
inputs changed, to explain it). Prints the suite's scenario time in each (world start-up
excluded, median of the rounds) and the ratios to the first. Goal for the check: at most 1.1x.

    python benchmarks/inplace_overhead.py [--repeat N] [--suite smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.worlds.spawned import SpawnedWorld
from shardcheck.harness.wire import Checks
from shardcheck.scenarios import get_suite

MODES = {
    "without the check": Checks(inplace=False),
    "with the check (every run)": Checks(inplace=True),
    "with the write watch on every op (explain)": Checks(inplace=True, explain=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--suite", default="smoke")
    ap.add_argument("--target", default="builtin")
    args = ap.parse_args()
    scenarios = sorted(get_suite(args.suite), key=lambda s: (s.tp, s.cp))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    t0 = time.perf_counter()
    with SpawnedWorld(runner.world_size_for(scenarios), timeout=60) as world:
        startup = time.perf_counter() - t0
        for _ in range(args.repeat + 1):  # the first round warms imports, groups and caches
            for mode, checks in MODES.items():
                t1 = time.perf_counter()
                for sc in scenarios:
                    results = world.run(sc.to_dict(), args.target, checks)
                    if any(r.failures for r in results):
                        raise SystemExit(f"{sc.name} failed ({mode}): {results[0].failures[:1]}")
                times[mode].append(time.perf_counter() - t1)
    for mode in MODES:
        times[mode] = times[mode][1:]
    base = statistics.median(times["without the check"])
    print(f"{args.suite} suite, target {args.target}, {len(scenarios)} scenarios, {args.repeat} rounds, "
          f"world start-up {startup:.1f}s (excluded)")
    for mode, runs in times.items():
        med = statistics.median(runs)
        print(f"  {mode:<44} {med:6.3f}s  {med / base:5.3f}x  (rounds: {', '.join(f'{t:.2f}' for t in runs)})")
    print("  goal: the check at most 1.1x")


if __name__ == "__main__":
    main()
