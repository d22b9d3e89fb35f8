"""A scenario's life on a rank, and the checks that hook into it.

The life, in order (the names of the points a check may hook into):

- ``inputs_made``: the rank's logits, tokens and batch are built, the target not yet called;
- ``forward``: a context around ``target.compute(inputs)``;
- ``after_forward``: the outputs are there; a check may end the life here (``life.stop()``:
  nothing left to read or to differentiate);
- ``before_backward``: the gradients the harness feeds into the outputs are made (``life.fed``);
- ``backward``: a context around the backward;
- ``after_backward``: the logits' gradient is there (``life.grad``);
- ``result``: the last word, e.g. what goes back besides the findings (``life.produced``).

A target whose loss is a training step's (``loss_form = "step"``, harness/rank/life/training_step.py)
lives each micro-batch up to ``after_forward`` (megatron-core's schedule runs the backward), and
the step as a whole reaches one point of its own:

- ``after_step``: the gradient the optimizer sees is there (``life.grad``, the stand-in model's
  ``main_grad`` after DDP; ``life.layout`` its rows, ``life.data`` the global batch;
  ``life.logged_loss`` the loss the framework logs, where its target aggregates one).

A check is a :class:`Check` in a module of its own that implements the points it needs and adds
what it finds to ``life.found`` (``life.errors`` for the worst error per field); the rank's
core (``main.RankRunner``) calls every check at every point and knows nothing of what they look
for. Checks register in the ``shardcheck.checks`` entry-point group, the built-ins too, whose
order is declared in one place (:mod:`shardcheck.harness.rank.checks`); a plugin's package
registers its own there, and a test or an unpackaged check may still be named in
``SHARDCHECK_CHECKS`` (``module:Class``, comma-separated; every rank reads the controller's
``SHARDCHECK_*`` settings), which adds it after the registered ones.

The life is framed by points of its own, each given the :class:`Frame` (the scenario's number,
the world's lockstep, what was found so far): ``begin`` (before anything of the scenario, so a
collective issued anywhere, in a check's own hook too, is seen), ``finish`` (the life went
through), ``claim`` (an exception a check reports itself: it returns True), ``abandon`` (the rank
gives the scenario up, after a raise) and ``end`` (always, last). The collective trace and the
lockstep check use them (``lockstep.CollectiveTrace``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardcheck.harness.wire import Checks, Failure

GROUP = "shardcheck.checks"

# The built-ins' entry-point names, in the order they are called (a plugin's come after them):
# collective_trace first: it frames the scenario (every collective from its begin on is traced);
# inputs_unchanged next: a write into the inputs is seen before anything reads them again;
# output_form before the comparison: it ends the life where the outputs cannot be read.
BUILT_IN: tuple[str, ...] = ("collective_trace", "inputs_unchanged", "output_form", "reference_comparison",
                             "output_capture")

EXTRA_ENV = "SHARDCHECK_CHECKS"
POINTS = ("inputs_made", "forward", "after_forward", "before_backward", "backward", "after_backward", "result",
          "after_step")


@dataclass
class Life:
    """What a scenario's life has made so far on one rank: what checks read and add to."""

    rank: int
    checks: Checks  # what the controller asked for this scenario
    scenario: Any  # the Scenario
    data: Any  # its ScenarioData
    layout: Any  # the rank's RankLayout (the framework's, where it owns the layout)
    target: Any
    inputs: Any  # the RankInputs handed to target.compute
    leaf: Any  # the logits' leaf tensor, whose .grad is the gradient checked
    form: str  # "weighted" (the harness builds the loss) or "policy" (the target returns its own)
    definitions: Any  # the target's Definitions (the reference follows them)
    owed: Any  # the layout of what the rank owes: its log-probs
    owed_entropy: Any  # ... and its entropy, where that differs
    reference_device: Any = None  # where the float64 reference runs (the rank's GPU under nccl)
    outputs: Any = None  # what target.compute returned
    entropy: Any = None  # the outputs' entropy where the scenario asks for it, else None
    fed: list[Any] = field(default_factory=list)  # (output, gradient) fed to the backward
    grad: Any = None  # d loss / d logits, after the backward
    found: list[Failure] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)
    produced: dict[str, Any] | None = None
    stopped: bool = False
    step: dict[str, Any] | None = None  # the training step's sizes (micro_batches, dp_size, cp_size, tp_size)
    logged_loss: Any = None  # the loss the framework logs for the step, where its target aggregates one

    def stop(self) -> None:
        """Nothing more can be read or differentiated: the later points are not reached."""
        self.stopped = True

    def add(self, checked: tuple[list[Failure], dict[str, float]]) -> None:
        """A comparison's (failures, worst error per field)."""
        failures, worst = checked
        self.found += failures
        self.errors.update(worst)


@dataclass
class Frame:
    """What frames one scenario on a rank, and what it found: checks read and add to it."""

    rank: int
    seq: int
    name: str
    checks: Checks
    lockstep: Any  # the world's Lockstep (None: --no-lockstep)
    found: list[Failure]
    errors: dict[str, float] = field(default_factory=dict)  # worst error per field, as comparisons add them
    notes: list[dict[str, Any]] = field(default_factory=list)  # a peer's report of why this rank stopped
    calls: Any = None  # the collective trace, once it ended
    desync: bool = False  # the backend itself failed: the world must restart


def raise_payload(exc: BaseException) -> dict[str, Any]:
    """A raise as plain data, ``where`` the innermost frame outside torch and shardcheck's
    pass-through wrappers: the call site in the target."""
    import torch

    from shardcheck.harness import wire
    from shardcheck.targets import passthrough

    return wire.error_payload(exc, skip_prefixes=(os.path.dirname(torch.__file__), passthrough.__file__))


class Stop(RuntimeError):
    """Raised on purpose by a check to end the life where it stands (from inside the code under
    test, or from a collective a hook issues): the check that raised it claims it."""


class CheckRaised(RuntimeError):
    """A check's own hook raised: the harness's (or its plugin's) failure, never the target's."""

    def __init__(self, check: Check, point: str, exc: BaseException) -> None:
        cls = type(check)
        self.check = f"{cls.__module__}:{cls.__qualname__}"
        self.point = point
        self.error = exc
        super().__init__(f"check {self.check} raised at {point}: {type(exc).__name__}: {exc}")


class Check:
    """A check: hook into the points it needs (all do nothing here). ``kind`` is the failure
    kind it reports, its only name on the controller side, which renders every kind alike."""

    kind: str = ""

    @classmethod
    def wanted(cls, checks: Checks) -> bool:
        """Whether this scenario asks for it (e.g. ``run --no-inplace`` turns input_mutated off)."""
        return True

    def inputs_made(self, life: Life) -> None: ...

    def forward(self, life: Life) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_forward(self, life: Life) -> None: ...

    def before_backward(self, life: Life) -> None: ...

    def backward(self, life: Life) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_backward(self, life: Life) -> None: ...

    def result(self, life: Life) -> None: ...

    def after_step(self, life: Life) -> None: ...

    # the frame
    def begin(self, frame: Frame) -> None: ...

    def finish(self, frame: Frame) -> None: ...

    def claim(self, frame: Frame, exc: BaseException) -> bool:
        """Report ``exc`` as this check's own finding (True), or leave it (False: a rank_error)."""
        return False

    def abandon(self, frame: Frame, reason: str) -> None: ...

    def end(self, frame: Frame) -> None: ...


class Pipeline:
    """The checks of one scenario, called point by point in their listed order."""

    def __init__(self, checks: Sequence[Check]) -> None:
        self.checks = list(checks)

    def call(self, point: str, life: Life) -> None:
        for check in self.checks:
            if life.stopped:
                return
            with _owned_by(check, point):
                getattr(check, point)(life)

    def frame(self, point: str, frame: Frame, *args: Any) -> None:
        for check in self.checks:
            with _owned_by(check, point):
                getattr(check, point)(frame, *args)

    def claim(self, frame: Frame, exc: BaseException) -> bool:
        return any(check.claim(frame, exc) for check in self.checks)

    @contextlib.contextmanager
    def around(self, point: str, life: Life) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for check in self.checks:
                with _owned_by(check, point):  # entering is the check's; what runs inside is not
                    stack.enter_context(getattr(check, point)(life))
            yield


@contextlib.contextmanager
def _owned_by(check: Check, point: str) -> Iterator[None]:
    """What a check's hook raises is the check's (:class:`CheckRaised`), but a :class:`Stop`,
    which its check claims."""
    try:
        yield
    except (Stop, CheckRaised):
        raise
    except Exception as exc:  # noqa: BLE001  (whatever a plugin's check raises)
        raise CheckRaised(check, point, exc) from exc


class BadCheck(ValueError):
    """A registered check, or one ``SHARDCHECK_CHECKS`` names, that cannot be loaded or is no
    :class:`Check`: one line, said before any world starts (shardcheck/preflight.py)."""


def pipeline_for(flags: Checks, listed: Sequence[type[Check]] = ()) -> Pipeline:
    """The checks this scenario asks for: ``listed`` first (the built-ins, where a caller names
    them), then every registered check, then those ``SHARDCHECK_CHECKS`` adds; each once. A check
    that cannot be loaded here (the controller's preflight let it through: a run in process, a
    rank's other path) is an :class:`Unloadable` that fails the scenario as the harness's error."""
    try:
        found = [*listed, *registered_checks(), *extra_checks()]
    except Exception as exc:  # noqa: BLE001  (a plugin's import: whatever it raises)
        found = [*listed, unloadable(exc)]
    return Pipeline([cls() for cls in dict.fromkeys(found) if cls.wanted(flags)])


def registered_checks() -> tuple[type[Check], ...]:
    """Every check in the ``shardcheck.checks`` entry-point group: the built-ins first, in the
    order :data:`BUILT_IN` declares, then the others by name. BadCheck (one line) for one that
    cannot be loaded or is no Check, a name registered twice, or a built-in missing (shardcheck's
    own metadata older than its code: it must be reinstalled, never run without its checks)."""
    return _registered(tuple(sys.path))


def plugin_checks() -> tuple[type[Check], ...]:
    """The registered checks that are not shardcheck's own, loaded (BadCheck as above); the
    built-ins are only found registered, not imported (they import torch: a command line's
    preflight must not pay for it)."""

    return tuple(_load(ep) for ep in _entry_points(tuple(sys.path)) if ep.name not in BUILT_IN)


@functools.lru_cache(maxsize=4)
def _registered(path: tuple[str, ...]) -> tuple[type[Check], ...]:
    # once per process and search path: a rank calls it for every scenario
    return tuple(_load(ep) for ep in _entry_points(path))


def _entry_points(path: tuple[str, ...]) -> list[Any]:
    """The group's entry points in the order their checks are called (``path``: sys.path, what
    they are found on)."""
    from importlib.metadata import entry_points


    points: dict[str, Any] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in points and points[ep.name].value != ep.value:
            raise BadCheck(f"the check {ep.name!r} is registered twice in {GROUP} ({_origin(points[ep.name])} and "
                           f"{_origin(ep)}): uninstall one")
        points.setdefault(ep.name, ep)
    missing = [name for name in BUILT_IN if name not in points]
    if missing:
        raise BadCheck(f"shardcheck's own check(s) {', '.join(missing)} are not registered in {GROUP}: its install "
                       "is older than its code (pip install -e . again)")
    return [points[name] for name in [*BUILT_IN, *sorted(set(points) - set(BUILT_IN))]]


def _origin(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    return f"{ep.value} from {dist.name} {dist.version}" if dist is not None else ep.value


def _load(ep: Any) -> type[Check]:
    try:
        cls = ep.load()
    except Exception as exc:  # noqa: BLE001  (a plugin's import: whatever it raises)
        raise BadCheck(f"the check {ep.name!r} registered in {GROUP} ({_origin(ep)}) cannot be loaded: "
                       f"{type(exc).__name__}: {' '.join(str(exc).split())}") from None
    if not (isinstance(cls, type) and issubclass(cls, Check)):
        raise BadCheck(f"the check {ep.name!r} registered as {_origin(ep)} is not a shardcheck Check")
    return cls


def extra_checks(spec: str | None = None) -> list[type[Check]]:
    """The checks named in ``SHARDCHECK_CHECKS`` (``module:Class``, comma-separated), added
    after the registered ones (a check registered both ways runs once)."""
    spec = os.environ.get(EXTRA_ENV, "") if spec is None else spec
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        module, _, name = item.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except Exception as exc:  # noqa: BLE001  (the user's module: whatever its import raises)
            raise BadCheck(f"{EXTRA_ENV}={spec!r}: cannot import a check: {type(exc).__name__}: "
                           f"{' '.join(str(exc).split())}") from None
        if not (isinstance(cls, type) and issubclass(cls, Check)):
            raise BadCheck(f"{EXTRA_ENV}: {item!r} is not a shardcheck Check")
        out.append(cls)
    return out


def unloadable(exc: BaseException) -> type[Check]:
    """A stand-in for the checks that could not be loaded: it raises why at ``begin``, so the
    scenario is an error of the harness (exit 2) naming the check, not a rank that dies."""
    why = str(exc) if isinstance(exc, BadCheck) else f"{type(exc).__name__}: {' '.join(str(exc).split())}"

    class Unloadable(Check):
        kind = "harness_error"

        def begin(self, frame: Frame) -> None:
            raise BadCheck(why)

    Unloadable.__qualname__ = "Unloadable"  # named so in the verdict, not by where it was made
    return Unloadable
