"""``shardcheck simulate``'s speed, with a real world's beside it, in one run.

Prints: the same world-4 layout (tp 2 x cp 2, zigzag) run on a real gloo world and simulated
(seconds a layout, median of ``--repeat``); simulated layouts a minute at world 8 (tp 2 x cp 4,
``--layouts`` distinct layouts, zigzag and all-gather); the time of one world-512 layout (tp 8 x
cp 64) and of one world-64 layout (3 samples of 129 to 700 tokens, chunk 64). SpawnedWorld start-up is not counted anywhere (it is paid once).
The simulated figures beside their baseline in the same run: the same layouts with every simulated
rank building all of megatron-core's groups (``FakeWorld(share_rank_lists=False)``, as before issue
24: ``initialize_model_parallel`` creating every group of the world, 2,971 at world 512).
Beside each: how long a simulation process waited for a CPU meanwhile (schedstat; the machine is
shared, and its load is not the simulation's time).
Goals (issues 15 and 24): >= 1000 layouts a minute at world 8, <= 1 s for one world-64 layout,
<= 10 s for one world-512 layout.

    python benchmarks/simulate_speed.py [--repeat 5] [--layouts 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.worlds.cpu_wait import cpu_wait_seconds
from shardcheck.harness.controller.worlds.simulated import FakeWorld
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.harness.controller.worlds.spawned import SpawnedWorld
from shardcheck.scenarios import Sample, Scenario


def _layout(tp: int, cp: int, layout: str = "zigzag", seed: int = 0, extra: int = 0) -> Scenario:
    return Scenario(f"bench-{tp}x{cp}-{layout}-{seed}", (Sample(700 + extra, 300), Sample(260, 5), Sample(129, 128)),
                    vocab=64, tp=tp, cp=cp, layout=layout, entropy_coef=0.1, log_probs_chunk_size=64, seed=seed)


def _time(world, scenarios) -> list[float]:
    out = []
    for sc in scenarios:
        t0 = time.perf_counter()
        [v] = runner.run([sc], "builtin", reporter=SilentReport(), world=world).verdicts
        out.append(time.perf_counter() - t0)
        assert v.status == "pass", v.headline()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--layouts", type=int, default=200)
    args = parser.parse_args()

    four = [_layout(2, 2, seed=i) for i in range(args.repeat)]
    with SpawnedWorld(4) as real:  # started on entering
        real_4 = statistics.median(_time(real, four))
    with FakeWorld([4, 8, 64, 512]) as fake:
        fake.start()
        _time(fake, [_layout(4, 16, seed=99)])  # every simulation process imports what it runs once: not counted
        fake_4 = statistics.median(_time(fake, four))
        # small layouts, as a search draws them: long prompts,
        # empty shares and slices
        eight = [Scenario(f"small-{i}", (Sample(61 - i % 9, 3), Sample(40, 2 + i % 5), Sample(30, 20)), vocab=32,
                          tp=2, cp=4, layout=("zigzag", "allgather")[i % 2], entropy_coef=0.1,
                          log_probs_chunk_size=(-1, 5)[i % 2], seed=i) for i in range(args.layouts)]
        # each figure beside its baseline, on the same layouts, measured next to it (the machine is
        # shared: its load drifts); world 8 in halves, in the order shared, baseline, baseline, shared
        half = len(eight) // 2
        t8, base_t8, wait_8 = _both(fake, [eight[:half], eight[half:]])
        per_minute, base_per_minute = 60 * len(eight) / t8, 60 * len(eight) / base_t8
        w64, base_w64, wait_64 = _both(fake, [[_layout(4, 16)]])
        w512, base_w512, wait_512 = _both(fake, [[_layout(8, 64)]])
    print(f"world 4 (tp 2 x cp 2, zigzag): real gloo world {real_4:.3f} s a layout, simulated {fake_4:.3f} s "
          f"({real_4 / fake_4:.1f}x)")
    print(f"world 8 (tp 2 x cp 4): {per_minute:.0f} simulated layouts a minute against {base_per_minute:.0f} "
          f"building every group ({per_minute / base_per_minute:.2f}x; goal >= 1000; small layouts: "
          f"3 samples of 30 to 61 tokens); the simulation process {wait_8}")
    print(f"world 64 (tp 4 x cp 16): {w64:.2f} s against {base_w64:.2f} s building every group "
          f"({base_w64 / w64:.1f}x faster; goal <= 1 s); a simulation process {wait_64}")
    print(f"world 512 (tp 8 x cp 64): {w512:.2f} s against {base_w512:.2f} s building every group "
          f"({base_w512 / w512:.1f}x faster; goal <= 10 s) with {fake.workers} simulation processes; "
          f"one {wait_512}")


def _both(fake: FakeWorld, parts: list[list[Scenario]]) -> tuple[float, float, str]:
    """Seconds for all of ``parts`` simulated as shipped (megatron's rank lists shared between the
    simulated ranks), and as the baseline (every simulated rank building all of megatron's groups);
    the order alternates part by part. Then how long a simulation process waited for a CPU during
    each (the most of any: the machine is shared, and a wait is its load, not the code's time)."""
    seconds, waited = {True: 0.0, False: 0.0}, {True: 0.0, False: 0.0}
    for i, part in enumerate(parts):
        for share in ((True, False), (False, True))[i % 2]:
            fake.share_rank_lists = share
            pids = [proc.pid for proc, _ in fake._children]
            before = [cpu_wait_seconds(pid) or 0.0 for pid in pids]
            seconds[share] += sum(_time(fake, part))
            waited[share] += max((cpu_wait_seconds(pid) or 0.0) - b for pid, b in zip(pids, before))
    fake.share_rank_lists = True
    return seconds[True], seconds[False], f"waited for a CPU up to {waited[True]:.2f} s and {waited[False]:.2f} s"


if __name__ == "__main__":
    main()
