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

A check is a :class:`Check` in a module of its own that implements the points it needs and adds
what it finds to ``life.found`` (``life.errors`` for the worst error per field); the rank's
core (``main.RankRunner``) calls every check at every point and knows nothing of what they look
for. The built-in checks are listed in one place (:mod:`shardcheck.harness.rank.checks`); a
plugin or a test adds its own by naming them in ``SHARDCHECK_CHECKS`` (``module:Class``,
comma-separated; every rank reads the controller's ``SHARDCHECK_*`` settings).

What frames the life is not a check: the collective trace and the lockstep check (``main.run``)
wrap all of it, the checks' own hooks included, so a collective issued anywhere is traced.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardcheck.harness.wire import Checks, Failure

EXTRA_ENV = "SHARDCHECK_CHECKS"
POINTS = ("inputs_made", "forward", "after_forward", "before_backward", "backward", "after_backward", "result")


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

    def stop(self) -> None:
        """Nothing more can be read or differentiated: the later points are not reached."""
        self.stopped = True

    def add(self, checked: tuple[list[Failure], dict[str, float]]) -> None:
        """A comparison's (failures, worst error per field)."""
        failures, worst = checked
        self.found += failures
        self.errors.update(worst)


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


class Pipeline:
    """The checks of one scenario, called point by point in their listed order."""

    def __init__(self, checks: Sequence[Check]) -> None:
        self.checks = list(checks)

    def call(self, point: str, life: Life) -> None:
        for check in self.checks:
            if life.stopped:
                return
            getattr(check, point)(life)

    @contextlib.contextmanager
    def around(self, point: str, life: Life) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for check in self.checks:
                stack.enter_context(getattr(check, point)(life))
            yield


def pipeline_for(flags: Checks, listed: Sequence[type[Check]]) -> Pipeline:
    """The listed checks and those ``SHARDCHECK_CHECKS`` adds that this scenario asks for."""
    return Pipeline([cls() for cls in [*listed, *extra_checks()] if cls.wanted(flags)])


def extra_checks(spec: str | None = None) -> list[type[Check]]:
    """The checks named in ``SHARDCHECK_CHECKS`` (``module:Class``, comma-separated)."""
    spec = os.environ.get(EXTRA_ENV, "") if spec is None else spec
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        module, _, name = item.partition(":")
        cls = getattr(importlib.import_module(module), name, None)
        if not (isinstance(cls, type) and issubclass(cls, Check)):
            raise ValueError(f"{EXTRA_ENV}: {item!r} is not a shardcheck Check")
        out.append(cls)
    return out
