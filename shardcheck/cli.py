"""``shardcheck`` command line: run, invariance, fuzz, bisect, simulate, repro, report, suites, targets.

Exit status: 0 every scenario passed (or was skipped), 1 some scenario failed, 2 bad input or
configuration (one line on stderr naming the problem), 3 no scenario failed but some timed out
because the machine was too slow (its ranks waited for a CPU: no finding either way), 5 nothing was
checked (every scenario was skipped; ``--allow-all-skipped`` makes that 0), 130 interrupted
(Ctrl-C), 143 terminated (SIGTERM).

The commands are registered objects (:mod:`shardcheck.command`), each declaring its options:
:mod:`shardcheck.check_commands` (those that check a target) and :mod:`shardcheck.info_commands`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from shardcheck import check_commands, info_commands, preflight, sweep_command  # noqa: F401  (registers the commands)
from shardcheck.check_commands import bisect_state  # noqa: F401  (as before: tests and scripts import it here)
from shardcheck.command import (COMMANDS, EXIT_BAD_INPUT, EXIT_FAIL, EXIT_INTERRUPTED,  # noqa: F401
                                EXIT_NOTHING_CHECKED, EXIT_OK, EXIT_TERMINATED, INPLACE_HELP, Terminated)
from shardcheck.command import repeat_args as _target_args  # noqa: F401  (its name before the commands moved)
from shardcheck.errors import BadInput, ShardcheckError


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage wall
        raise BadInput(f"{message} (see shardcheck {self.prog.split()[-1]} --help)"
                       if " " in self.prog else f"{message} (see shardcheck --help)")


class _Version(argparse.Action):
    """``--version``: the contract's version is read only when asked (targets.base imports torch)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        from shardcheck import __version__
        from shardcheck.targets.base import CONTRACT_VERSION

        print(f"shardcheck {__version__} (Target contract {CONTRACT_VERSION})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """Every registered command's parser, its options as the command declares them."""
    p = _Parser(prog="shardcheck", description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--version", action=_Version, help="print shardcheck's version and its Target contract's, and exit")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    for command in COMMANDS.values():
        command.add_options(sub.add_parser(command.name, help=command.help))
    return p


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
        if args.command is None:
            build_parser().print_help()
            return EXIT_BAD_INPUT
        preflight.check(args)
        return COMMANDS[args.command].run(args)
    except (BadInput, ShardcheckError) as exc:
        print(f"shardcheck: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:
        how = "terminated" if isinstance(exc, Terminated) else "interrupted"
        print(f"shardcheck: {how} (results so far are in the JSON report, if one was asked for)",
              file=sys.stderr)
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
