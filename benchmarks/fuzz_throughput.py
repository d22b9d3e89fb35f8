"""Fuzzing throughput on this machine, measured in one run.

Prints:
  - world start-up (once, stated on its own and excluded from every rate);
  - the fuzz path: ``shardcheck.harness.controller.commands.fuzz.fuzz`` against the builtin target on one reused
    world, in scenarios per minute of scenario time and of search time (hypothesis' generation
    and bookkeeping included);
  - baselines on the same scenarios: run as one suite (``shardcheck run`` semantics, one
    runner.run call on the same world), and the estimate for a world started per example (what
    calling ``shardcheck run`` once per scenario would cost: start-up + scenario time);
  - how often the planted ``builtin:unpadded_chunk_start`` condition comes up among drawn
    zigzag scenarios, the edge-biased strategy against lengths drawn uniformly at random (at the
    fuzzer's 40 tokens and at realistic lengths), and how many scenarios the fuzzer needs to
    find and shrink it, per seed.

    python benchmarks/fuzz_throughput.py [--examples N] [--seeds K]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hypothesis import HealthCheck, given, settings

from shardcheck.harness.controller.commands import fuzz
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.harness.controller.worlds.spawned import SpawnedWorld
from shardcheck.scenarios import Sample, Scenario
from shardcheck.scenarios.strategies import scenarios


def _planted(sc: Scenario) -> bool:
    """The mutant's condition: a zigzag sample needing no padding, with chunks of 3 rows or more,
    whose response starts on the first row of a CP chunk other than the first."""
    unit = 2 * sc.cp
    return sc.layout == "zigzag" and any(
        s.total % unit == 0 and s.total // unit >= 3 and s.prompt > 1 and (s.prompt - 1) % (s.total // unit) == 0
        for s in sc.samples)


def _uniform_rate(max_total: int, n: int = 20000) -> float:
    """Plain random testing: sample count, lengths and responses uniform, same cp choices."""
    rng = random.Random(0)
    hits = 0
    for _ in range(n):
        batch = []
        for _ in range(rng.randint(1, 6)):
            total = rng.randint(2, max_total)
            batch.append(Sample(total, rng.randint(1, total - 1)))
        hits += _planted(Scenario("uniform", tuple(batch), vocab=8, cp=rng.choice((2, 4)), layout="zigzag"))
    return hits / n


def _hit_rate(strategy, n: int) -> float:
    seen: list[Scenario] = []

    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(sc):
        seen.append(sc)

    collect()
    zigzag = [sc for sc in seen if sc.layout == "zigzag"]
    return sum(map(_planted, zigzag)) / max(1, len(zigzag))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=200, help="examples of the fuzz run (default 200)")
    ap.add_argument("--seeds", type=int, default=5, help="seeds for the find-the-planted-bug runs (default 5)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    with SpawnedWorld(4, timeout=60) as world:
        startup = time.perf_counter() - t0
        ran: list[Scenario] = []
        result = fuzz.fuzz("builtin", max_examples=args.examples, seed=12345, world=world, database=None,
                           progress=lambda e: ran.append(e.verdict.scenario))
        if result.failure is not None:
            raise SystemExit(f"builtin failed: {result.failure.headline()}")
        search = result.wall_seconds  # the world was already up: all of it is search time
        per_scenario = result.scenario_seconds / result.runs

        batch = [sc.__class__(**{**sc.to_dict(), "name": f"s{i}"}) for i, sc in enumerate(ran)]
        t1 = time.perf_counter()
        suite = runner.run(batch, "builtin", reporter=SilentReport(), world=world)
        suite_seconds = time.perf_counter() - t1
        assert suite.exit_code == 0

        finds = []
        for s in range(args.seeds):
            found = fuzz.fuzz("builtin:unpadded_chunk_start", max_examples=100, seed=s, world=world, database=None)
            sc = found.failure.scenario if found.failure else None
            finds.append((s, found.searched, found.shrink_runs, sc.summary() if sc else None,
                          found.scenario_seconds))
        restarts = len(world.startup_seconds) - 1

    print(f"machine: world of 4 ranks (gloo, CPU); start-up {startup:.1f}s, once, excluded below "
          f"({restarts} restarts during the run)")
    print(f"fuzz path (builtin, {result.runs} scenarios, seed 12345, default space: tp x cp "
          f"{' '.join(f'{t}x{c}' for t, c in result.pairs)}, all layouts, vocab <= 16 per TP rank):")
    print(f"  scenario time  {result.scenario_seconds:6.1f}s  {60 * result.runs / result.scenario_seconds:6.0f} "
          f"scenarios/min  ({1000 * per_scenario:.0f} ms each, median "
          f"{1000 * statistics.median(v.seconds for v in suite.verdicts):.0f} ms)")
    print(f"  search time    {search:6.1f}s  {60 * result.runs / search:6.0f} scenarios/min  "
          "(with hypothesis' generation and bookkeeping)")
    print("baselines, same scenarios:")
    print(f"  one suite run (shardcheck run semantics, same world)  {suite_seconds:6.1f}s  "
          f"{60 * len(batch) / suite_seconds:6.0f} scenarios/min")
    fresh = startup + per_scenario
    print(f"  a fresh world per example (start-up + scenario)        {fresh * len(batch):6.1f}s  "
          f"{60 / fresh:6.1f} scenarios/min  -> the reused world is {fresh / per_scenario:.0f}x faster")

    print("planted bug (builtin:unpadded_chunk_start): share of drawn zigzag scenarios (cp 2 or 4, 1 to 6 samples)")
    print("on its condition:")
    for max_total in (40, 1024):
        edge = _hit_rate(scenarios(tp=1, cp=(2, 4), layout="zigzag", max_total=max_total), 1000)
        print(f"  lengths up to {max_total:>4}: edge-biased strategy {100 * edge:4.1f}%, "
              f"uniform random lengths {100 * _uniform_rate(max_total):4.1f}%")
    print("finding it (max 100 examples per seed):")
    for s, searched, shrinks, summary, seconds in finds:
        if summary is None:
            print(f"  seed {s}: not found in {searched} scenarios ({seconds:.1f}s)")
        else:
            print(f"  seed {s}: found after {searched} scenarios, shrunk in {shrinks} runs -> {summary} "
                  f"({seconds:.1f}s)")

if __name__ == "__main__":
    main()
