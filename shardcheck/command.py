"""What every ``shardcheck`` command is, and what they share.

A command is a registered :class:`Command`: its name and help, the options it declares
(``add_options``), its :meth:`~Command.plan` (everything it will do, decided from the options
before anything starts: bad input is a :class:`BadInput` there, one line, exit 2) and its
:meth:`~Command.execute` of that plan. The option groups several commands take (the world, the
target, the scenarios, the check switches, a search) and the preamble of those that check a
target (:func:`run_config`, :func:`select`, :func:`check_world`, :func:`check_reports`) are here,
once. ``tests/test_command_options.py`` walks every command's every option through ``plan``: each
one changes the plan or is refused.
"""

from __future__ import annotations

import argparse
import os
from abc import ABC, abstractmethod
import signal
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

from shardcheck.errors import BadInput
from shardcheck.backend import BACKENDS
from shardcheck.targets.source import source_env, source_flag, source_names

if TYPE_CHECKING:
    from shardcheck.run_options import RunConfig

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_NOTHING_CHECKED = 5  # as pytest's "no tests collected": a green that checked nothing is not green
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be: the same clean-up, results kept, the table printed."""


@dataclass(frozen=True)
class Plan:
    """What a command will do, decided before anything starts: the run's configuration (None for
    a command that runs no target), the scenarios (None: none chosen up front) and the command's
    own settings, by name. ``args``: the parsed command line, for the parts of the harness that
    still read one (simulate); not part of what the plan is."""

    config: RunConfig | None = None
    scenarios: tuple[Any, ...] | None = None
    settings: SimpleNamespace = field(default_factory=SimpleNamespace)
    args: argparse.Namespace | None = field(default=None, compare=False, repr=False)


class Command(ABC):
    """One ``shardcheck`` command. ``accepted_without_effect``: options taken so that one command
    line carries from one command to another, which this command does not act on; each is said
    in its help (the option test holds them to that)."""

    name: ClassVar[str]
    help: ClassVar[str]
    accepted_without_effect: ClassVar[tuple[str, ...]] = ()

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        """Declare the command's options on its parser."""

    def plan(self, args: argparse.Namespace) -> Plan:
        """Everything the command will do, from ``args``; BadInput (one line) for what is wrong.
        Nothing starts here: no world, no file written."""
        return Plan(args=args)

    @abstractmethod
    def execute(self, plan: Plan) -> int:
        """Do what ``plan`` says; the exit status."""

    def run(self, args: argparse.Namespace) -> int:
        return self.execute(self.plan(args))


COMMANDS: dict[str, Command] = {}  # by name, in the order the help lists them


def register(cls: type[Command]) -> type[Command]:
    """Class decorator: the command is one of ``shardcheck``'s."""
    COMMANDS[cls.name] = cls()
    return cls


# -- option groups --------------------------------------------------------------------------------
def world_options(p: argparse.ArgumentParser, *, timeout_only: bool = False, simulated: bool = False) -> None:
    """The options of every command that checks a target on a world it starts (run, invariance,
    fuzz); ``timeout_only``: just --timeout (bisect, whose own options name the target);
    ``simulated``: no backend or world-size options (simulate's world is fake)."""
    from shardcheck.harness.controller.worlds.limits import MAX_TIMEOUT_S, timeout_seconds

    if not timeout_only:
        p.add_argument("--target", default="builtin",
                       help="NAME, NAME:VARIANT or module:callable (default: builtin)")
    p.add_argument("--timeout", type=timeout_seconds, default=60.0,
                   help="seconds a scenario may take before its ranks are declared hung (default: 60, "
                        f"at most {MAX_TIMEOUT_S:.0f}: a week)")
    if timeout_only:
        return
    if simulated:
        target_options(p)
        p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
        return
    p.add_argument("--allow-large-world", action="store_true",
                   help="start the world even past this machine's bounds: more ranks than 8 a core or than "
                        "its memory holds, or a scenario whose estimated memory does not fit")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="torch.distributed backend: nccl (one GPU per rank), gloo (CPU), gloo-cuda (gloo "
                        "collectives on CUDA tensors, ranks sharing the GPUs), or auto: nccl when every rank "
                        "gets a GPU, else gloo (default: auto)")
    target_options(p)
    p.add_argument("--no-lockstep", action="store_true",
                   help="trace collectives without the lockstep check; a hang then lasts until --timeout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")


INPLACE_HELP = ("do not check that the target leaves its inputs unchanged (a target known to write into its "
                "logits: its values, gradients and collectives are still checked; the report says so)")


def check_switches(p: argparse.ArgumentParser, *, invariance: bool = False) -> None:
    """The switches that turn a check off, the same on every command that checks a target
    (run, fuzz, simulate, invariance), so one command line carries from one to the other."""
    p.add_argument("--no-inplace", action="store_true",
                   help=("accepted as run takes it; invariance compares outputs only and never checks the "
                         "inputs") if invariance else INPLACE_HELP)


def target_options(p: argparse.ArgumentParser) -> None:
    """Where the target's code is and how it is configured."""
    for name in source_names():  # each framework target registers its own (shardcheck.sources)
        p.add_argument(source_flag(name), dest=f"src_{name}", metavar="DIR",
                       help=f"{name} source checkout for --target {name} (or set {source_env(name)})")
    p.add_argument("--target-src", metavar="DIR",
                   help="a source checkout for the target, whichever it is (its factory's config.src)")
    p.add_argument("--target-opt", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                   help="an option for the target (repeatable; `shardcheck targets` lists each target's)")


def search_options(p: argparse.ArgumentParser, *, tp: str, cp: str) -> None:
    """The options of a hypothesis search (fuzz, simulate); ``tp``, ``cp``: the default sizes,
    as the help says them."""
    p.add_argument("--max-examples", type=int, default=100, metavar="N",
                   help="scenarios hypothesis draws before it gives up looking (default: 100)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="the search's random seed, to repeat a run (default: random, and printed)")
    p.add_argument("--tp", type=int_list, default=None, metavar="LIST",
                   help=f"tensor-parallel sizes to draw from, e.g. 1,2 (default: {tp})")
    p.add_argument("--cp", type=int_list, default=None, metavar="LIST",
                   help=f"context-parallel sizes to draw from (default: {cp})")
    p.add_argument("--sp", type=int_list, default=None, metavar="LIST",
                   help="sequence-parallel sizes the sp layouts (ulysses, ring) are drawn at, e.g. 8,16,32,64 "
                        "(default: the cp sizes)")
    p.add_argument("--layout", type=name_list, default=None, metavar="LIST",
                   help="layouts to draw from, e.g. zigzag,allgather (default: all the target supports)")
    p.add_argument("--max-shrinks", type=int, default=300, metavar="N",
                   help="scenarios run while shrinking a failure, at most (default: 300)")


def history_options(p: argparse.ArgumentParser) -> None:
    """What a command over a framework's history (bisect, sweep) takes: the target and its clone
    (``--src-repo``, or ``--NAME-repo`` naming the target too) and the target's options."""
    from shardcheck.targets.source import source_names

    p.add_argument("--target", default=None,
                   help="a target that takes a source checkout, NAME or NAME:VARIANT, e.g. slime:policy_loss "
                        "(default: NAME of the --NAME-repo given)")
    repos = p.add_mutually_exclusive_group(required=True)
    repos.add_argument("--src-repo", dest="src_repo", metavar="GIT_DIR",
                       help="the target's git repository, a clone with its history (only read)")
    for name in source_names():
        repos.add_argument(f"--{name.replace('_', '-')}-repo", dest=f"repo_{name}", metavar="GIT_DIR",
                           help=f"--src-repo GIT_DIR, the target {name} unless --target says otherwise")
    p.add_argument("--target-opt", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                   help="an option for the target (repeatable)")


def history_target(args: argparse.Namespace, command: str) -> tuple[str, str]:
    """(the clone, the target) :func:`history_options` gave; BadInput where they disagree or the
    target is not named."""
    from shardcheck.targets.source import source_names

    repo, target = args.src_repo, args.target
    for name in source_names():
        if getattr(args, f"repo_{name}", None):
            repo = getattr(args, f"repo_{name}")
            if target is None:
                target = name
            elif target.partition(":")[0] != name:
                raise BadInput(f"--{name.replace('_', '-')}-repo names a {name} repository, but --target is "
                               f"{target!r}")
    if target is None:
        raise BadInput(f"{command} --src-repo needs --target NAME (or give --NAME-repo GIT_DIR)")
    return repo, target


def scenario_options(p: argparse.ArgumentParser) -> None:
    """What to check (run, invariance): a suite or a scenario file, maybe narrowed by name."""
    p.add_argument("--suite", default=None, help="a named suite (default: smoke, unless --scenario-file)")
    p.add_argument("--scenario", action="append", default=[], metavar="NAME",
                   help="only this scenario of the suite (repeatable)")
    p.add_argument("--scenario-file", metavar="FILE", help="JSON file with a scenario or a list of them")


def key_value(text: str) -> tuple[str, str]:
    from shardcheck.targets.base import parse_option

    try:
        return parse_option(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# -- the preamble of a command that checks a target --------------------------------------------------
def run_config(args: argparse.Namespace, **given: Any) -> RunConfig:
    """The run's configuration from a command line (``given``: what the command decides itself,
    as bisect's target): :func:`shardcheck.run_options.build`, the builder the pytest plugin uses too."""
    from shardcheck.run_options import build

    options = {
        "target": getattr(args, "target", None),
        "target_src": getattr(args, "target_src", None),
        "target_options": getattr(args, "target_opt", None) or (),
        "sources": {name: getattr(args, f"src_{name}", None) for name in source_names()},
        "backend": getattr(args, "backend", "auto"),
        "lockstep": not getattr(args, "no_lockstep", False),
        "inplace": not getattr(args, "no_inplace", False),
        "mask_leak": not getattr(args, "no_mask_leak", False),
        "coverage": getattr(args, "coverage", False),
        "trace": getattr(args, "trace", False),
    }
    return build(**(options | given))


def repeat_args(args: argparse.Namespace) -> list[str]:
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


def _reading(args: argparse.Namespace) -> Any:
    """A scenario file's reading, said on stderr now and then while it lasts (a large file takes
    seconds to read and validate before any world starts), unless --quiet."""
    if getattr(args, "quiet", False):
        return None
    import time

    from shardcheck.harness.controller.reports.run_report import visible

    path, t0 = visible(args.scenario_file), time.perf_counter()

    def say(done: int, read: int, size: int) -> None:
        if read < size:
            print(f"shardcheck: reading {path}: {done:,} scenarios, {read * 100 // max(size, 1)} % of the file ...",
                  file=sys.stderr, flush=True)
        else:
            print(f"shardcheck: read {path}: {done:,} scenarios in {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr, flush=True)

    return say


def select(args: argparse.Namespace) -> list:
    """The scenarios the command line names: a suite (default smoke) or a scenario file, narrowed
    by --scenario."""
    from shardcheck.scenarios import get_suite, load_scenario_file

    scenario_file = getattr(args, "scenario_file", None)
    if scenario_file and args.suite:
        raise BadInput("give --suite or --scenario-file, not both")
    scenarios = (load_scenario_file(scenario_file, progress=_reading(args)) if scenario_file
                 else get_suite(args.suite or "smoke"))
    if args.scenario:
        by_name = {s.name: s for s in scenarios}
        unknown = [n for n in args.scenario if n not in by_name]
        if unknown:
            raise BadInput(f"unknown scenario(s) {', '.join(map(repr, unknown))} "
                           f"in {scenario_file or args.suite or 'smoke'}")
        scenarios = [by_name[n] for n in dict.fromkeys(args.scenario)]
    return scenarios


def check_world(args: argparse.Namespace, scenarios: list | None = None, axes: list[str] | None = None) -> None:
    """The world's options, before anything is loaded; given the scenarios (run, or invariance
    along ``axes``), that the world they need fits this machine (see harness/controller/worlds/limits)."""
    from shardcheck.harness.controller.worlds import limits

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


def check_reports(args: argparse.Namespace) -> None:
    """The reports a command writes as it goes can be written: before any world starts."""
    if getattr(args, "html_report", None):
        from shardcheck.harness.controller.reports.html_report import check_writable

        check_writable(args.html_report)
    if getattr(args, "json_report", None):
        from shardcheck.harness.controller.reports.report_file import check_report_path

        check_report_path(args.json_report, "--json-report", "the JSON report")


def json_report(path: str | None, suite: str, kind: Any) -> Any:
    """The command's JSON report, written at once (its path checked by :func:`check_reports`)."""
    if not path:
        return None
    try:
        return kind(path, {"suite": suite})
    except OSError as exc:
        raise BadInput(f"cannot write the JSON report {path!r}: {exc.strerror}") from None


def writable(path: str) -> None:
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


def unwritten(*reports: Any) -> str | None:
    """The first report write that failed during the run, in one line (None: all written)."""
    return next((r.failed for r in reports if r is not None and getattr(r, "failed", None)), None)


def check_coverage(config: Any) -> None:
    """--coverage needs coverage.py and a target that names its framework's files."""
    import importlib.util

    from shardcheck.harness.controller.commands.runner import controller_target

    if importlib.util.find_spec("coverage") is None:
        raise BadInput("--coverage needs coverage.py: pip install 'shardcheck[coverage]' (or coverage)")
    target = controller_target(config.target, config)
    if not target.framework_files or target.src is None:
        raise BadInput(f"--coverage: target {config.target!r} names no framework source files (a target from a "
                       "framework's checkout sets src and framework_files)")


def repro_command(args: argparse.Namespace) -> str:
    """The `shardcheck repro` command for a failure of this run ({scenario}: its name)."""
    import shlex

    if args.json_report:
        where = ["--report", args.json_report]
    else:
        where = ["--target", args.target, *(["--scenario-file", args.scenario_file] if args.scenario_file
                                            else ["--suite", args.suite or "smoke"]), *repeat_args(args)]
    return "shardcheck repro " + " ".join(map(shlex.quote, where)).replace("{", "{{").replace("}", "}}") + \
        " --scenario {scenario}"
