"""``shardcheck`` command line: run, invariance, fuzz, bisect, simulate, repro, report, suites, targets.

Exit status: 0 every scenario passed (or was skipped), 1 some scenario failed, 2 bad input or
configuration (one line on stderr naming the problem), 3 no scenario failed but some timed out
because the machine was too slow (its ranks waited for a CPU: no finding either way), 5 nothing was
checked (every scenario was skipped; ``--allow-all-skipped`` makes that 0), 130 interrupted
(Ctrl-C), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import sys
from collections.abc import Sequence
from typing import Any

from shardcheck import preflight
from shardcheck.errors import BadInput, ShardcheckError
from shardcheck.harness.backend import BACKENDS
from shardcheck.targets.source import export_sources, source_env, source_flag, source_names

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_NOTHING_CHECKED = 5  # as pytest's "no tests collected": a green that checked nothing is not green
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be: the same clean-up, results kept, the table printed."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage wall
        raise BadInput(f"{message} (see shardcheck {self.prog.split()[-1]} --help)"
                       if " " in self.prog else f"{message} (see shardcheck --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="shardcheck", description=__doc__.splitlines()[0].replace("``", ""))
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    r = sub.add_parser("run", help="check a target against a suite or scenario file")
    _world_options(r)
    _scenario_options(r)
    r.add_argument("--json-report", metavar="FILE", help="write the report here, updated as results arrive")
    r.add_argument("--html-report", metavar="FILE",
                   help="write a self-contained HTML page here (lanes of each hang, the layout map), updated as "
                        "results arrive; built from the JSON report's data")
    r.add_argument("--nproc", type=int, default=None,
                   help="ranks in the world (default: the least every scenario fits in)")
    r.add_argument("--trace", action="store_true",
                   help="put every rank's collective calls (op, group, shapes, phase, site) in the JSON report")
    _check_switches(r)
    r.add_argument("--allow-all-skipped", action="store_true",
                   help="exit 0, not 5, when every scenario was skipped (nothing was checked)")
    r.add_argument("--no-mask-leak", action="store_true",
                   help="a training step is not run again with NaN at every masked position (mask_leak; "
                        "docs/training.md); its gradient and values are still checked")
    r.add_argument("--coverage", action="store_true",
                   help="say which of the framework's log-prob, data and loss functions ran and the line coverage "
                        "of those modules (coverage.py, only the framework's own files), in every report")
    v = sub.add_parser("invariance", help="check that each sample's outputs keep their bits however it is laid out")
    _world_options(v)
    _scenario_options(v)
    v.add_argument("--axis", type=_name_list, default=None, metavar="LIST",
                   help="axes to check (default: all): rerun,tp,cp,cp_mode,format,chunk,packing,order,split")
    v.add_argument("--expect", default=None, metavar="SPEC",
                   help="the contract, overriding the target's: AXIS=bitwise or AXIS=ulp:N, comma-separated "
                        "(e.g. packing=bitwise,tp=ulp:8)")
    v.add_argument("--json-report", metavar="FILE", help="write the matrix here, updated after every base scenario")
    v.add_argument("--html-report", metavar="FILE", help="the matrix as a self-contained HTML page, updated likewise")
    v.add_argument("--nproc", type=int, default=None, help="ranks in the world (default: 4, or more if a scenario needs)")
    _check_switches(v, invariance=True)
    b = sub.add_parser("bisect", help="find the first commit of a target's source where a suite's verdict changes")
    b.add_argument("--target", default=None,
                   help="a target that takes a source checkout, NAME or NAME:VARIANT, e.g. slime:policy_loss "
                        "(default: NAME of the --NAME-repo given)")
    repos = b.add_mutually_exclusive_group(required=True)
    repos.add_argument("--src-repo", dest="src_repo", metavar="GIT_DIR",
                       help="the target's git repository, a clone with its history (only read)")
    for name in source_names():
        repos.add_argument(f"--{name.replace('_', '-')}-repo", dest=f"repo_{name}", metavar="GIT_DIR",
                           help=f"--src-repo GIT_DIR, the target {name} unless --target says otherwise")
    b.add_argument("--target-opt", action="append", default=[], metavar="KEY=VALUE", type=_key_value,
                   help="an option for the target (repeatable)")
    b.add_argument("--good", required=True, metavar="REV", help="the older commit")
    b.add_argument("--bad", required=True, metavar="REV", help="the newer commit")
    b.add_argument("--suite", default="regressions", help="the suite to run at each commit (default: regressions)")
    b.add_argument("--scenario", action="append", default=[], metavar="NAME", help="only these scenarios")
    _world_options(b, timeout_only=True)
    f = sub.add_parser("fuzz", help="search for a failing scenario with hypothesis, shrink it, write it")
    _world_options(f)
    _search_options(f, tp="1,2,4", cp="1,2,4")
    f.add_argument("--nproc", type=int, default=None,
                   help="ranks in the world; only tp * cp dividing it are drawn (default: the least that "
                        "every tp * cp up to 4 fits in)")
    f.add_argument("--out", default=None, metavar="FILE",
                   help="where the minimal failing scenario is written (default: .shardcheck/fuzz-failure.json)")
    f.add_argument("--html-report", metavar="FILE",
                   help="the minimal failing scenario's page (lanes, layout map, error map), as run --html-report")
    _check_switches(f)
    m = sub.add_parser("simulate", help="check layouts far beyond this machine for would-be hangs: every rank "
                                        "in turn in one process, on torch's fake process group")
    _world_options(m, simulated=True)
    m.add_argument("--suite", default=None, help="simulate a named suite's scenarios (default: a search)")
    m.add_argument("--scenario", action="append", default=[], metavar="NAME", help="only this scenario of the suite")
    m.add_argument("--scenario-file", metavar="FILE", help="simulate the scenarios in this JSON file")
    _search_options(m, tp="1,2,4,8", cp="1,2,4,8,16,32")
    m.add_argument("--max-world", type=int, default=1024, metavar="N",
                   help="the largest tp * cp simulated (default: 1024)")
    m.add_argument("--out", default=None, metavar="FILE",
                   help="where the minimal failing scenario is written (default: .shardcheck/simulate-failure.json)")
    m.add_argument("--no-replay", action="store_true",
                   help="do not replay the minimal failing scenario on a real world, even when it fits")
    _check_switches(m)
    x = sub.add_parser("repro", help="write one failure as a standalone script (torch and the code under test, "
                                     "no shardcheck) its maintainers can run")
    x.add_argument("--report", metavar="JSON", help="a JSON report (run --json-report) holding the failure")
    x.add_argument("--target", default=None, help="the target, as run takes it (without --report)")
    _target_options(x)
    x.add_argument("--suite", default=None, help="the suite holding the scenario (default: smoke)")
    x.add_argument("--scenario-file", metavar="FILE", help="JSON file holding the scenario")
    x.add_argument("--scenario", required=True, metavar="NAME", help="the failing scenario")
    x.add_argument("--out", default=None, metavar="FILE", help="where the script goes (default: repro-NAME.py)")
    x.add_argument("--no-inplace", action="store_true",
                   help="the script does not check for inputs changed in place (as run --no-inplace; a report's "
                        "run with it: the same)")
    h = sub.add_parser("report", help="render a saved JSON report as the HTML page --html-report writes")
    h.add_argument("json", metavar="JSON", help="a JSON report (shardcheck run --json-report)")
    h.add_argument("--html", required=True, metavar="FILE", help="where the page is written")
    sub.add_parser("suites", help="list the named suites")
    sub.add_parser("targets", help="list the registered targets")
    return p


def _world_options(p: argparse.ArgumentParser, *, timeout_only: bool = False, simulated: bool = False) -> None:
    """The options of every command that checks a target on a world it starts (run, invariance,
    fuzz); ``timeout_only``: just --timeout (bisect, whose own options name the target);
    ``simulated``: no backend or world-size options (simulate's world is fake)."""
    from shardcheck.harness.controller.limits import MAX_TIMEOUT_S, timeout_seconds

    if not timeout_only:
        p.add_argument("--target", default="builtin",
                       help="NAME, NAME:VARIANT or module:callable (default: builtin)")
    p.add_argument("--timeout", type=timeout_seconds, default=60.0,
                   help="seconds a scenario may take before its ranks are declared hung (default: 60, "
                        f"at most {MAX_TIMEOUT_S:.0f}: a week)")
    if timeout_only:
        return
    if simulated:
        _target_options(p)
        p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
        return
    p.add_argument("--allow-large-world", action="store_true",
                   help="start the world even past this machine's bounds: more ranks than 8 a core or than "
                        "its memory holds, or a scenario whose estimated memory does not fit")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="torch.distributed backend: nccl (one GPU per rank), gloo (CPU), gloo-cuda (gloo "
                        "collectives on CUDA tensors, ranks sharing the GPUs), or auto: nccl when every rank "
                        "gets a GPU, else gloo (default: auto)")
    _target_options(p)
    p.add_argument("--no-lockstep", action="store_true",
                   help="trace collectives without the lockstep check; a hang then lasts until --timeout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")


INPLACE_HELP = ("do not check that the target leaves its inputs unchanged (a target known to write into its "
                "logits: its values, gradients and collectives are still checked; the report says so)")


def _check_switches(p: argparse.ArgumentParser, *, invariance: bool = False) -> None:
    """The switches that turn a check off, the same on every command that checks a target
    (run, fuzz, simulate, invariance), so one command line carries from one to the other."""
    p.add_argument("--no-inplace", action="store_true",
                   help=("accepted as run takes it; invariance compares outputs only and never checks the "
                         "inputs") if invariance else INPLACE_HELP)


def _target_options(p: argparse.ArgumentParser) -> None:
    """Where the target's code is and how it is configured."""
    for name in source_names():  # each framework target registers its own (shardcheck.sources)
        p.add_argument(source_flag(name), dest=f"src_{name}", metavar="DIR",
                       help=f"{name} source checkout for --target {name} (or set {source_env(name)})")
    p.add_argument("--target-src", metavar="DIR",
                   help="a source checkout for the target, whichever it is (its factory's config.src)")
    p.add_argument("--target-opt", action="append", default=[], metavar="KEY=VALUE", type=_key_value,
                   help="an option for the target (repeatable; `shardcheck targets` lists each target's)")


def _search_options(p: argparse.ArgumentParser, *, tp: str, cp: str) -> None:
    """The options of a hypothesis search (fuzz, simulate); ``tp``, ``cp``: the default sizes,
    as the help says them."""
    p.add_argument("--max-examples", type=int, default=100, metavar="N",
                   help="scenarios hypothesis draws before it gives up looking (default: 100)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="the search's random seed, to repeat a run (default: random, and printed)")
    p.add_argument("--tp", type=_int_list, default=None, metavar="LIST",
                   help=f"tensor-parallel sizes to draw from, e.g. 1,2 (default: {tp})")
    p.add_argument("--cp", type=_int_list, default=None, metavar="LIST",
                   help=f"context-parallel sizes to draw from (default: {cp})")
    p.add_argument("--layout", type=_name_list, default=None, metavar="LIST",
                   help="layouts to draw from, e.g. zigzag,allgather (default: all the target supports)")
    p.add_argument("--max-shrinks", type=int, default=300, metavar="N",
                   help="scenarios run while shrinking a failure, at most (default: 300)")


def _scenario_options(p: argparse.ArgumentParser) -> None:
    """What to check (run, invariance): a suite or a scenario file, maybe narrowed by name."""
    p.add_argument("--suite", default=None, help="a named suite (default: smoke, unless --scenario-file)")
    p.add_argument("--scenario", action="append", default=[], metavar="NAME",
                   help="only this scenario of the suite (repeatable)")
    p.add_argument("--scenario-file", metavar="FILE", help="JSON file with a scenario or a list of them")


def _use_target_config(args: argparse.Namespace) -> None:
    """Put what the user gave the target where controller and ranks read it: the environment
    (each rank is handed the controller's)."""
    from shardcheck.targets.base import OPTS_ENV, SRC_ENV, TargetConfig

    export_sources({name: getattr(args, f"src_{name}", None) for name in source_names()})
    src = getattr(args, "target_src", None)
    try:
        config = TargetConfig.given(src, tuple(getattr(args, "target_opt", None) or ()))
    except ValueError as exc:
        raise BadInput(f"--target-src {exc}") from None
    for key in (SRC_ENV, OPTS_ENV):  # the command line decides, not a value left in the shell
        os.environ.pop(key, None)
    os.environ.update(config.to_environment())
    from shardcheck.harness.backend import BACKEND_ENV

    os.environ.pop(BACKEND_ENV, None)
    if getattr(args, "backend", None):  # what a target can run may depend on where its ranks compute
        os.environ[BACKEND_ENV] = args.backend


def _target_args(args: argparse.Namespace) -> list[str]:
    """The target's options (and the checks switched off) as the user gave them, to repeat a run."""
    out: list[str] = ["--no-inplace"] if getattr(args, "no_inplace", False) else []
    for name in source_names():
        if getattr(args, f"src_{name}", None):
            out += [source_flag(name), getattr(args, f"src_{name}")]
    if getattr(args, "target_src", None):
        out += ["--target-src", args.target_src]
    for key, value in getattr(args, "target_opt", None) or ():
        out += ["--target-opt", f"{key}={value}"]
    return out


def _key_value(text: str) -> tuple[str, str]:
    from shardcheck.targets.base import parse_option

    try:
        return parse_option(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    own_handler = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if own_handler else None
    try:
        return _main(argv)
    finally:
        if own_handler:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None) -> int:
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:  # argparse would blame the top-level parser; name the command's help
            where = f"shardcheck {args.command} --help" if args.command else "shardcheck --help"
            raise BadInput(f"unrecognized arguments: {' '.join(extra)} (see {where})")
        preflight.check(args)
        if args.command == "run":
            return _run(args)
        if args.command == "fuzz":
            return _fuzz(args)
        if args.command == "invariance":
            return _invariance(args)
        if args.command == "bisect":
            return _bisect(args)
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "report":
            return _report(args)
        if args.command == "repro":
            return _repro(args)
        if args.command == "suites":
            return _suites()
        if args.command == "targets":
            return _targets()
        build_parser().print_help()
        return EXIT_BAD_INPUT
    except BadInput as exc:
        print(f"shardcheck: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ShardcheckError as exc:
        print(f"shardcheck: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:
        how = "terminated" if isinstance(exc, Terminated) else "interrupted"
        print(f"shardcheck: {how} (results so far are in the JSON report, if one was asked for)",
              file=sys.stderr)
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


def _reading(args: argparse.Namespace) -> Any:
    """A scenario file's reading, said on stderr now and then while it lasts (a large file takes
    seconds to read and validate before any world starts), unless --quiet."""
    if getattr(args, "quiet", False):
        return None
    import time

    from shardcheck.harness.controller.report import visible

    path, t0 = visible(args.scenario_file), time.perf_counter()

    def say(done: int, read: int, size: int) -> None:
        if read < size:
            print(f"shardcheck: reading {path}: {done:,} scenarios, {read * 100 // max(size, 1)} % of the file ...",
                  file=sys.stderr, flush=True)
        else:
            print(f"shardcheck: read {path}: {done:,} scenarios in {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr, flush=True)

    return say


def _select(args: argparse.Namespace) -> list:
    from shardcheck.scenarios import get_suite, load_scenario_file

    if args.scenario_file and args.suite:
        raise BadInput("give --suite or --scenario-file, not both")
    scenarios = (load_scenario_file(args.scenario_file, progress=_reading(args)) if args.scenario_file
                 else get_suite(args.suite or "smoke"))
    if args.scenario:
        by_name = {s.name: s for s in scenarios}
        unknown = [n for n in args.scenario if n not in by_name]
        if unknown:
            raise BadInput(f"unknown scenario(s) {', '.join(map(repr, unknown))} "
                           f"in {args.scenario_file or args.suite or 'smoke'}")
        scenarios = [by_name[n] for n in dict.fromkeys(args.scenario)]
    return scenarios


def _check_world_options(args: argparse.Namespace, scenarios: list | None = None,
                         axes: list[str] | None = None) -> None:
    """The world's options, before anything is loaded; given the scenarios (run, or invariance
    along ``axes``), that the world they need fits this machine (see harness/controller/limits)."""
    from shardcheck.harness.controller import limits

    if scenarios is not None:
        if axes is None:
            limits.check_run(scenarios, args.nproc, allow_large_world=args.allow_large_world)
        else:
            limits.check_invariance_world(scenarios, axes, args.nproc, allow_large_world=args.allow_large_world)
        return
    if args.nproc is not None and args.nproc < 1:
        raise BadInput(f"--nproc must be >= 1, got {args.nproc}")
    limits.check_timeout(args.timeout)
    limits.check_nproc(args.nproc, allow_large_world=args.allow_large_world)


def _unwritten(*reports: Any) -> str | None:
    """The first report write that failed during the run, in one line (None: all written)."""
    return next((r.failed for r in reports if r is not None and getattr(r, "failed", None)), None)


def _json_report(args: argparse.Namespace, kind: Any) -> Any:
    """The command's JSON report (written at once: an unwritable path fails before any world)."""
    if not args.json_report:
        return None
    from shardcheck.harness.controller.report_file import check_report_path

    check_report_path(args.json_report, "--json-report", "the JSON report")
    try:
        return kind(args.json_report, {"suite": args.suite or args.scenario_file or "smoke"})
    except OSError as exc:
        raise BadInput(f"cannot write the JSON report {args.json_report!r}: {exc.strerror}") from None


def _check_coverage(spec: str) -> None:
    """--coverage needs coverage.py and a target that names its framework's files."""
    import importlib.util

    from shardcheck.harness.controller.runner import controller_target

    if importlib.util.find_spec("coverage") is None:
        raise BadInput("--coverage needs coverage.py: pip install 'shardcheck[coverage]' (or coverage)")
    target = controller_target(spec)
    if not target.framework_files or target.src is None:
        raise BadInput(f"--coverage: target {spec!r} names no framework source files (a target from a "
                       "framework's checkout sets src and framework_files)")


def _run(args: argparse.Namespace) -> int:
    from shardcheck.harness.controller import runner
    from shardcheck.harness.controller.report import JsonReport, Reporters, TerminalReport

    _check_world_options(args)
    _use_target_config(args)
    scenarios = _select(args)
    _check_world_options(args, scenarios)
    if args.coverage:
        _check_coverage(args.target)
    from shardcheck.harness.controller.joined import launched_by_torchrun
    from shardcheck.harness.controller.report import SilentReport
    from shardcheck.harness.controller.worlds import world_for

    world, rank = None, 0
    if launched_by_torchrun():  # every rank runs this command: they join the launcher's world
        world = world_for(0, join=True, timeout=args.timeout, lockstep=not args.no_lockstep,
                          backend=args.backend).world
        rank = int(os.environ["RANK"])
        if rank != 0:  # one report: rank 0's (every rank reaches the same verdicts)
            args.json_report = None
    if args.html_report:
        from shardcheck.harness.controller.html_report import check_writable

        check_writable(args.html_report)  # before any world starts
    json_report = _json_report(args, JsonReport)
    html_report, scratch = None, None
    if args.html_report and rank == 0:
        from shardcheck.harness.controller.html_report import HtmlReport

        if json_report is None:  # the page is built from the JSON report's data: keep one aside
            import tempfile

            scratch = tempfile.TemporaryDirectory(prefix="shardcheck-report-")
            json_report = JsonReport(os.path.join(scratch.name, "report.json"), {"suite": args.suite or "smoke"})
        html_report = HtmlReport(args.html_report, json_report)
    terminal = SilentReport() if rank != 0 else TerminalReport(quiet=args.quiet)
    try:
        result = runner.run(scenarios, args.target, reporter=Reporters(terminal, json_report, html_report),
                            nproc=args.nproc,
                            timeout=args.timeout, lockstep=not args.no_lockstep, trace=args.trace,
                            backend=args.backend, inplace=not args.no_inplace, world=world,
                            coverage=args.coverage, repro=_repro_command(args), mask_leak=not args.no_mask_leak)
    finally:
        if world is not None:
            world.close()
        if scratch is not None:
            scratch.cleanup()
    unwritten = _unwritten(json_report if scratch is None else None, html_report)
    if unwritten:  # the verdicts are in the table above; the file could not take them
        print(f"shardcheck: error: {unwritten}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if result.verdicts and all(v.status == "skip" for v in result.verdicts) and not args.allow_all_skipped:
        print(f"shardcheck: nothing was checked: all {len(result.verdicts)} scenarios were skipped "
              "(--allow-all-skipped to exit 0)", file=sys.stderr)
        return EXIT_NOTHING_CHECKED
    return result.exit_code


def _invariance(args: argparse.Namespace) -> int:
    from shardcheck.harness.controller.invariance import AXES, check_axes, check_invariance, parse_expect
    from shardcheck.harness.controller.invariance_report import InvarianceJson, InvarianceProgress, render

    _check_world_options(args)
    axes = check_axes(args.axis) if args.axis else list(AXES)
    expect = parse_expect(args.expect)
    _use_target_config(args)
    scenarios = _select(args)
    _check_world_options(args, scenarios, axes)
    if args.html_report:
        from shardcheck.harness.controller.html_report import check_writable

        check_writable(args.html_report)  # before any world starts
    report = _json_report(args, InvarianceJson)
    progress = InvarianceProgress(quiet=args.quiet)

    def on_base(result: Any) -> None:
        if report is not None:
            report.write(result)
        if args.html_report:
            from shardcheck.harness.controller.html_report import render, write

            doc = {"shardcheck_command": "invariance", "suite": args.suite or args.scenario_file or "smoke",
                   **result.to_dict()}
            write(args.html_report, render(json.loads(json.dumps(doc, default=str))))

    try:
        result = check_invariance(scenarios, args.target, axes=axes, expect=expect, nproc=args.nproc,
                                  timeout=args.timeout, backend=args.backend, on_run=progress,
                                  on_base=on_base, lockstep=not args.no_lockstep)
    finally:
        progress.close()
    on_base(result)
    print(render(result), flush=True)
    return result.exit_code


def _writable(path: str) -> None:
    """Fail before the world starts, not after the search, when the answer cannot be written."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise BadInput(f"--out {path!r} is a directory")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"cannot create the folder of --out {path!r}: {exc.strerror}") from None
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise BadInput(f"cannot write --out {path!r}: permission denied")


def _fuzz(args: argparse.Namespace) -> int:
    from shardcheck.harness.controller import fuzz
    from shardcheck.harness.controller.fuzz_report import (Progress, header, repro_offer, summary, write_minimal,
                                                           write_unshrunk)

    _check_world_options(args)
    _use_target_config(args)
    out = args.out or fuzz.DEFAULT_OUT
    progress = Progress(quiet=args.quiet)

    def on_start(plan: fuzz.FuzzResult) -> None:  # the options are valid; the world is not up yet
        _writable(out)
        if args.html_report:
            from shardcheck.harness.controller.html_report import check_writable

            check_writable(args.html_report)
        if not args.quiet:
            print(header(plan.target, plan.seed, plan.nproc, plan.pairs, plan.layouts), file=sys.stderr, flush=True)

    try:
        result = fuzz.fuzz(
            args.target, max_examples=args.max_examples, seed=args.seed,
            tp=args.tp or fuzz.DEFAULT_TP, cp=args.cp or fuzz.DEFAULT_CP, layouts=args.layout,
            nproc=args.nproc, max_shrinks=args.max_shrinks, timeout=args.timeout,
            lockstep=not args.no_lockstep, backend=args.backend, progress=progress, on_start=on_start,
            inplace=not args.no_inplace,
        )
    except KeyboardInterrupt as exc:
        progress.close()
        found = write_unshrunk(progress, out, args.target, _target_args(args))
        how = "terminated" if isinstance(exc, Terminated) else "interrupted"
        print(f"shardcheck: {how} after {progress.runs} scenarios{found}", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
    progress.close()
    minimal, written, replay = write_minimal(result, out, "run", _target_args(args))
    if args.html_report:
        from shardcheck.harness.controller.html_report import fuzz_page, write

        write(args.html_report, fuzz_page(result))
    print(summary(result, written, replay, minimal, repro_offer(args.target, minimal, written, _target_args(args))),
          flush=True)
    return result.exit_code


def _simulate(args: argparse.Namespace) -> int:
    from shardcheck.harness.controller import simulate

    from shardcheck.harness.controller.limits import check_timeout

    check_timeout(args.timeout)  # the world is fake: no machine bounds, only --max-world
    if args.max_world < 1:
        raise BadInput(f"--max-world must be >= 1, got {args.max_world}")
    _use_target_config(args)
    scenarios = _select(args) if (args.suite or args.scenario_file) else None
    return simulate.main(args, scenarios, _target_args(args))


def _repro_command(args: argparse.Namespace) -> str:
    """The `shardcheck repro` command for a failure of this run ({scenario}: its name)."""
    import shlex

    if args.json_report:
        where = ["--report", args.json_report]
    else:
        where = ["--target", args.target, *(["--scenario-file", args.scenario_file] if args.scenario_file
                                            else ["--suite", args.suite or "smoke"]), *_target_args(args)]
    return "shardcheck repro " + " ".join(map(shlex.quote, where)).replace("{", "{{").replace("}", "}}") + \
        " --scenario {scenario}"


def _layouts_of_a_run(spec: str, scenario: Any) -> dict[int, dict[str, Any]]:
    """Run ``scenario`` once on a world of its size (gloo) for the rows the target's data path
    builds on each rank, as a report holds them."""
    from shardcheck.harness.controller import runner
    from shardcheck.harness.controller.report import SilentReport

    [verdict] = runner.run([scenario], spec, reporter=SilentReport(), nproc=scenario.ranks).verdicts
    if not verdict.layouts:
        raise BadInput(f"scenario {scenario.name!r}: the run to learn the target's layout gave none "
                       f"({verdict.status}{': ' + verdict.failures[0].message if verdict.failures else ''})")
    return verdict.layouts


def _repro(args: argparse.Namespace) -> int:
    from shardcheck.harness.controller import repro
    from shardcheck.targets import resolve

    if args.report:
        if args.target or args.suite or args.scenario_file:
            raise BadInput("--report names the target and scenario; give no --target, --suite or --scenario-file")
        failed = repro.from_report(args.report, args.scenario)
    else:
        if not args.target:
            raise BadInput("give --report JSON, or --target with the scenario's --suite or --scenario-file")
        args.scenario = [args.scenario]
        [scenario] = _select(args)
        failed = repro.Reported(args.target, scenario, None, True, {}, None)
    _use_target_config(args)
    gave = args.target_src or args.target_opt or any(getattr(args, f"src_{n}", None) for n in source_names())
    if failed.config is not None and not gave:  # the target as the run configured it
        os.environ.update(failed.config.to_environment())
    sc, spec = failed.scenario, failed.spec
    out = args.out or f"repro-{''.join(c if c.isalnum() or c in '-_' else '_' for c in sc.name)}.py"
    repro.refuse_existing(out)  # before any run (write refuses it too)
    target = resolve(spec)
    repro.refuse_unless_writable(spec, target, sc)
    layouts = failed.layouts
    if repro.needs_layouts(target, sc) and not layouts:  # the framework lays the rows out: learn where
        layouts = _layouts_of_a_run(spec, sc)
    repro.write(out, repro.script_text(spec, target, sc, failed.failure, os.path.basename(out),
                                       failed.inplace and not args.no_inplace, layouts))
    print(f"wrote {out}: python {out}  (exit 1: found, 0: not found, 3: gave up, the machine too slow)")
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    import json

    from shardcheck.harness.controller.html_report import check_writable, render, write

    try:
        with open(args.json, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise BadInput(f"JSON report {args.json!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"JSON report {args.json!r} cannot be read: {exc}") from None
    if not isinstance(doc, dict):
        raise BadInput(f"{args.json!r} is not a shardcheck JSON report (not an object)")
    check_writable(args.html)
    write(args.html, render(doc))
    print(f"wrote {args.html}")
    return EXIT_OK


def _bisect(args: argparse.Namespace) -> int:
    from shardcheck.harness.controller.bisect import bisect
    from shardcheck.harness.controller.report import TerminalReport, render_table

    from shardcheck.targets.base import OPTS_ENV, TargetConfig

    for name in source_names():
        if getattr(args, f"repo_{name}", None):
            args.src_repo = getattr(args, f"repo_{name}")
            if args.target is None:
                args.target = name
            elif args.target.partition(":")[0] != name:
                raise BadInput(f"--{name.replace('_', '-')}-repo names a {name} repository, but --target is "
                               f"{args.target!r}")
    if args.target is None:
        raise BadInput("bisect --src-repo needs --target NAME (or give --NAME-repo GIT_DIR)")
    args.scenario_file = None
    scenarios = _select(args)
    os.environ.pop(OPTS_ENV, None)
    os.environ.update(TargetConfig(None, tuple(args.target_opt)).to_environment())

    def progress(step) -> None:
        print(f"shardcheck bisect: {step.commit[:12]} {bisect_state(step)}", file=sys.stderr, flush=True)

    result = bisect(args.src_repo, args.good, args.bad, scenarios, args.target, timeout=args.timeout,
                    reporter_factory=lambda: TerminalReport(quiet=True, out=open(os.devnull, "w")),
                    progress=progress)
    if result.first_changed is None:
        print(f"the verdict is the same at {result.old.commit[:12]} and {result.new.commit[:12]}: nothing to find")
        return EXIT_OK
    step = result.first_changed
    subject = subprocess.run(["git", "-C", args.src_repo, "log", "-1", "--format=%h %s", step.commit],
                             capture_output=True, text=True).stdout.strip()
    print(f"first commit where the verdict changes: {step.commit}\n  {subject}")
    skipped = [s.commit[:12] for s in result.steps if s.signature is None]
    if skipped:
        print(f"  (skipped, could not be imported: {', '.join(skipped)})")
    print()
    print(render_table(step.verdicts, step.info))
    return EXIT_OK


def bisect_state(step) -> str:
    """One commit's verdicts as bisect prints them: each failed scenario with its kinds, so a
    change of kinds between two commits (all failing at both) is seen."""
    if step.signature is None:
        return f"skipped ({step.why_skipped[:120]})"
    failed = [v for v in step.verdicts if v.status == "fail"]
    kinds = ", ".join(f"{v.scenario.name}: {'+'.join(v.kinds)}" for v in failed)
    return f"{len(failed)} of {len(step.verdicts)} scenarios failed" + (f" ({kinds})" if kinds else "")


def _suites() -> int:
    from shardcheck.scenarios import SUITES, get_suite

    for name in sorted(SUITES):
        scenarios = get_suite(name)
        layouts = sorted({s.layout for s in scenarios})
        doc = (SUITES[name].__doc__ or "").strip().splitlines()
        print(f"{name:<14} {len(scenarios):>3} scenarios  layouts: {','.join(layouts)}  {doc[0] if doc else ''}")
    return EXIT_OK


def _targets() -> int:
    from shardcheck.targets import available

    for t in available():
        print(f"{t['name']:<10} {t['description']}")
        for v in t["variants"]:
            print(f"  {t['name'] + ':' + v:<36} {t.get('variant_docs', {}).get(v, '')}")
        for key, doc in sorted(t.get("options", {}).items()):
            print(f"  {'--target-opt ' + key + '=...':<36} {doc}")
    return EXIT_OK
