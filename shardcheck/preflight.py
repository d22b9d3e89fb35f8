"""What a command line is checked for before any world starts, so that a mistake is one line and
exit 2 and never a failure blamed on the code under test, nor a file of the user's overwritten:

- the registered checks (the ``shardcheck.checks`` entry points) and those ``SHARDCHECK_CHECKS``
  names load and are checks (every rank would fail on them);
- no output (a report, a page, a script, a scenario written) lands on an input (a scenario file,
  a report read) or on another output of the same command, links resolved.
"""

from __future__ import annotations

import argparse
import os

from shardcheck.errors import BadInput

# the commands that start a world (or a simulated one) and so run the checks
CHECKING = ("run", "fuzz", "invariance", "bisect", "simulate")
# argparse's destinations that name a file the command reads, and one it writes
INPUTS = (("scenario_file", "--scenario-file"), ("report", "--report"), ("json", "JSON"))
OUTPUTS = (("json_report", "--json-report"), ("html_report", "--html-report"), ("out", "--out"), ("html", "--html"))


def check(args: argparse.Namespace) -> None:
    """BadInput, one line, for the first thing wrong with ``args`` that is found before a world."""
    if args.command in CHECKING:
        plugin_checks()
    distinct_paths(args)


def plugin_checks() -> None:
    """The registered checks (the ``shardcheck.checks`` entry points: shardcheck's own found
    there, the plugins' loaded) and those ``SHARDCHECK_CHECKS`` names, loaded here as every rank
    would load them."""
    from shardcheck.harness.rank import pipeline

    try:
        pipeline.plugin_checks()
        pipeline.extra_checks()
    except pipeline.BadCheck as exc:
        raise BadInput(str(exc)) from None


def distinct_paths(args: argparse.Namespace) -> None:
    """No output on an input or on another output (compared after resolving links)."""
    def given(pairs: tuple[tuple[str, str], ...]) -> list[tuple[str, str, str]]:
        out = []
        for dest, flag in pairs:
            value = getattr(args, dest, None)
            if isinstance(value, str) and value:
                out.append((flag, value, os.path.realpath(value)))
        return out

    inputs, outputs = given(INPUTS), given(OUTPUTS)
    default = _default_out(args.command) if getattr(args, "out", None) is None else None
    if default is not None:  # where fuzz and simulate write when --out is not given: an output all the same
        outputs.append(("--out (default)", default, os.path.realpath(default)))
    for i, (flag, value, real) in enumerate(outputs):
        for in_flag, in_value, in_real in inputs:
            if real == in_real:
                raise BadInput(f"{flag} {value!r} is the {in_flag} {in_value!r}: the command would overwrite what it "
                               "reads (name another file)")
        for other_flag, other_value, other_real in outputs[:i]:
            if real == other_real:
                raise BadInput(f"{flag} {value!r} and {other_flag} {other_value!r} are one file: one output would "
                               "overwrite the other (name two files)")


def _default_out(command: str) -> str | None:
    """Where ``command`` writes its minimal failing scenario when no --out is given."""
    if command == "fuzz":
        from shardcheck.harness.controller.commands.fuzz import DEFAULT_OUT

        return DEFAULT_OUT
    if command == "simulate":
        from shardcheck.harness.controller.commands.simulate import DEFAULT_OUT

        return DEFAULT_OUT
    return None
