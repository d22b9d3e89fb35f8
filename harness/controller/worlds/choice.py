"""The world a command runs its scenarios on: what every world offers (:class:`World`), and the
one place a command gets one (:func:`world_for`).

Three worlds meet the protocol: :class:`~shardcheck.harness.controller.worlds.spawned.SpawnedWorld` (ranks
started here, gloo or nccl), :class:`~shardcheck.harness.controller.worlds.joined.JoinedWorld` (this
process is one rank of a world torchrun started) and
:class:`~shardcheck.harness.controller.worlds.simulated.FakeWorld` (``simulate``: every rank in turn on torch's
fake process group). Whatever drives one (runner, invariance, fuzz, the pytest plugin) asks only
for what is here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from shardcheck.harness.wire import Checks, RankResult


@runtime_checkable
class World(Protocol):
    nproc: int
    backend: str
    lockstep: bool
    events: list[str]  # restarts and the like, for the report
    startup_seconds: list[float]
    progress: Any  # called with what a start is doing, when set

    def start(self) -> None:
        """Bring the ranks up."""
        ...

    def ensure_ready(self) -> None:
        """Start, or restart after a failure left the ranks unusable."""
        ...

    def run(self, scenario: dict[str, Any], target: str, checks: Checks = Checks()) -> list[RankResult]:
        """One scenario on every rank, with the run configuration in effect
        (:func:`shardcheck.run_config.in_effect`; its ranks get it with the scenario): a result
        per rank, whatever happened."""
        ...

    def close(self) -> None:
        """End the ranks and release what the world holds; idempotent."""
        ...


@dataclass(frozen=True)
class Chosen:
    """A command's world, why it has its backend, and whether the command must close it."""

    world: World
    why: str
    owned: bool


def world_for(size: int, *, given: World | None = None, join: bool = False, backend: str = "auto",
              timeout: float = 60.0, lockstep: bool = True) -> Chosen:
    """The world for a command: ``given`` as it is; with ``join``, the launcher's (torchrun's)
    world this process is a rank of; else ``size`` ranks started here on the chosen backend
    (BadInput, one line, for nccl that cannot be had). Nothing starts until the world is used."""
    if given is not None:
        return Chosen(given, "the given world's", False)
    if join:
        from shardcheck.harness.controller.worlds.joined import JoinedWorld

        return Chosen(JoinedWorld(timeout=timeout, lockstep=lockstep, backend=backend), "the launcher's world", True)
    from shardcheck.backend import choose_backend
    from shardcheck.harness.controller.worlds.spawned import SpawnedWorld

    chosen, why = choose_backend(backend, size)
    return Chosen(SpawnedWorld(size, timeout=timeout, lockstep=lockstep, backend=chosen), why, True)
