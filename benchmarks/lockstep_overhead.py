"""Lockstep's cost and speed, measured in one run on this machine.

Prints, for the smoke suite against the builtin target:
  - wall time with lockstep, without it (trace only), and with TORCH_DISTRIBUTED_DEBUG=DETAIL
    alone (no lockstep), each as total (with world start-up) and scenario time (without), and
    their ratios to the run without lockstep (the runs with and without it alternate, on two
    worlds alive together);
  - for every mutant whose bug is a would-be hang, the time from the divergent call to the
    controller holding its report.

    python benchmarks/lockstep_overhead.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.harness.controller.worlds.spawned import SpawnedWorld
from shardcheck.scenarios import get_suite
from shardcheck.targets.mutants import MUTANTS


def _run_smoke(world: SpawnedWorld, label: str) -> float:
    t = time.perf_counter()
    result = runner.run(get_suite("smoke"), "builtin", reporter=SilentReport(), world=world)
    if result.exit_code != 0:
        raise SystemExit(f"smoke failed ({label})")
    return time.perf_counter() - t


def _interleaved(repeat: int) -> dict[str, dict[str, float]]:
    """With and without lockstep, one world each, alive together; the runs alternate (the order
    swapped every round) so that the machine's noise falls on both alike."""
    worlds, startup = {}, {}
    try:
        for label, lockstep in (("no lockstep (trace only)", False), ("lockstep", True)):
            t0 = time.perf_counter()
            worlds[label] = SpawnedWorld(4, timeout=60, lockstep=lockstep).__enter__()
            startup[label] = time.perf_counter() - t0
        times: dict[str, list[float]] = {label: [] for label in worlds}
        for i in range(repeat):
            for label in (list(worlds) if i % 2 == 0 else list(worlds)[::-1]):
                times[label].append(_run_smoke(worlds[label], label))
    finally:
        for w in worlds.values():
            w.close()
    return {label: {"startup": startup[label], "scenarios": statistics.median(t),
                    "total": startup[label] + statistics.median(t), "runs": t} for label, t in times.items()}


def _detail(repeat: int) -> dict[str, float]:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL alone: read when torch loads, so its ranks are spawned afresh."""
    saved = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    try:
        t0 = time.perf_counter()
        with SpawnedWorld(4, timeout=60, lockstep=False) as world:
            startup = time.perf_counter() - t0
            times = [_run_smoke(world, "DETAIL") for _ in range(repeat)]
        return {"startup": startup, "scenarios": statistics.median(times),
                "total": startup + statistics.median(times), "runs": times}
    finally:
        if saved is None:
            del os.environ["TORCH_DISTRIBUTED_DEBUG"]
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = saved


def _detection() -> list[tuple[str, str, float, float]]:
    rows = []
    with SpawnedWorld(4, timeout=30) as world:
        for name, cls in MUTANTS.items():
            if cls.expected[0] != "collective_mismatch":
                continue
            result = runner.run(get_suite("regressions"), f"builtin:{name}", reporter=SilentReport(), world=world)
            found = [f for v in result.verdicts for f in v.failures if f.kind == "collective_mismatch"]
            for v in result.verdicts:
                for f in v.failures:
                    if f.kind == "collective_mismatch":
                        rows.append((name, v.scenario.name, f.details["detected_after_s"],
                                     f.details["reported_after_s"]))
                        break
            if not found:
                raise SystemExit(f"{name}: no collective mismatch found")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="smoke runs per mode (median reported)")
    args = ap.parse_args()
    figures = _interleaved(args.repeat)
    figures["TORCH_DISTRIBUTED_DEBUG=DETAIL, no lockstep"] = _detail(args.repeat)
    base = figures["no lockstep (trace only)"]
    print(f"smoke suite, builtin target, 4 ranks (gloo), {len(get_suite('smoke'))} scenarios, "
          f"median of {args.repeat} runs on one world per mode (with and without lockstep in turn)")
    print(f"{'mode':<44} {'start-up':>9} {'scenarios':>10} {'total':>8} {'ratio(scen)':>12} {'ratio(total)':>13}")
    for label, f in figures.items():
        print(f"{label:<44} {f['startup']:>8.2f}s {f['scenarios']:>9.2f}s {f['total']:>7.2f}s "
              f"{f['scenarios'] / base['scenarios']:>11.2f}x {f['total'] / base['total']:>12.2f}x"
              f"   runs: {', '.join(f'{t:.2f}' for t in f['runs'])}")
    print()
    print("hang mutants on the regressions suite: divergent call -> detected on the rank -> report at the controller")
    print(f"{'mutant':<28} {'scenario':<28} {'detected':>10} {'reported':>10}")
    for name, scenario, detected, reported in _detection():
        print(f"{name:<28} {scenario:<28} {detected * 1000:>8.1f}ms {reported * 1000:>8.1f}ms")


if __name__ == "__main__":
    main()
