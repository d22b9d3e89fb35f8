"""The commands that check a target: run, invariance, bisect, fuzz, simulate.

Each plans first (:mod:`shardcheck.command`: the run's configuration, the scenarios, its own
settings, everything refused that would be refused) and then executes the plan with its
configuration in effect (:func:`shardcheck.run_config.in_effect`), which reaches every rank inside
each ``run`` message.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

from shardcheck.command import (EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NOTHING_CHECKED, EXIT_OK, EXIT_TERMINATED,
                                Command, Plan, Terminated, check_coverage, check_reports, check_switches, check_world,
                                history_options, history_target, json_report, name_list, register, repeat_args,
                                repro_command, run_config, scenario_options, search_options, select, unwritten,
                                world_options, writable)
from shardcheck.errors import BadInput
from shardcheck.run_options import in_effect


@register
class Run(Command):
    name = "run"
    help = "check a target against a suite or scenario file"

    def add_options(self, r: argparse.ArgumentParser) -> None:
        world_options(r)
        scenario_options(r)
        r.add_argument("--json-report", metavar="FILE", help="write the report here, updated as results arrive")
        r.add_argument("--html-report", metavar="FILE",
                       help="write a self-contained HTML page here (lanes of each hang, the layout map), updated as "
                            "results arrive; built from the JSON report's data")
        r.add_argument("--nproc", type=int, default=None,
                       help="ranks in the world (default: the least every scenario fits in)")
        r.add_argument("--trace", action="store_true",
                       help="put every rank's collective calls (op, group, shapes, phase, site) in the JSON report")
        check_switches(r)
        r.add_argument("--allow-all-skipped", action="store_true",
                       help="exit 0, not 5, when every scenario was skipped (nothing was checked)")
        r.add_argument("--no-mask-leak", action="store_true",
                       help="a training step is not run again with NaN at every masked position (mask_leak; "
                            "docs/training.md); its gradient and values are still checked")
        r.add_argument("--coverage", action="store_true",
                       help="say which of the framework's log-prob, data and loss functions ran and the line "
                            "coverage of those modules (coverage.py, only the framework's own files), in every "
                            "report")

    def plan(self, args: argparse.Namespace) -> Plan:
        check_world(args)
        config = run_config(args)
        scenarios = select(args)
        check_world(args, scenarios)
        if config.coverage:
            check_coverage(config)
        check_reports(args)
        settings = SimpleNamespace(nproc=args.nproc, timeout=args.timeout, quiet=args.quiet,
                                   json_report=args.json_report, html_report=args.html_report,
                                   suite=args.suite or "smoke", allow_all_skipped=args.allow_all_skipped,
                                   repro=repro_command(args))
        return Plan(config, tuple(scenarios), settings, args)

    def execute(self, plan: Plan) -> int:
        from shardcheck.harness.controller.commands import runner
        from shardcheck.harness.controller.worlds.joined import launched_by_torchrun
        from shardcheck.harness.controller.reports.run_report import JsonReport, Reporters, SilentReport, TerminalReport
        from shardcheck.harness.controller.worlds.choice import world_for

        config, s = plan.config, plan.settings
        world, rank, json_path = None, 0, s.json_report
        if launched_by_torchrun():  # every rank runs this command: they join the launcher's world
            world = world_for(0, join=True, timeout=s.timeout, lockstep=config.lockstep, backend=config.backend).world
            rank = int(os.environ["RANK"])
            if rank != 0:  # one report: rank 0's (every rank reaches the same verdicts)
                json_path = None
        reports = json_report(json_path, s.suite, JsonReport)
        html_report, scratch = None, None
        if s.html_report and rank == 0:
            from shardcheck.harness.controller.reports.html_report import HtmlReport

            if reports is None:  # the page is built from the JSON report's data: keep one aside
                import tempfile

                scratch = tempfile.TemporaryDirectory(prefix="shardcheck-report-")
                reports = JsonReport(os.path.join(scratch.name, "report.json"), {"suite": s.suite})
            html_report = HtmlReport(s.html_report, reports)
        terminal = SilentReport() if rank != 0 else TerminalReport(quiet=s.quiet)
        try:
            result = runner.run(list(plan.scenarios), config.target,
                                reporter=Reporters(terminal, reports, html_report), nproc=s.nproc,
                                timeout=s.timeout, world=world, repro=s.repro, config=config)
        finally:
            if world is not None:
                world.close()
            if scratch is not None:
                scratch.cleanup()
        failed = unwritten(reports if scratch is None else None, html_report)
        if failed:  # the verdicts are in the table above; the file could not take them
            print(f"shardcheck: error: {failed}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if result.verdicts and all(v.status == "skip" for v in result.verdicts) and not s.allow_all_skipped:
            print(f"shardcheck: nothing was checked: all {len(result.verdicts)} scenarios were skipped "
                  "(--allow-all-skipped to exit 0)", file=sys.stderr)
            return EXIT_NOTHING_CHECKED
        return result.exit_code


@register
class Invariance(Command):
    name = "invariance"
    help = "check that each sample's outputs keep their bits however it is laid out"
    # one command line carries from run to invariance; the matrix compares outputs, never inputs
    accepted_without_effect = ("--no-inplace",)

    def add_options(self, v: argparse.ArgumentParser) -> None:
        world_options(v)
        scenario_options(v)
        v.add_argument("--axis", type=name_list, default=None, metavar="LIST",
                       help="axes to check (default: all): rerun,tp,cp,cp_mode,format,chunk,packing,order,split")
        v.add_argument("--expect", default=None, metavar="SPEC",
                       help="the contract, overriding the target's: AXIS=bitwise or AXIS=ulp:N, comma-separated "
                            "(e.g. packing=bitwise,tp=ulp:8)")
        v.add_argument("--json-report", metavar="FILE", help="write the matrix here, updated after every base scenario")
        v.add_argument("--html-report", metavar="FILE", help="the matrix as a self-contained HTML page, updated likewise")
        v.add_argument("--nproc", type=int, default=None,
                       help="ranks in the world (default: 4, or more if a scenario needs)")
        check_switches(v, invariance=True)

    def plan(self, args: argparse.Namespace) -> Plan:
        from shardcheck.harness.controller.commands.invariance import AXES, check_axes, parse_expect

        check_world(args)
        axes = check_axes(args.axis) if args.axis else list(AXES)
        expect = parse_expect(args.expect)
        config = run_config(args, inplace=True)  # --no-inplace: the matrix checks no inputs either way
        scenarios = select(args)
        check_world(args, scenarios, axes)
        check_reports(args)
        settings = SimpleNamespace(axes=axes, expect=expect, nproc=args.nproc, timeout=args.timeout, quiet=args.quiet,
                                   json_report=args.json_report, html_report=args.html_report,
                                   suite=args.suite or args.scenario_file or "smoke")
        return Plan(config, tuple(scenarios), settings, args)

    def execute(self, plan: Plan) -> int:
        from shardcheck.harness.controller.commands.invariance import check_invariance
        from shardcheck.harness.controller.reports.invariance_report import InvarianceJson, InvarianceProgress, render

        config, s = plan.config, plan.settings
        report = json_report(s.json_report, s.suite, InvarianceJson)
        progress = InvarianceProgress(quiet=s.quiet)

        def on_base(result: Any) -> None:
            if report is not None:
                report.write(result)
            if s.html_report:
                from shardcheck.harness.controller.reports.html_report import render, write

                doc = {"shardcheck_command": "invariance", "suite": s.suite, **result.to_dict()}
                write(s.html_report, render(json.loads(json.dumps(doc, default=str))))

        try:
            with in_effect(config):
                result = check_invariance(list(plan.scenarios), config.target, axes=s.axes, expect=s.expect,
                                          nproc=s.nproc, timeout=s.timeout, backend=config.backend, on_run=progress,
                                          on_base=on_base, lockstep=config.lockstep)
        finally:
            progress.close()
        on_base(result)
        print(render(result), flush=True)
        return result.exit_code


@register
class Bisect(Command):
    name = "bisect"
    help = "find the first commit of a target's source where a suite's verdict changes"

    def add_options(self, b: argparse.ArgumentParser) -> None:
        history_options(b)
        b.add_argument("--good", required=True, metavar="REV", help="the older commit")
        b.add_argument("--bad", required=True, metavar="REV", help="the newer commit")
        b.add_argument("--suite", default="regressions", help="the suite to run at each commit (default: regressions)")
        b.add_argument("--scenario", action="append", default=[], metavar="NAME", help="only these scenarios")
        world_options(b, timeout_only=True)

    def plan(self, args: argparse.Namespace) -> Plan:
        repo, target = history_target(args, "bisect")
        scenarios = select(argparse.Namespace(scenario_file=None, suite=args.suite, scenario=args.scenario))
        # the checkout is each commit's exported tree (bisect.check_commit), never one of the user's
        config = run_config(args, target=target, sources={}, environ={})
        settings = SimpleNamespace(repo=repo, good=args.good, bad=args.bad, timeout=args.timeout)
        return Plan(config, tuple(scenarios), settings, args)

    def execute(self, plan: Plan) -> int:
        from shardcheck.harness.controller.commands.bisect import bisect
        from shardcheck.harness.controller.reports.run_report import TerminalReport, render_table

        config, s = plan.config, plan.settings

        def progress(step: Any) -> None:
            print(f"shardcheck bisect: {step.commit[:12]} {bisect_state(step)}", file=sys.stderr, flush=True)

        with in_effect(config):
            result = bisect(s.repo, s.good, s.bad, list(plan.scenarios), config.target, timeout=s.timeout,
                            reporter_factory=lambda: TerminalReport(quiet=True, out=open(os.devnull, "w")),
                            progress=progress, config=config)
        if result.first_changed is None:
            print(f"the verdict is the same at {result.old.commit[:12]} and {result.new.commit[:12]}: nothing to find")
            return EXIT_OK
        step = result.first_changed
        subject = subprocess.run(["git", "-C", s.repo, "log", "-1", "--format=%h %s", step.commit],
                                 capture_output=True, text=True).stdout.strip()
        print(f"first commit where the verdict changes: {step.commit}\n  {subject}")
        skipped = [s.commit[:12] for s in result.steps if s.signature is None]
        if skipped:
            print(f"  (skipped, could not be imported: {', '.join(skipped)})")
        print()
        print(render_table(step.verdicts, step.info))
        return EXIT_OK


def bisect_state(step: Any) -> str:
    """One commit's verdicts as bisect prints them: each failed scenario with its kinds, so a
    change of kinds between two commits (all failing at both) is seen."""
    if step.signature is None:
        return f"skipped ({step.why_skipped[:120]})"
    failed = [v for v in step.verdicts if v.status == "fail"]
    kinds = ", ".join(f"{v.scenario.name}: {'+'.join(v.kinds)}" for v in failed)
    return f"{len(failed)} of {len(step.verdicts)} scenarios failed" + (f" ({kinds})" if kinds else "")


@register
class Fuzz(Command):
    name = "fuzz"
    help = "search for a failing scenario with hypothesis, shrink it, write it"

    def add_options(self, f: argparse.ArgumentParser) -> None:
        world_options(f)
        search_options(f, tp="1,2,4", cp="1,2,4")
        f.add_argument("--nproc", type=int, default=None,
                       help="ranks in the world; only tp * cp dividing it are drawn (default: the least that "
                            "every tp * cp up to 4 fits in)")
        f.add_argument("--out", default=None, metavar="FILE",
                       help="where the minimal failing scenario is written (default: .shardcheck/fuzz-failure.json)")
        f.add_argument("--html-report", metavar="FILE",
                       help="the minimal failing scenario's page (lanes, layout map, error map), as run --html-report")
        check_switches(f)

    def plan(self, args: argparse.Namespace) -> Plan:
        from shardcheck.harness.controller.commands import fuzz

        check_world(args)
        config = run_config(args)
        settings = SimpleNamespace(
            max_examples=args.max_examples, seed=args.seed, tp=args.tp or fuzz.DEFAULT_TP,
            cp=args.cp or fuzz.DEFAULT_CP, sp=args.sp, layouts=args.layout, nproc=args.nproc,
            max_shrinks=args.max_shrinks,
            timeout=args.timeout, quiet=args.quiet, out=args.out or fuzz.DEFAULT_OUT, html_report=args.html_report,
            repeat=repeat_args(args))
        return Plan(config, None, settings, args)

    def execute(self, plan: Plan) -> int:
        from shardcheck.harness.controller.commands import fuzz
        from shardcheck.harness.controller.reports.fuzz_report import (Progress, header, repro_offer, summary,
                                                               write_minimal, write_unshrunk)

        config, s = plan.config, plan.settings
        progress = Progress(quiet=s.quiet)

        def on_start(found: fuzz.FuzzResult) -> None:  # the options are valid; the world is not up yet
            writable(s.out)
            if s.html_report:
                from shardcheck.harness.controller.reports.html_report import check_writable

                check_writable(s.html_report)
            if not s.quiet:
                print(header(found.target, found.seed, found.nproc, found.pairs, found.layouts), file=sys.stderr,
                      flush=True)

        with in_effect(config):
            try:
                result = fuzz.fuzz(
                    config.target, max_examples=s.max_examples, seed=s.seed, tp=s.tp, cp=s.cp, sp=s.sp, layouts=s.layouts,
                    nproc=s.nproc, max_shrinks=s.max_shrinks, timeout=s.timeout, lockstep=config.lockstep,
                    backend=config.backend, progress=progress, on_start=on_start, inplace=config.inplace,
                )
            except KeyboardInterrupt as exc:
                progress.close()
                found = write_unshrunk(progress, s.out, config.target, s.repeat)
                how = "terminated" if isinstance(exc, Terminated) else "interrupted"
                print(f"shardcheck: {how} after {progress.runs} scenarios{found}", file=sys.stderr)
                return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
            progress.close()
            minimal, written, replay = write_minimal(result, s.out, "run", s.repeat)
            if s.html_report:
                from shardcheck.harness.controller.reports.html_report import fuzz_page, write

                write(s.html_report, fuzz_page(result))
            print(summary(result, written, replay, minimal, repro_offer(config.target, minimal, written, s.repeat)),
                  flush=True)
        return result.exit_code


@register
class Simulate(Command):
    name = "simulate"
    help = ("check layouts far beyond this machine for would-be hangs: every rank in turn in one process, on "
            "torch's fake process group")

    def add_options(self, m: argparse.ArgumentParser) -> None:
        world_options(m, simulated=True)
        m.add_argument("--suite", default=None, help="simulate a named suite's scenarios (default: a search)")
        m.add_argument("--scenario", action="append", default=[], metavar="NAME",
                       help="only this scenario of the suite")
        m.add_argument("--scenario-file", metavar="FILE", help="simulate the scenarios in this JSON file")
        search_options(m, tp="1,2,4,8", cp="1,2,4,8,16,32")
        m.add_argument("--max-world", type=int, default=1024, metavar="N",
                       help="the largest tp * cp simulated (default: 1024)")
        m.add_argument("--out", default=None, metavar="FILE",
                       help="where the minimal failing scenario is written (default: .shardcheck/simulate-failure.json)")
        m.add_argument("--no-replay", action="store_true",
                       help="do not replay the minimal failing scenario on a real world, even when it fits")
        check_switches(m)

    def plan(self, args: argparse.Namespace) -> Plan:
        from shardcheck.harness.controller.worlds.limits import check_timeout

        check_timeout(args.timeout)  # the world is fake: no machine bounds, only --max-world
        if args.max_world < 1:
            raise BadInput(f"--max-world must be >= 1, got {args.max_world}")
        config = run_config(args)
        if args.scenario and not (args.suite or args.scenario_file):
            raise BadInput("--scenario names a scenario of --suite or --scenario-file (without them simulate "
                           "searches)")
        scenarios = select(args) if (args.suite or args.scenario_file) else None
        # simulate.main reads the command line itself: these are what it takes from it
        settings = SimpleNamespace(**{k: getattr(args, k) for k in (
            "timeout", "quiet", "max_examples", "seed", "tp", "cp", "sp", "layout", "max_shrinks", "max_world", "out",
            "no_replay")}, repeat=repeat_args(args))
        return Plan(config, tuple(scenarios) if scenarios is not None else None, settings, args)

    def execute(self, plan: Plan) -> int:
        from shardcheck.harness.controller.commands import simulate

        scenarios = list(plan.scenarios) if plan.scenarios is not None else None
        with in_effect(plan.config):
            return simulate.main(plan.args, scenarios, plan.settings.repeat)
