"""``shardcheck sweep``: a target's whole history checked, the timeline of when each failure came
and went (docs/sweep.md; the engine: harness/controller/commands/sweep.py)."""

from __future__ import annotations

import argparse
import fnmatch
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from shardcheck.command import (EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, Command, Plan, history_options,
                                history_target, register, run_config, select, world_options)
from shardcheck.errors import BadInput
from shardcheck.run_options import in_effect


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of jobs, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--jobs must be >= 1, got {n}")
    return n


@register
class Sweep(Command):
    name = "sweep"
    help = "check every commit of a target's source that touches the files it reaches: when each failure came and went"

    def add_options(self, b: argparse.ArgumentParser) -> None:
        history_options(b)
        b.add_argument("--since", metavar="DATE", help="only commits since DATE (git's --since: 2025-06-01)")
        b.add_argument("--range", dest="revisions", metavar="A..B",
                       help="only the commits of A..B, or up to B (default: every commit up to HEAD); with --since, "
                            "those of them since DATE")
        b.add_argument("--suite", default=None, help="the suite to run at each commit (default: regressions)")
        b.add_argument("--scenario-file", metavar="FILE", help="JSON file with the scenarios to run at each commit")
        b.add_argument("--scenario", action="append", default=[], metavar="NAME", help="only these scenarios")
        b.add_argument("--file", action="append", default=[], metavar="PATH", dest="files",
                       help="select the commits touching PATH (repeatable; default: the files the target names "
                            "as its framework's at the newest commit)")
        b.add_argument("--cache", metavar="DIR",
                       help="where verdicts are kept between sweeps (default: the platform's cache directory)")
        b.add_argument("--jobs", type=_jobs, default=1,
                       help="commits checked at once, each on a world of its own (default: 1; a world's ranks "
                            "take a core each)")
        b.add_argument("--tags", nargs="?", const="*", default=None, metavar="PATTERN",
                       help="mark release tags (those matching PATTERN, default all) and say which carry each "
                            "interval")
        b.add_argument("--json", metavar="FILE", help="write every commit's cells and the intervals here")
        b.add_argument("--html", metavar="FILE", help="write the timeline as a self-contained HTML page here")
        world_options(b, timeout_only=True)

    def plan(self, args: argparse.Namespace) -> Plan:
        repo, target = history_target(args, "sweep")
        from shardcheck.harness.controller.commands.sweep import check_repository
        from shardcheck.harness.controller.commands.sweep_cache import default_cache_dir

        check_repository(repo)
        if args.suite is None and args.scenario_file is None:
            args.suite = "regressions"
        scenarios = select(args)
        for path in (args.json, args.html):
            if path:
                from shardcheck.harness.controller.reports.html_report import check_writable

                check_writable(path)
        config = run_config(args, target=target, sources={}, environ={})
        if config.target_src is not None:
            raise BadInput("sweep exports each commit of --src-repo itself: --target-src has no place here")
        settings = SimpleNamespace(repo=repo, since=args.since, revisions=args.revisions, files=list(args.files),
                                   cache=Path(args.cache) if args.cache else default_cache_dir(), jobs=args.jobs,
                                   tags=args.tags, json=args.json, html=args.html, timeout=args.timeout,
                                   suite=args.suite, scenario_file=args.scenario_file)
        return Plan(config, tuple(scenarios), settings, args)

    def execute(self, plan: Plan) -> int:
        from shardcheck.harness.controller.commands import sweep as engine
        from shardcheck.harness.controller.commands.sweep_cache import SweepCache, cache_configuration
        from shardcheck.harness.controller.reports import sweep_report
        from shardcheck.harness.controller.reports.sweep_timeline import timeline

        config, s = plan.config, plan.settings
        assert config is not None and plan.scenarios is not None
        scenarios = list(plan.scenarios)
        with in_effect(config), tempfile.TemporaryDirectory(prefix="shardcheck-sweep-") as scratch:
            files = engine.with_earlier_names(s.repo, s.revisions,
                                              s.files or engine.reached_files(s.repo, config, s.revisions, Path(scratch)))
            tags = engine.tags_by_commit(s.repo)  # read once: the commits' marks and the releases
            commits = engine.select_commits(s.repo, files, since=s.since, revisions=s.revisions, tags=tags)
            cache = SweepCache(s.cache, cache_configuration(config))
            print(f"shardcheck sweep: {config.target}: {len(commits)} commits touch {len(files)} files "
                  f"({', '.join(files[:3])}{', ...' if len(files) > 3 else ''}); cache {cache.dir}",
                  file=sys.stderr, flush=True)

            done = [0]

            def progress(i: int, commit: Any, cells: dict[str, Any], ran: int) -> None:
                done[0] += 1
                failed = sum(c.state == "fail" for c in cells.values())
                cannot = sum(c.state == "cannot run" for c in cells.values())
                state = f"{failed} failed" + (f", {cannot} cannot run" if cannot else "")
                source = f"{ran} run" if ran else "from the cache"
                print(f"shardcheck sweep: [{done[0]}/{len(commits)}] {commit.short} {commit.date[:10]} {state} "
                      f"({source})", file=sys.stderr, flush=True)

            result = engine.run_sweep(Path(s.repo), commits, scenarios, config, cache, Path(scratch),
                                      jobs=s.jobs, timeout=s.timeout, progress=progress)
        intervals = timeline(result)
        if s.tags is not None:
            releases = {sha: [t for t in names if fnmatch.fnmatchcase(t, s.tags)] for sha, names in tags.items()}
            engine.mark_releases(s.repo, intervals, {sha: names for sha, names in releases.items() if names})
        context = sweep_report.SweepContext(config.target, tuple(f"{k}={v}" for k, v in config.target_options),
                                            str(s.repo), s.suite, s.scenario_file)
        # the files first: a terminal that goes away (a pipe closed) must not lose them
        if s.json:
            Path(s.json).write_text(sweep_report.dumps(sweep_report.document(result, intervals, context)))
        if s.html:
            Path(s.html).write_text(sweep_report.page(result, intervals, context))
        print(sweep_report.terminal(result, intervals), flush=True)
        if result.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_FAIL if any(iv.open for iv in intervals) else EXIT_OK
