"""A soak run: many small scenarios in one run, watching memory, the store and the rate.

Runs ``--count`` generated scenarios (tiny lengths; (tp, cp) from ``--tp-cp``, by default 2x2
alone, so that every block is alike; thd and bshd layouts, zigzag and all-gather context
parallelism) in ONE run against the builtin target, on a world of
4 ranks started here, with a JSON report written to a temporary file. Every ``--block``
scenarios it samples the controller's and each rank's resident memory (VmRSS), the keys in the
world's store, the report's size, the rate of the block and the time the report's updates took.

Prints a table with a row per block, then the first block against the last: the memory deltas
(goal: flat within 50 MB) and the rate ratio (goal: within 20 %). The runner runs scenarios
grouped by (tp, cp): with a mix (``--tp-cp 1x1,1x2,2x1,2x2``) the first block is all tp=1 cp=1 and
the last all tp=2 cp=2, which differ in speed by themselves; so the rate of each (tp, cp) is also
measured on the same world just before and just after the soak (``--calibrate`` scenarios each,
no report), and compared.

    python benchmarks/soak.py [--count 5000] [--block 500] [--tp-cp 2x2] [--calibrate 100] [--report PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections import Counter
from typing import Any

from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import JsonReport, SilentReport
from shardcheck.harness.controller.reports.verdict import FAIL, PASS, RunInfo, Verdict
from shardcheck.harness.controller.worlds.spawned import SpawnedWorld
from shardcheck.scenarios import Sample, Scenario

NPROC = 4
LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]  # (tp, cp), in the order the runner runs them
MB = 1024 * 1024


def generate(count: int, seed: int, prefix: str = "soak", layouts: list[tuple[int, int]] = LAYOUTS) -> list[Scenario]:
    """``count`` small valid scenarios, (tp, cp) drawn from ``layouts``, in a shuffled suite order."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        tp, cp = rng.choice(layouts)
        layout = rng.choice(("thd", "bshd") if cp == 1 else ("zigzag", "allgather"))
        samples = []
        for _ in range(rng.randint(1, 3)):
            total = rng.randint(2, 12)
            samples.append(Sample(total, rng.randint(1, total - 1)))
        with_entropy, coef = rng.choice(((False, 0.0), (True, 0.0), (True, 0.1)))
        out.append(Scenario(f"{prefix}-{i}", tuple(samples), vocab=tp * rng.choice((2, 4, 8)), tp=tp, cp=cp,
                            layout=layout, with_entropy=with_entropy, entropy_coef=coef,
                            log_probs_chunk_size=rng.choice((-1, -1, 1, 2, 3)), temperature=rng.choice((1.0, 0.8)),
                            seed=seed * 1_000_000 + i))
    return out


def rss(pid: int) -> int | None:
    """VmRSS of ``pid`` in bytes (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


class Sampling:
    """The JSON report, and every ``block`` verdicts a sample of memory, store and rate."""

    def __init__(self, report: JsonReport, world: SpawnedWorld, block: int) -> None:
        self.report, self.world, self.block = report, world, block
        self.rows: list[dict[str, Any]] = []
        self.layouts: Counter = Counter()
        self.done = 0
        self.total = 0
        self.t_block = 0.0
        self.in_report = 0.0  # seconds in the report's add() this block

    def start(self, info: RunInfo, scenarios: list[Scenario]) -> None:
        self.report.start(info, scenarios)
        self.total = len(scenarios)
        self.t_block = time.perf_counter()

    def add(self, verdict: Verdict) -> None:
        t0 = time.perf_counter()
        self.report.add(verdict)
        self.in_report += time.perf_counter() - t0
        self.done += 1
        self.layouts[(verdict.scenario.tp, verdict.scenario.cp)] += 1
        if self.done % self.block == 0 or self.done == self.total:
            self._sample()

    def finish(self, info: RunInfo) -> None:
        self.report.finish(info)

    def _sample(self) -> None:
        now = time.perf_counter()
        n = sum(self.layouts.values())
        store = self.world._store
        self.rows.append({
            "done": self.done,
            "n": n,
            "seconds": now - self.t_block,
            "rate": n / (now - self.t_block),
            "report_ms": self.in_report / n * 1000,
            "layouts": dict(self.layouts),
            "controller": rss(os.getpid()),
            "ranks": [rss(p.pid) for p in self.world._procs],
            "keys": store.num_keys() if store is not None else None,
            "report": os.path.getsize(self.report.path),
            "starts": len(self.world.startup_seconds),
        })
        self.layouts = Counter()
        self.in_report = 0.0
        self.t_block = time.perf_counter()  # the sampling itself is in no block


def calibrate(world: SpawnedWorld, per_layout: int, seed: int, layouts: list[tuple[int, int]] = LAYOUTS
              ) -> dict[tuple[int, int], float]:
    """Seconds per scenario of each (tp, cp), on this world, without a report (the same
    scenarios for the same seed)."""
    out = {}
    for lay in layouts:
        scenarios = generate(per_layout, seed, f"calibrate-{lay[0]}-{lay[1]}", [lay])
        runner.run(scenarios[:5], "builtin", reporter=SilentReport(), world=world)  # its groups built, warm
        t0 = time.perf_counter()
        result = runner.run(scenarios, "builtin", reporter=SilentReport(), world=world)
        out[lay] = (time.perf_counter() - t0) / len(scenarios)
        if result.exit_code:
            raise SystemExit(f"calibration tp={lay[0]} cp={lay[1]}: the builtin target failed")
    return out


def _mb(n: int | None) -> str:
    return f"{n / MB:7.1f}" if n is not None else "      -"


def _layouts(counts: dict[tuple[int, int], int]) -> str:
    return " ".join(f"{tp}x{cp}:{k}" for (tp, cp), k in sorted(counts.items()))


def _goal(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=5000, help="scenarios in the soak run")
    parser.add_argument("--block", type=int, default=500, help="scenarios per sample")
    parser.add_argument("--calibrate", type=int, default=100,
                        help="scenarios per (tp, cp) timed before and after the soak")
    parser.add_argument("--tp-cp", default="2x2", metavar="LIST",
                        help="(tp, cp) pairs to draw from, e.g. 1x1,2x2 (default: 2x2)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--report", help="where to write the JSON report (default: a temporary file)")
    args = parser.parse_args()

    layouts = [tuple(int(n) for n in pair.split("x")) for pair in args.tp_cp.split(",")]
    scenarios = generate(args.count, args.seed, layouts=layouts)
    with tempfile.TemporaryDirectory(prefix="shardcheck-soak-") as tmp, SpawnedWorld(NPROC, timeout=60) as world:
        before = calibrate(world, args.calibrate, args.seed + 1, layouts)
        path = args.report or os.path.join(tmp, "soak.json")
        sampling = Sampling(JsonReport(path, {"suite": "soak"}), world, args.block)
        starts = len(world.startup_seconds)
        t0 = time.perf_counter()
        result = runner.run(scenarios, "builtin", reporter=sampling, world=world)
        wall = time.perf_counter() - t0
        with open(path) as f:
            doc = json.load(f)
        size = os.path.getsize(path)
        rows = sampling.rows
        restarts = len(world.startup_seconds) - starts
        after = calibrate(world, args.calibrate, args.seed + 1, layouts)

    counts = Counter(v.status for v in result.verdicts)
    print(f"soak: {args.count} scenarios in one run, builtin target, {NPROC} gloo ranks, JSON report; "
          f"{wall:.1f}s, {args.count / wall:.1f} scenarios/s overall")
    print(f"  {counts[PASS]} passed, {counts[FAIL]} failed, {args.count - counts[PASS] - counts[FAIL]} other; "
          f"world restarts during the soak: {restarts}; "
          f"report {size / MB:.1f} MB, {len(doc['scenarios'])} scenarios, complete {doc['complete']}")
    print()
    print(f"{'done':>6} {'layouts (tp x cp: n)':<26} {'rate/s':>7} {'report ms':>9} {'ctrl MB':>7} "
          + " ".join(f"{'rank' + str(r) + ' MB':>8}" for r in range(NPROC)) + f" {'store keys':>10} {'report MB':>9}")
    for row in rows:
        print(f"{row['done']:>6} {_layouts(row['layouts']):<26} {row['rate']:>7.1f} {row['report_ms']:>9.2f} "
              f"{_mb(row['controller'])} " + " ".join(f" {_mb(m)}" for m in row["ranks"])
              + f" {row['keys'] if row['keys'] is not None else '-':>10} {row['report'] / MB:>9.2f}")
    first, last = rows[0], rows[-1]
    print()
    print(f"first block (to {first['done']}) vs last block (to {last['done']}):")
    pairs = [("controller", first["controller"], last["controller"])]
    pairs += [(f"rank {r}", a, b) for r, (a, b) in enumerate(zip(first["ranks"], last["ranks"]))]
    for name, a, b in pairs:
        if a is None or b is None:
            print(f"  {name:<10} RSS: not readable")
            continue
        delta = (b - a) / MB
        print(f"  {name:<10} RSS {a / MB:7.1f} MB -> {b / MB:7.1f} MB  ({delta:+.1f} MB; "
              f"goal within 50 MB: {_goal(abs(delta) <= 50)})")
    if last["starts"] != first["starts"]:
        print("  (the world restarted between them: the ranks' figures are of different processes)")
    raw = last["rate"] / first["rate"]
    print(f"  rate      {first['rate']:7.1f}/s -> {last['rate']:7.1f}/s  (last/first {raw:.2f}; "
          f"goal within 20 %: {_goal(abs(raw - 1) <= 0.2)}) [raw: {_layouts(first['layouts'])} vs "
          f"{_layouts(last['layouts'])}]")
    print(f"  report    {first['report_ms']:7.2f} ms -> {last['report_ms']:7.2f} ms per scenario "
          "in the JSON report's add()")
    print(f"  store keys {first['keys']} -> {last['keys']}")
    print()
    print(f"the same {args.calibrate} scenarios per layout before and after the soak (no report), on the same world:")
    for (tp, cp), b in before.items():
        a = after[(tp, cp)]
        print(f"  tp={tp} cp={cp}  {1 / b:6.1f}/s -> {1 / a:6.1f}/s  (after/before {b / a:.2f}; "
              f"goal within 20 %: {_goal(abs(b / a - 1) <= 0.2)})")


if __name__ == "__main__":
    main()
