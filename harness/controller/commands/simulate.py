"""``shardcheck simulate``: ``run`` (given scenarios) or the fuzzer's search (drawn layouts) on a
:class:`~shardcheck.harness.controller.worlds.simulated.FakeWorld`, then the minimal failing scenario replayed
on a real world when this machine holds it, to show the same kind there."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands import fuzz
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.worlds.simulated import NOTE, FakeWorld
from shardcheck.scenarios.scenario import Scenario

DEFAULT_TP = (1, 2, 4, 8)
DEFAULT_CP = (1, 2, 4, 8, 16, 32)
DEFAULT_OUT = ".shardcheck/simulate-failure.json"


def check_sizes(sizes: Sequence[int], max_world: int, where: str, product: str = "tp * cp") -> None:
    """One line, before anything runs, for a layout past ``--max-world`` (``product``: what a
    size is the product of)."""
    big = [n for n in sizes if n > max_world]
    if big:
        raise BadInput(f"{where}: {product} = {max(big)} exceeds --max-world {max_world}")


def main(args: argparse.Namespace, scenarios: list[Scenario] | None, target_args: list[str]) -> int:
    from shardcheck.harness.controller.reports.run_report import Reporters, TerminalReport

    runner.controller_target(args.target)  # an unknown target: one line, before anything starts
    if scenarios is not None:
        check_sizes([s.ranks for s in scenarios], args.max_world, "a scenario", "dp * tp * cp")
        with FakeWorld(sorted({s.ranks for s in scenarios}), timeout=args.timeout) as world:
            result = runner.run(scenarios, args.target, reporter=Reporters(TerminalReport(quiet=args.quiet)),
                                world=world, inplace=not args.no_inplace)
        print(NOTE)
        return result.exit_code
    return _search(args, target_args)


def _search(args: argparse.Namespace, target_args: list[str]) -> int:
    from shardcheck.harness.controller.reports.fuzz_report import Progress, repro_offer, summary, write_minimal
    from shardcheck.scenarios.scenario import LAYOUTS

    tp, cp = args.tp or DEFAULT_TP, args.cp or DEFAULT_CP
    sp = args.sp or cp
    layouts = args.layout or None
    names = layouts or LAYOUTS
    sizes = sorted({t * c for t in tp for c in sorted(set(cp) | set(sp)) if any(fuzz.drawable(n, c, cp, sp)
                                                                                 for n in names)})
    check_sizes(sizes, args.max_world, f"--tp {','.join(map(str, tp))} --cp {','.join(map(str, cp))}"
                + (f" --sp {','.join(map(str, sp))}" if args.sp else ""))
    out = args.out or DEFAULT_OUT
    progress = Progress(quiet=args.quiet)
    with FakeWorld(sizes or [1], timeout=args.timeout) as world:
        try:
            result = fuzz.fuzz(args.target, max_examples=args.max_examples, seed=args.seed, tp=tp, cp=cp, sp=sp,
                               layouts=layouts, max_shrinks=args.max_shrinks, timeout=args.timeout, world=world,
                               progress=progress, max_ranks=max(world.nproc, 1), inplace=not args.no_inplace,
                               on_start=lambda plan: _header(plan, args.quiet))
        finally:
            progress.close()
    minimal, written, replay = write_minimal(result, out, "simulate", target_args)
    print(summary(result, written, replay, minimal, repro_offer(args.target, minimal, written, target_args)))
    print(NOTE)
    if minimal is not None and not args.no_replay:
        print(replay_on_real_world(minimal, args.target, result.failure.kinds, args.timeout, not args.no_inplace))
    return result.exit_code


def _header(plan: fuzz.FuzzResult, quiet: bool) -> None:
    if not quiet:
        from shardcheck.scenarios.scenario import SP_LAYOUTS

        grid = " ".join(f"{t}x{c}" for t, c in plan.pairs)
        sp = {name in SP_LAYOUTS for name in plan.layouts}  # the sequence axis: cp, sp, or either by layout
        axis = "sp" if sp == {True} else "cp" if sp == {False} else "cp/sp"
        print(f"shardcheck simulate: target {plan.target}, seed {plan.seed}, tp x {axis} {grid}, layouts "
              f"{','.join(plan.layouts)} (world {math.lcm(*[t * c for t, c in plan.pairs])} at most per layout: "
              f"each layout on its own tp * {axis} ranks)", file=sys.stderr, flush=True)


def replay_on_real_world(sc: Scenario, target: str, kinds: Sequence[str], timeout: float,
                         inplace: bool = True) -> str:
    """The minimal failing scenario on a real gloo world of tp * cp ranks, when this machine holds
    one: the kinds it gives there, beside the simulation's (with the same checks: ``inplace``)."""
    from shardcheck.harness.controller.worlds.machine import Machine
    from shardcheck.harness.controller.reports.run_report import SilentReport

    machine = Machine.here()
    if sc.ranks > machine.max_ranks:
        return (f"not replayed on a real world: {sc.ranks} ranks, this machine holds {machine.max_ranks} "
                f"({machine.figures()})")
    [verdict] = runner.run([sc], target, reporter=SilentReport(), nproc=sc.ranks, timeout=timeout,
                           inplace=inplace).verdicts
    real = sorted(set(verdict.kinds))
    same = "the same kind" if set(kinds) & set(real) else "a different outcome"
    return (f"replayed on a real world of {sc.ranks} ranks (gloo): {verdict.status}"
            + (f" [{', '.join(real)}]" if real else "") + f": {same} as simulated ({', '.join(sorted(set(kinds)))})"
            + (f"\n  {verdict.failures[0].message}" if verdict.failures else ""))


