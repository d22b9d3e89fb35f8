"""Reading a large scenario file: one entry at a time (load_scenario_file) against the whole
document parsed at once and then validated (what it did before), in one process.

Writes ``--count`` scenarios to a temporary file, reads it both ways, interleaved ``--repeat``
times, and prints each way's median time and its peak memory beyond the scenarios it keeps
(tracemalloc, in a separate pass so the timing is not slowed by it), and the ratios.

    python benchmarks/scenario_file_read.py [--count 200000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from shardcheck.scenarios import Scenario, load_scenario_file


def whole(path: Path) -> list[Scenario]:
    """The document parsed at once, then every entry validated."""
    return [Scenario.from_dict(item) for item in json.loads(path.read_text())]


def _write(path: Path, count: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        f.write("[\n")
        for i in range(count):
            d = {"name": f"s{i}", "samples": [[rng.randint(4, 40), 2]], "vocab": 32, "tp": 1, "cp": 1,
                 "layout": "thd"}
            f.write(json.dumps(d) + (",\n" if i < count - 1 else "\n"))
        f.write("]\n")


def _beyond(read, path: Path) -> tuple[int, float]:
    """(scenarios, MiB allocated at the peak beyond what the result keeps)."""
    tracemalloc.start()
    try:
        out = read(path)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return len(out), (peak - kept) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    fd, name = tempfile.mkstemp(suffix=".json", prefix="shardcheck-bench-")
    os.close(fd)
    path = Path(name)
    try:
        _write(path, args.count)
        ways = {"one entry at a time": load_scenario_file, "whole document": whole}
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(args.repeat):
            for way, read in ways.items():
                t0 = time.perf_counter()
                read(path)
                times[way].append(time.perf_counter() - t0)
        print(f"{args.count:,} scenarios, {path.stat().st_size / 1e6:.1f} MB, median of {args.repeat}:")
        beyond = {}
        for way, read in ways.items():
            n, beyond[way] = _beyond(read, path)
            assert n == args.count
            print(f"  {way:<20} {statistics.median(times[way]):6.2f} s   peak beyond the scenarios kept "
                  f"{beyond[way]:7.1f} MiB")
        a, b = (statistics.median(times[w]) for w in ways)
        print(f"  time ratio (one at a time / whole): {a / b:.2f}x; memory beyond the scenarios: "
              f"{beyond['one entry at a time']:.1f} vs {beyond['whole document']:.1f} MiB")
    finally:
        path.unlink()


if __name__ == "__main__":
    main()
