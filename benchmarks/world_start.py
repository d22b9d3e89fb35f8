"""SpawnedWorld start-up and tear-down: ranks forked from the server vs. spawned afresh, in one run.

Prints, for a world of ``--nproc`` gloo ranks, the wall time of each start (to every rank ready)
and close, for ranks spawned afresh (each importing torch and megatron-core) and for ranks forked
from the server (the first start includes the server's own import), and the ratio of the medians.

    python benchmarks/world_start.py [--nproc 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from shardcheck.harness.controller.worlds.spawned import SpawnedWorld


def _cycle(nproc: int, fork_server: bool) -> tuple[float, float]:
    world = SpawnedWorld(nproc, fork_server=fork_server)
    t0 = time.perf_counter()
    world.start()
    started = time.perf_counter() - t0
    t1 = time.perf_counter()
    world.close()
    return started, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    spawned = [_cycle(args.nproc, False) for _ in range(args.repeat)]
    first = _cycle(args.nproc, True)
    forked = [_cycle(args.nproc, True) for _ in range(args.repeat)]

    def median(runs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(r[i] for r in runs)

    print(f"world of {args.nproc} gloo ranks, {args.repeat} starts each (median)")
    print(f"  spawned:            start {median(spawned, 0):6.2f} s   close {median(spawned, 1):5.2f} s")
    print(f"  forked, first:      start {first[0]:6.2f} s   close {first[1]:5.2f} s   (server imports torch)")
    print(f"  forked, later:      start {median(forked, 0):6.2f} s   close {median(forked, 1):5.2f} s")
    print(f"  start ratio spawned/forked later: {median(spawned, 0) / median(forked, 0):.1f}x; "
          f"first forked start vs spawned: {first[0] / median(spawned, 0):.2f}x")


if __name__ == "__main__":
    main()
