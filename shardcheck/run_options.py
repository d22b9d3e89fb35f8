"""The run configuration's builder: one RunConfig from what the user gave (a command line, the
pytest plugin's options), checked. :func:`build` is the one builder, the CLI's
(:func:`shardcheck.command.run_config`) and the pytest plugin's alike.

The configuration itself, and the one in effect, are :mod:`shardcheck.run_config`
(beside the wire, which the ranks, the targets and the controller import); its names are
re-exported here for the command line's side. This module checks a checkout against its
framework (:mod:`shardcheck.targets.source`), so it sits above the targets. It imports no torch (the
command line builds its parser without it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from shardcheck.errors import BadInput
from shardcheck.backend import BACKENDS
from shardcheck.run_config import (DEFAULT_TARGET, TARGET_ENV, RunConfig, active, effective, in_effect,
                                           receive, target_name)
from shardcheck.targets.source import load_framework, source_env, source_flag, source_names

__all__ = ["DEFAULT_TARGET", "TARGET_ENV", "RunConfig", "active", "build", "effective", "in_effect", "receive",
           "target_name"]


def build(*, target: str | None = None, target_src: str | None = None,
          target_options: Iterable[str | tuple[str, str]] = (), sources: Mapping[str, str | None] | None = None,
          backend: str = "auto", lockstep: bool = True, inplace: bool = True, mask_leak: bool = True,
          coverage: bool = False, trace: bool = False, environ: Mapping[str, str] | None = None,
          flag_prefix: str = "--") -> RunConfig:
    """The configuration a user gave, checked: BadInput (one line, naming the flag) for a
    ``target_src`` that is not a folder, an option that is not KEY=VALUE, a framework's
    checkout that is not one or that the target does not use. ``target_options``: (KEY,
    VALUE) pairs or their ``KEY=VALUE`` text. ``environ`` (default: this process's) gives
    the documented defaults: ``SHARDCHECK_TARGET`` for a target not given, and
    ``SHARDCHECK_<NAME>_SRC`` for the checkout of the target's own framework.
    ``flag_prefix``: how the flags are spelled where they were given (``--shardcheck-`` in
    the pytest plugin)."""
    environ = os.environ if environ is None else environ
    spec = target or environ.get(TARGET_ENV) or DEFAULT_TARGET
    options = tuple(_option(o, f"{flag_prefix}target-opt") for o in target_options)
    if target_src is not None:
        if not os.path.isdir(target_src):
            raise BadInput(f"{flag_prefix}target-src {target_src!r} is not a directory")
        target_src = os.path.abspath(target_src)
    if backend not in BACKENDS:
        raise BadInput(f"{flag_prefix}backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    head = target_name(spec)
    checkouts: dict[str, str] = {}
    for name, folder in (sources or {}).items():
        if not folder:
            continue
        if name != head:  # it would configure nothing: refused, not dropped
            raise BadInput(f"{source_flag(name)} is the checkout of --target {name}, and the target is {spec!r} "
                           f"(a checkout for another target: --target-src DIR)")
        if target_src is not None:
            raise BadInput(f"give {source_flag(name)} or --target-src, not both (both name the target's checkout)")
        checkouts[name] = str(load_framework(name).source(folder))
    if not checkouts and target_src is None and head in source_names() and environ.get(source_env(head)):
        checkouts[head] = environ[source_env(head)]  # checked with the target, in its words
    return RunConfig(spec, target_src, options, tuple(sorted(checkouts.items())), backend, lockstep, inplace,
                     mask_leak, coverage, trace)


def _option(given: str | tuple[str, str], flag: str) -> tuple[str, str]:
    if isinstance(given, tuple):
        return given
    from shardcheck.targets.base import parse_option  # torch: imported when an option is given, not with the parser

    try:
        return parse_option(given)
    except ValueError as exc:
        raise BadInput(f"{flag}: {exc}") from None
