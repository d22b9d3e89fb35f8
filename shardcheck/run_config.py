"""One run's configuration: everything the target of a run needs besides the scenarios, built
once from what the user gave (a command line, the pytest plugin's options: the builder is
:func:`shardcheck.run_options.build`) and handed to the controller and, inside each ``run``
message, to every rank.

Nothing here travels through ``os.environ``: the user's documented variables
(``SHARDCHECK_TARGET``, ``SHARDCHECK_<NAME>_SRC``) are read as defaults by the builder, and that
is all. A command puts its configuration *in effect* (:func:`in_effect`) while it runs, so the
parts of the harness that take no configuration of their own (the invariance matrix, a fuzz
search, the simulated world, :func:`shardcheck.backend.requested_backend`) run with it; a
caller of the library that put none in effect gets :meth:`RunConfig.from_environment` (the
variables the harness once handed its ranks).

The data and the configuration in effect sit beside the wire (floor 3): the wire, the ranks, the
targets and the controller all take it from here. What needs a target is above it:
:meth:`shardcheck.targets.base.TargetConfig.of_run` (the target's config),
:meth:`shardcheck.harness.wire.Checks.of_run` (a rank's checks) and the builder. The module
imports neither torch nor a target: the command line builds its parser without them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from shardcheck.errors import BadInput

TARGET_ENV = "SHARDCHECK_TARGET"  # the plugin's default target (docs/ci.md)
DEFAULT_TARGET = "builtin"
# Deprecated (a run hands its ranks a RunConfig): the variables a command line once handed them,
# read for a caller of the library that put no configuration in effect.
BACKEND_ENV = "SHARDCHECK_BACKEND"
SRC_ENV = "SHARDCHECK_TARGET_SRC"
OPTS_ENV = "SHARDCHECK_TARGET_OPTS"
# the entry-point group of the targets loaded from a framework's checkout (targets/source.py)
SOURCES_GROUP = "shardcheck.sources"


def target_name(spec: str) -> str:
    """The registered name a spec starts with: ``slime`` of ``slime:policy_loss``."""
    return spec.partition(":")[0]


def source_names() -> list[str]:
    """The targets registered as loaded from a source checkout, by name (nothing is imported)."""
    return sorted({ep.name for ep in entry_points(group=SOURCES_GROUP)})


def source_env(name: str) -> str:
    """The variable naming ``name``'s checkout, handed to every rank: SHARDCHECK_NEMO_RL_SRC."""
    return f"SHARDCHECK_{name.upper()}_SRC"


def environment_target(environ: Mapping[str, str]) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """Deprecated: the target's checkout and options in ``environ``'s :data:`SRC_ENV` and
    :data:`OPTS_ENV` (a JSON list of [key, value] pairs); ValueError naming the variable."""
    raw = environ.get(OPTS_ENV)
    try:
        pairs = tuple((str(k), str(v)) for k, v in json.loads(raw)) if raw else ()
    except (ValueError, TypeError):
        raise ValueError(f"{OPTS_ENV} is not a JSON list of [key, value] pairs: {raw!r}") from None
    return environ.get(SRC_ENV) or None, pairs


@dataclass(frozen=True)
class RunConfig:
    """What a run's target is and how it is configured and checked, run-wide.

    ``target_src`` and ``target_options``: ``--target-src`` and ``--target-opt`` (the target's
    :class:`~shardcheck.targets.base.TargetConfig`). ``sources``: framework name -> checkout
    (``--slime-src DIR``, or ``SHARDCHECK_SLIME_SRC`` for the target's own framework); a target
    from a framework's checkout gets its own as its config's ``src``. ``backend``: the one asked
    for (auto, gloo, nccl, gloo-cuda), which decides what some targets can run. The switches:
    the lockstep check, the input check (``inplace``), the mask-leak step, coverage, the trace."""

    target: str = DEFAULT_TARGET
    target_src: str | None = None
    target_options: tuple[tuple[str, str], ...] = ()
    sources: tuple[tuple[str, str], ...] = ()
    backend: str = "auto"
    lockstep: bool = True
    inplace: bool = True
    mask_leak: bool = True
    coverage: bool = False
    trace: bool = False

    @classmethod
    def from_environment(cls, target: str = DEFAULT_TARGET, environ: Mapping[str, str] | None = None) -> RunConfig:
        """For a library caller that gave no configuration (``runner.run`` without ``config``):
        the variables a command line once handed its ranks (``SHARDCHECK_TARGET_SRC``,
        ``SHARDCHECK_TARGET_OPTS``, ``SHARDCHECK_BACKEND``) and the target's framework checkout
        (``SHARDCHECK_<NAME>_SRC``). Deprecated: give a RunConfig."""
        environ = os.environ if environ is None else environ
        try:
            src, options = environment_target(environ)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        head = target_name(target)
        own = environ.get(source_env(head)) if head in source_names() else None
        return cls(target, src, options, ((head, own),) if own else (), environ.get(BACKEND_ENV) or "auto")

    # -- what the parts of a run take from it -------------------------------------------------
    def checkout(self) -> str | None:
        """The target's checkout: ``--target-src``, or that of the target's own framework (the
        ``src`` of its :meth:`~shardcheck.targets.base.TargetConfig.of_run`)."""
        return self.target_src or dict(self.sources).get(target_name(self.target))

    def target_key(self) -> tuple:
        """What decides the target a spec names, for caches of resolved targets."""
        return (self.target, self.target_src, self.target_options, self.sources, self.backend)

    def for_target(self, spec: str) -> RunConfig:
        """The same configuration for ``spec`` (a test's own target in a plugin session)."""
        return self if spec == self.target else dataclasses.replace(self, target=spec)

    def with_source(self, src: str) -> RunConfig:
        """The same run on another checkout of the target (bisect: each commit's exported tree)."""
        return dataclasses.replace(self, target_src=src, sources=())

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    # -- on the wire ----------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> RunConfig:
        pairs = ("target_options", "sources")
        return cls(**{k: tuple(tuple(kv) for kv in v) if k in pairs else v for k, v in d.items()})


# -- the configuration in effect ------------------------------------------------------------------
_in_effect: list[RunConfig] = []  # innermost last; not a context variable: a run may use threads
_received: RunConfig | None = None  # a simulation process's, as its controller last sent it


@contextmanager
def in_effect(config: RunConfig) -> Iterator[RunConfig]:
    """``config`` is this process's run configuration while the block runs (nested: the innermost)."""
    _in_effect.append(config)
    try:
        yield config
    finally:
        _in_effect.pop()


def receive(config: RunConfig) -> None:
    """On a process its controller sends scenarios to without a configuration of their own (the
    simulated world): the configuration that came with the last scenario."""
    global _received
    _received = config


def active() -> RunConfig | None:
    """The configuration in effect in this process, if any."""
    return _in_effect[-1] if _in_effect else _received


def effective(spec: str) -> RunConfig:
    """The configuration a run of ``spec`` takes when its caller gave none: the one in effect,
    else :meth:`RunConfig.from_environment`."""
    config = active()
    return config.for_target(spec) if config is not None else RunConfig.from_environment(spec)
