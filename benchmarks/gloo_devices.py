"""A world's CPU with one gloo device a rank (the harness's ranks) against torch's one a group.

Each round starts a 4-rank world of each kind in turn (the other closed: only the world measured
runs), builds the groups of every layout the regressions suite uses (megatron-core's, as a world
that has run many scenarios holds them), then measures:

- idle: the CPU seconds its ranks use over ``--idle`` seconds of doing nothing (each rank's
  /proc/<pid>/stat, every thread), as a test suite's shared world does while other tests run;
- busy: the smoke suite's wall time and the machine's busy CPU seconds over it.

Rounds alternate the order; the medians and the ratios (per-group / shared) are printed.

On an otherwise idle virtual machine the per-group world's smoke wall time can come out a few
per cent lower although it uses more CPU: its threads' constant wake-ups keep the virtual CPUs
from halting, so the ranks' many small messages are not delayed by waking a halted CPU.
``--awake`` runs a process that sleeps 0.2 ms in a loop throughout (as any other load on the
machine does), which takes that out of the comparison.

    python benchmarks/gloo_devices.py [--rounds 3] [--idle 3] [--awake]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.harness.controller.worlds.spawned import SpawnedWorld
from shardcheck.harness.rank.plumbing.gloo_device import ENV, loop_threads
from shardcheck.scenarios import get_suite

KINDS = ("shared", "per-group")  # the values of SHARDCHECK_GLOO_DEVICES


def _process_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _machine_busy() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _round(kind: str, idle_s: float) -> dict[str, float]:
    os.environ[ENV] = kind
    with SpawnedWorld(4, timeout=60) as world:
        runner.run(get_suite("regressions"), "builtin", reporter=SilentReport(), world=world)
        pids = [p.pid for p in world._procs]
        loops = statistics.median(loop_threads(p) or 0 for p in pids)
        c0 = sum(_process_cpu(p) for p in pids)
        time.sleep(idle_s)
        idle = (sum(_process_cpu(p) for p in pids) - c0) / idle_s
        b0, t0 = _machine_busy(), time.perf_counter()
        result = runner.run(get_suite("smoke"), "builtin", reporter=SilentReport(), world=world)
        wall, busy = time.perf_counter() - t0, _machine_busy() - b0
        assert result.exit_code == 0, [v.headline() for v in result.verdicts if v.status != "pass"]
    return {"loops": loops, "idle": idle, "wall": wall, "busy": busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=3.0, help="seconds each world is watched idle")
    parser.add_argument("--awake", action="store_true", help="keep the CPUs from halting (see above)")
    args = parser.parse_args()
    before = os.environ.get(ENV)
    waker = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.0002)"]) \
        if args.awake else None
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    try:
        for i in range(args.rounds):
            for kind in (KINDS if i % 2 == 0 else KINDS[::-1]):
                runs[kind].append(_round(kind, args.idle))
    finally:
        if waker is not None:
            waker.kill()
            waker.wait()
        if before is None:
            os.environ.pop(ENV, None)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    print(f"4-rank gloo world after the regressions suite's layouts, {args.rounds} rounds (medians)"
          + (", CPUs kept awake" if args.awake else ""))
    for kind in KINDS:
        print(f"  {kind:9s}: {med(kind, 'loops'):3.0f} loop threads a rank; idle {med(kind, 'idle'):.3f} "
              f"CPU-s/s; smoke {med(kind, 'wall'):.2f} s wall, {med(kind, 'busy'):.1f} CPU-s")
    print(f"  per-group / shared: idle CPU {med('per-group', 'idle') / max(med('shared', 'idle'), 1e-3):.1f}x, "
          f"smoke wall {med('per-group', 'wall') / med('shared', 'wall'):.2f}x, "
          f"smoke CPU {med('per-group', 'busy') / med('shared', 'busy'):.2f}x")


if __name__ == "__main__":
    main()
