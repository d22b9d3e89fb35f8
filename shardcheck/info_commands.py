"""The commands that write or show what is already known: repro (one failure as a standalone
script), report (a saved JSON report as the HTML page, a GitHub job summary or annotations),
suites and targets (the listings)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from shardcheck.command import EXIT_OK, Command, Plan, register, run_config, select, target_options
from shardcheck.errors import BadInput
from shardcheck.run_options import in_effect
from shardcheck.targets.source import source_names


@register
class Repro(Command):
    name = "repro"
    help = "write one failure as a standalone script (torch and the code under test, no shardcheck) its maintainers can run"

    def add_options(self, x: argparse.ArgumentParser) -> None:
        x.add_argument("--report", metavar="JSON", help="a JSON report (run --json-report) holding the failure")
        x.add_argument("--target", default=None, help="the target, as run takes it (without --report)")
        target_options(x)
        x.add_argument("--suite", default=None, help="the suite holding the scenario (default: smoke)")
        x.add_argument("--scenario-file", metavar="FILE", help="JSON file holding the scenario")
        x.add_argument("--scenario", required=True, metavar="NAME", help="the failing scenario")
        x.add_argument("--out", default=None, metavar="FILE", help="where the script goes (default: repro-NAME.py)")
        x.add_argument("--no-inplace", action="store_true",
                       help="the script does not check for inputs changed in place (as run --no-inplace; a report's "
                            "run with it: the same)")

    def plan(self, args: argparse.Namespace) -> Plan:
        from shardcheck.harness.controller.commands import repro

        if args.report:
            if args.target or args.suite or args.scenario_file:
                raise BadInput("--report names the target and scenario; give no --target, --suite or --scenario-file")
            failed = repro.from_report(args.report, args.scenario)
        else:
            if not args.target:
                raise BadInput("give --report JSON, or --target with the scenario's --suite or --scenario-file")
            [scenario] = select(argparse.Namespace(scenario_file=args.scenario_file, suite=args.suite,
                                                   scenario=[args.scenario]))
            failed = repro.Reported(args.target, scenario, None, True, {}, None)
        config = run_config(args, target=failed.spec)
        gave = args.target_src or args.target_opt or any(getattr(args, f"src_{n}", None) for n in source_names())
        if failed.config is not None and not gave:  # the target as the run configured it
            config = config.replace(target_src=failed.config.src, target_options=tuple(failed.config.options),
                                    sources=())
        name = "".join(c if c.isalnum() or c in "-_" else "_" for c in failed.scenario.name)
        out = args.out or f"repro-{name}.py"
        repro.refuse_existing(out)  # before any run (write refuses it too)
        settings = SimpleNamespace(failed=failed, out=out, inplace=failed.inplace and config.inplace)
        return Plan(config, (failed.scenario,), settings, args)

    def execute(self, plan: Plan) -> int:
        from shardcheck.harness.controller.commands import repro
        from shardcheck.targets import resolve
        from shardcheck.targets.base import TargetConfig

        config, s = plan.config, plan.settings
        failed, sc, spec = s.failed, s.failed.scenario, config.target
        target = resolve(spec, TargetConfig.of_run(config))
        repro.refuse_unless_writable(spec, target, sc)
        layouts = failed.layouts
        if repro.needs_layouts(target, sc) and not layouts:  # the framework lays the rows out: learn where
            layouts = _layouts_of_a_run(config, sc)
        repro.write(s.out, repro.script_text(spec, target, sc, failed.failure, os.path.basename(s.out), s.inplace,
                                             layouts))
        print(f"wrote {s.out}: python {s.out}  (exit 1: found, 0: not found, 3: gave up, the machine too slow)")
        return EXIT_OK


def _layouts_of_a_run(config: Any, scenario: Any) -> dict[int, dict[str, Any]]:
    """Run ``scenario`` once on a world of its size (gloo) for the rows the target's data path
    builds on each rank, as a report holds them."""
    from shardcheck.harness.controller.commands import runner
    from shardcheck.harness.controller.reports.run_report import SilentReport

    with in_effect(config):
        [verdict] = runner.run([scenario], config.target, reporter=SilentReport(), nproc=scenario.ranks,
                               backend="gloo", config=config).verdicts
    if not verdict.layouts:
        raise BadInput(f"scenario {scenario.name!r}: the run to learn the target's layout gave none "
                       f"({verdict.status}{': ' + verdict.failures[0].message if verdict.failures else ''})")
    return verdict.layouts


@register
class Report(Command):
    name = "report"
    help = ("render a saved JSON report: the HTML page --html-report writes, a GitHub job summary, "
            "GitHub annotations on the source lines its failures name")

    def add_options(self, h: argparse.ArgumentParser) -> None:
        h.add_argument("json", metavar="JSON", help="a JSON report (shardcheck run --json-report)")
        h.add_argument("--html", metavar="FILE", help="where the page is written")
        h.add_argument("--github-summary", metavar="FILE",
                       help="append the report as Markdown to this file (created if missing): "
                            "\"$GITHUB_STEP_SUMMARY\" in a GitHub Actions step")
        h.add_argument("--annotations", nargs="?", const="", default=None, metavar="ROOT",
                       help="print a GitHub ::error annotation for each source line a failure names in a file "
                            "under ROOT (default: the report's target checkout if inside this folder, else this "
                            "folder), at most 50")

    def plan(self, args: argparse.Namespace) -> Plan:
        import json

        from shardcheck.harness.controller.reports.html_report import check_writable
        from shardcheck.harness.controller.reports.report_file import SavedReport, check_report_path

        if args.html is None and args.github_summary is None and args.annotations is None:
            raise BadInput("give what to make of the report: --html FILE, --github-summary FILE or --annotations")
        try:
            with open(args.json, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise BadInput(f"JSON report {args.json!r} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadInput(f"JSON report {args.json!r} cannot be read: {exc}") from None
        if not isinstance(doc, dict):
            raise BadInput(f"{args.json!r} is not a shardcheck JSON report (not an object)")
        if args.github_summary is not None or args.annotations is not None:
            try:  # the page also draws an invariance matrix; these two read a run's verdicts
                SavedReport.from_dict(doc)
            except BadInput as exc:
                wanted = "--github-summary" if args.github_summary is not None else "--annotations"
                raise BadInput(f"{wanted} reads a run's report (shardcheck run --json-report): {args.json!r}: "
                               f"{exc}") from None
        if args.html is not None:
            check_writable(args.html)
        if args.github_summary is not None:
            check_report_path(args.github_summary, "--github-summary", "the GitHub summary")
        root = None
        if args.annotations is not None:
            from shardcheck.harness.controller.reports.github_summary import default_root

            root = Path(args.annotations).resolve() if args.annotations else default_root(doc)
            if not root.is_dir():
                raise BadInput(f"--annotations {args.annotations!r} is not a folder (the checkout the report's "
                               "source lines are in)")
        return Plan(settings=SimpleNamespace(doc=doc, html=args.html, github_summary=args.github_summary,
                                             annotations=root), args=args)

    def execute(self, plan: Plan) -> int:
        s = plan.settings
        if s.html is not None:
            from shardcheck.harness.controller.reports.html_report import render, write

            write(s.html, render(s.doc))
            print(f"wrote {s.html}")
        if s.github_summary is not None:
            from shardcheck.harness.controller.reports.github_summary import summary_markdown
            from shardcheck.harness.controller.reports.report_file import write_error

            text = summary_markdown(s.doc)
            try:  # appended: a job's steps each add their part to the one summary
                with open(s.github_summary, "a", encoding="utf-8") as f:
                    f.write(text)
            except OSError as exc:
                raise BadInput(write_error("--github-summary", s.github_summary, exc)) from None
            print(f"appended the summary to {s.github_summary}")
        if s.annotations is not None:
            from shardcheck.harness.controller.reports.github_summary import annotations

            for line in annotations(s.doc, s.annotations):
                print(line)
        return EXIT_OK


@register
class Suites(Command):
    name = "suites"
    help = "list the named suites"

    def execute(self, plan: Plan) -> int:
        from shardcheck.scenarios import SUITES, get_suite

        for name in sorted(SUITES):
            scenarios = get_suite(name)
            layouts = sorted({s.layout for s in scenarios})
            doc = (SUITES[name].__doc__ or "").strip().splitlines()
            print(f"{name:<14} {len(scenarios):>3} scenarios  layouts: {','.join(layouts)}  {doc[0] if doc else ''}")
        return EXIT_OK


@register
class Targets(Command):
    name = "targets"
    help = "list the registered targets"

    def execute(self, plan: Plan) -> int:
        from shardcheck.targets import available

        for t in available():
            print(f"{t['name']:<10} {t['description']}")
            for v in t["variants"]:
                print(f"  {t['name'] + ':' + v:<36} {t.get('variant_docs', {}).get(v, '')}")
            for key, doc in sorted(t.get("options", {}).items()):
                print(f"  {'--target-opt ' + key + '=...':<36} {doc}")
        return EXIT_OK
