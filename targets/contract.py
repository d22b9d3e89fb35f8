"""Targets written against an earlier Target contract, adopted: they run unchanged.

A target that derives from :class:`~shardcheck.targets.base.TargetBase` has every member the
harness reads. A plugin written before a member existed (``release()`` came with contract 4,
``definitions`` with 3, ``data_path`` with 2: ``CONTRACT_HISTORY``), or outside TargetBase, does not; :func:`adopt` wraps
it in an :class:`AdoptedTarget` that answers each member from the plugin where it has it and
from TargetBase's default where not. This module is the one place that asks a target object
what it has; everything else reads the contract's members.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from shardcheck.targets.base import (CONTRACT_HISTORY, CONTRACT_VERSION, OPTIONAL_MEMBERS, REQUIRED_MEMBERS,
                                     Capabilities, DataPath, Definitions, RankInputs, RankOutputs, Scenario, StepSizes,
                                     Target, TargetBase)

REQUIRED = REQUIRED_MEMBERS
_SAID: set[str] = set()
# what a notice names first: what changes most what a run does
_NAMED_FIRST = ("release", "definitions", "data_path", "repro_call")


def is_target(obj: Any) -> bool:
    """Whether ``obj`` is a target object (not a class or factory): it has the required members."""
    if isinstance(obj, type) or not all(hasattr(obj, member) for member in REQUIRED):
        return False
    return callable(obj.describe) and callable(obj.compute)


class AdoptedTarget(TargetBase):
    """A plugin target that does not derive from TargetBase, with TargetBase's defaults for what
    it lacks. Its code under test is the plugin's (:meth:`implementation`)."""

    def __init__(self, plugin: Any, spec: str) -> None:
        self.plugin = plugin
        self.spec = spec
        self.has = frozenset(m for m in OPTIONAL_MEMBERS if hasattr(plugin, m))
        # what it lacks of what came after the first contract (loss_form and invariance were
        # optional from the start: lacking them is no sign of age)
        self.lacks = tuple(m for m in OPTIONAL_MEMBERS if m not in self.has and m not in CONTRACT_HISTORY[1][1])
        self.contract = 0  # an earlier contract: a plugin outside TargetBase declares none

    def _own(self, member: str, default: Any) -> Any:
        return getattr(self.plugin, member) if member in self.has else default

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.plugin.name

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return self.plugin.capabilities

    @property
    def loss_form(self) -> str:  # type: ignore[override]
        return self._own("loss_form", TargetBase.loss_form)

    @property
    def invariance(self) -> Any:  # type: ignore[override]
        return self._own("invariance", TargetBase.invariance) or TargetBase.invariance

    @property
    def definitions(self) -> Definitions:  # type: ignore[override]
        return self._own("definitions", TargetBase.definitions) or TargetBase.definitions

    @property
    def data_path(self) -> DataPath | None:  # type: ignore[override]
        return self._own("data_path", None)

    @property
    def training_loss(self) -> bool:  # type: ignore[override]
        return bool(self._own("training_loss", False))

    @property
    def calculate_per_token_loss(self) -> bool | None:  # type: ignore[override]
        return self._own("calculate_per_token_loss", None)

    @property
    def src(self) -> Any:  # type: ignore[override]
        return self._own("src", None)

    @property
    def framework_files(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self._own("framework_files", ()) or ())

    def describe(self) -> dict[str, Any]:
        out = dict(self.plugin.describe())
        if self.lacks:
            out["contract_notice"] = notice(self.spec, self)
        return out

    def compute(self, inputs: RankInputs) -> RankOutputs:
        return self.plugin.compute(inputs)

    def release(self) -> None:
        if "release" in self.has:
            self.plugin.release()

    def repro_call(self) -> str | None:
        return self.plugin.repro_call() if "repro_call" in self.has else None

    def split_batch(self, scenario: Scenario) -> list[list[tuple[int, ...]]] | None:
        return self.plugin.split_batch(scenario) if "split_batch" in self.has else None

    def logged_loss(self, reported: list[dict[str, Any]], sizes: StepSizes) -> Any:
        return self.plugin.logged_loss(reported, sizes) if "logged_loss" in self.has else None

    def backward_context(self) -> AbstractContextManager[Any]:
        return self.plugin.backward_context() if "backward_context" in self.has else nullcontext()

    def declares(self, member: str) -> bool:
        if member not in OPTIONAL_MEMBERS:
            raise ValueError(f"{member!r} is not an optional member of the Target contract")
        return member in self.has

    def implementation(self) -> Any:
        return self.plugin


def notice(spec: str, adopted: AdoptedTarget) -> str:
    """One line: which contract the plugin was written against, and what runs as the default."""
    first = sorted(adopted.lacks, key=lambda m: (m not in _NAMED_FIRST, _NAMED_FIRST.index(m) if m in _NAMED_FIRST else 0))
    named = ", ".join(f"{m}()" if callable(getattr(TargetBase, m)) else m for m in first[:3])
    more = f" and {len(first) - 3} more" if len(first) > 3 else ""
    return (f"target {spec!r} is written against an earlier Target contract (now {CONTRACT_VERSION}): it runs, "
            f"with TargetBase's defaults for {named}{more}; derive it from shardcheck.targets.TargetBase "
            "(docs/targets.md, \"The contract\")")


def adopt(obj: Any, spec: str) -> Target:
    """``obj`` as a target with every member of the contract: itself where it derives from
    TargetBase, else an :class:`AdoptedTarget` (one FutureWarning a spec and process, the same
    line the run's header carries)."""
    if isinstance(obj, TargetBase):
        return obj
    adopted = AdoptedTarget(obj, spec)
    if adopted.lacks and spec not in _SAID:
        _SAID.add(spec)
        warnings.warn(notice(spec, adopted), FutureWarning, stacklevel=3)
    return adopted
