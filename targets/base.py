"""The one interface between the harness and an implementation under test.

A target is an object with ``name``, ``capabilities``, ``describe()`` and ``compute(inputs)``.
The harness builds each rank's :class:`RankInputs` (slime's calling convention, made explicit),
calls ``compute`` on every rank, and differentiates the loss of the returned per-sample outputs.
A scenario outside a target's capabilities is reported as skipped with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from shardcheck.scenarios.scenario import DTYPES, LAYOUTS, Scenario


@dataclass(frozen=True)
class Capabilities:
    """What a target supports; ``reasons`` says why not ("entropy", "layout", "dtype" keys)."""

    layouts: frozenset[str] = frozenset(LAYOUTS)
    entropy: bool = True
    dtypes: frozenset[str] = frozenset(DTYPES)
    reasons: tuple[tuple[str, str], ...] = ()

    def skip_reason(self, scenario: Scenario) -> str | None:
        why = dict(self.reasons)
        if scenario.layout not in self.layouts:
            return why.get("layout") or (
                f"layout {scenario.layout} not supported (supports {', '.join(sorted(self.layouts))})")
        if scenario.with_entropy and not self.entropy:
            return why.get("entropy") or "entropy not supported"
        if scenario.dtype not in self.dtypes:
            return why.get("dtype") or (
                f"dtype {scenario.dtype} not supported (supports {', '.join(sorted(self.dtypes))})")
        return None


@dataclass
class RankInputs:
    """What one rank hands the implementation.

    ``logits`` is a leaf that requires grad: ``[1, T_local, V/tp]`` for thd, zigzag and
    allgather, ``[B, M, V/tp]`` for bshd. ``tokens`` holds every sample's full token ids.
    """

    logits: torch.Tensor
    tokens: list[torch.Tensor]
    total_lengths: list[int]
    response_lengths: list[int]
    layout: str
    with_entropy: bool
    entropy_coef: float
    temperature: float
    chunk_size: int
    max_seq_lens: list[int] | None
    tp_group: Any
    cp_group: Any
    tp_rank: int
    tp_size: int
    cp_rank: int
    cp_size: int
    # The harness's own layout for this rank (shardcheck.harness.layout.RankLayout). Adapters of
    # code that does only part of the job may use it; an implementation under test must not.
    rank_layout: Any = None

    @property
    def allgather_cp(self) -> bool:
        return self.layout == "allgather"

    @property
    def qkv_format(self) -> str:
        return "bshd" if self.layout == "bshd" else "thd"


@dataclass
class RankOutputs:
    """Per sample, this rank's share of the response log-probs (and entropy), 1-D each."""

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor | None] | None = None
    notes: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Target(Protocol):
    name: str
    capabilities: Capabilities

    def describe(self) -> dict[str, Any]:
        """Name, version and anything else a report should carry."""
        ...

    def compute(self, inputs: RankInputs) -> RankOutputs: ...
