"""A simulated world: every scenario's ranks run in turn in one child process on torch's fake
process group (``harness/rank/fake_world.py``), so a layout of hundreds of ranks is checked for
would-be hangs on a machine that holds four.

It offers what ``runner.run`` and ``fuzz.fuzz`` need of a world (the interface of
:class:`~shardcheck.harness.controller.world.World`), so ``shardcheck simulate`` is ``run`` and the
fuzzer's search, on this world instead of a real one. Values are not checked: a fake collective
moves no data.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from shardcheck.harness import wire
from shardcheck.harness.wire import RANK_ERROR, Checks, Failure, RankResult

BACKEND = "fake"
NOTE = "simulated: collectives checked for symmetry on torch's fake process group; values are not checked"


class FakeWorld:
    """Simulated worlds of any ``tp * cp`` dividing ``nproc`` (each scenario runs on exactly its
    ``tp * cp`` ranks), in one child process started once and reused."""

    lockstep = True  # the trace comparison stands in for it
    backend = BACKEND

    def __init__(self, sizes: Sequence[int], timeout: float = 60.0) -> None:
        self.nproc = math.lcm(*sizes) if sizes else 1
        self.timeout = timeout
        self.startup_seconds: list[float] = []
        self.events: list[str] = []
        self.progress: Callable[[int], None] | None = None
        self._proc: Any = None
        self._conn: Any = None
        self._seq = 0

    @property
    def started(self) -> bool:
        return self._proc is not None

    def start(self) -> None:
        t0 = time.perf_counter()
        ctx = _context()
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child,), daemon=True, name="shardcheck-fake-world")
        self._proc.start()
        child.close()
        self._conn = parent
        self.startup_seconds.append(time.perf_counter() - t0)

    def ensure_ready(self) -> None:
        if self._proc is not None and not self._proc.is_alive():
            self.events.append(f"the simulation process died between scenarios (exit code {self._proc.exitcode}); "
                               "it restarted")
            self.close()
        if self._proc is None:
            self.start()

    def run(self, scenario: dict[str, Any], target: str, checks: Checks = Checks()) -> list[RankResult]:
        self.ensure_ready()
        self._seq += 1
        world = int(scenario["tp"]) * int(scenario.get("cp", 1))
        try:
            self._conn.send(wire.message(wire.RUN, scenario=scenario, target=target, seq=self._seq,
                                         checks=checks.to_wire(), settings=wire.target_settings()))
            if self._conn.poll(self.timeout):
                kind, payload = self._conn.recv()
                if kind == "results":
                    return [RankResult.from_wire(r) for r in payload]
                return self._everyone(world, f"the simulation failed: {payload.get('type')}: {payload.get('message')}")
        except (EOFError, OSError):
            code = self._proc.exitcode if self._proc is not None else None
            self.close()
            return self._everyone(world, f"the simulation process died (exit code {code})")
        self.close()  # it never answered: end it, as a hung rank is ended
        return self._everyone(world, f"the simulated ranks gave no result within {self.timeout:g}s "
                                     "(a target that never returns)")

    def _everyone(self, world: int, message: str) -> list[RankResult]:
        failure = Failure(RANK_ERROR, message, list(range(world)))
        return [RankResult(r, self._seq, [failure] if r == 0 else [], {}, 0.0, {}, [], False) for r in range(world)]

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(wire.message(wire.STOP))
            except (OSError, ValueError):
                pass
        if self._proc is not None:
            self._proc.join(timeout=2.0)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5.0)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def rank_output(self) -> list:
        return []

    def __enter__(self) -> FakeWorld:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _child(conn: Any) -> None:
    from shardcheck.harness.rank import fake_world
    from shardcheck.harness.rank.main import _die_with_parent

    _die_with_parent()
    fake_world.serve(conn)


def _context() -> Any:
    """Forked from the rank processes' server where there is one (torch and megatron-core are
    imported there already), else spawned."""
    from shardcheck.harness.controller.world import _start_context

    return _start_context("gloo", dict(os.environ), True)
