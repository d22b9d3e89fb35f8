"""One run's configuration: everything the target of a run needs besides the scenarios, built
once from what the user gave (a command line, the pytest plugin's options) and handed to the
controller and, inside each ``run`` message, to every rank.

Nothing here travels through ``os.environ``: the user's documented variables
(``SHARDCHECK_TARGET``, ``SHARDCHECK_<NAME>_SRC``) are read as defaults by :meth:`RunConfig.build`,
and that is all. A command puts its configuration *in effect* (:func:`in_effect`) while it runs,
so the parts of the harness that take no configuration of their own (the invariance matrix, a
fuzz search, the simulated world) run with it; a caller of the library that put none in effect
gets :meth:`RunConfig.from_environment` (the variables the harness once handed its ranks).

The module imports neither torch nor a target: the command line builds its parser without them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardcheck.errors import BadInput

if TYPE_CHECKING:
    from shardcheck.harness.wire import Checks
    from shardcheck.targets.base import TargetConfig

TARGET_ENV = "SHARDCHECK_TARGET"  # the plugin's default target (docs/ci.md)
DEFAULT_TARGET = "builtin"


def target_name(spec: str) -> str:
    """The registered name a spec starts with: ``slime`` of ``slime:policy_loss``."""
    return spec.partition(":")[0]


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

    # -- the one builder --------------------------------------------------------------------
    @classmethod
    def build(cls, *, target: str | None = None, target_src: str | None = None,
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
        from shardcheck.harness.backend import BACKENDS
        from shardcheck.targets.source import load_framework, source_env, source_flag, source_names

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
        return cls(spec, target_src, options, tuple(sorted(checkouts.items())), backend, lockstep, inplace,
                   mask_leak, coverage, trace)

    @classmethod
    def from_environment(cls, target: str = DEFAULT_TARGET, environ: Mapping[str, str] | None = None) -> RunConfig:
        """For a library caller that gave no configuration (``runner.run`` without ``config``):
        the variables a command line once handed its ranks (``SHARDCHECK_TARGET_SRC``,
        ``SHARDCHECK_TARGET_OPTS``, ``SHARDCHECK_BACKEND``) and the target's framework checkout
        (``SHARDCHECK_<NAME>_SRC``). Deprecated: give a RunConfig."""
        from shardcheck.harness.backend import BACKEND_ENV
        from shardcheck.targets.base import TargetConfig
        from shardcheck.targets.source import source_env, source_names

        environ = os.environ if environ is None else environ
        try:
            config = TargetConfig.from_environment(environ)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        head = target_name(target)
        own = environ.get(source_env(head)) if head in source_names() else None
        return cls(target, config.src, config.options, ((head, own),) if own else (),
                   environ.get(BACKEND_ENV) or "auto")

    # -- what the parts of a run take from it -------------------------------------------------
    @property
    def target_config(self) -> TargetConfig:
        """The :class:`TargetConfig` the target is built with: ``--target-src``, or the checkout
        of the target's own framework, and the options."""
        from shardcheck.targets.base import TargetConfig

        src = self.target_src or dict(self.sources).get(target_name(self.target))
        return TargetConfig(src, self.target_options)

    def target_key(self) -> tuple:
        """What decides the target a spec names, for caches of resolved targets."""
        return (self.target, self.target_src, self.target_options, self.sources, self.backend)

    def checks(self, **overrides: Any) -> Checks:
        """The rank's checks of a scenario: this run's switches, with ``overrides`` (explain, outputs)."""
        from shardcheck.harness.wire import Checks

        return Checks(**{"trace_calls": self.trace, "inplace": self.inplace, "coverage": self.coverage,
                         "mask_leak": self.mask_leak, **overrides})

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


def _option(given: str | tuple[str, str], flag: str) -> tuple[str, str]:
    if isinstance(given, tuple):
        return given
    from shardcheck.targets.base import parse_option

    try:
        return parse_option(given)
    except ValueError as exc:
        raise BadInput(f"{flag}: {exc}") from None


# -- the configuration in effect ------------------------------------------------------------------
_in_effect: list[RunConfig] = []  # innermost last; not a context variable: a run may use threads
_received: RunConfig | None = None  # a simulation process's, as its controller last sent it


@contextmanager
def in_effect(config: RunConfig) -> Iterator[RunConfig]:
    """``config`` is this process's run configuration while the block runs (nested: the innermost)."""
    from shardcheck.harness.backend import BACKEND_ENV

    _in_effect.append(config)
    # Bridge, until harness/backend.requested_backend() reads the configuration in effect: the
    # framework targets (NeMo-RL, AReaL) ask it what the ranks compute on, in this process only.
    before = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = config.backend
    try:
        yield config
    finally:
        _in_effect.pop()
        if before is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = before


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
