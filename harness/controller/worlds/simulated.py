"""A simulated world: every scenario's ranks run in turn in one child process on torch's fake
process group (``harness/rank/plumbing/simulated_ranks.py``), so a layout of hundreds of ranks is checked for
would-be hangs on a machine that holds four.

It offers what ``runner.run`` and ``fuzz.fuzz`` need of a world (the interface of
:class:`~shardcheck.harness.controller.worlds.spawned.SpawnedWorld`), so ``shardcheck simulate`` is ``run`` and the
fuzzer's search, on this world instead of a real one. Values are not checked: a fake collective
moves no data.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from shardcheck.errors import WorldError
from shardcheck.harness import wire
from shardcheck.harness.controller.worlds.cpu_wait import CpuWait
from shardcheck.harness.wire import RANK_ERROR, TIMEOUT, Checks, Failure, RankResult

BACKEND = "fake"
NOTE = "simulated: collectives checked for symmetry on torch's fake process group; values are not checked"


# Ranks a simulation process gets at least: a layout of 4 ranks or more is split between the
# processes. Small layouts as benchmarks/simulate_speed.py draws them, at 08741f3, in one process
# against two: world 8 1,209 against 1,811 a minute, world 4 1,372 against 1,739 (the split began
# at 32 ranks before).
RANKS_A_PROCESS = 2


class FakeWorld:
    """Simulated worlds of any ``tp * cp`` dividing ``nproc`` (each scenario runs on exactly its
    ``tp * cp`` ranks), in child processes started once and reused: one per usable core (at
    most ``workers``), a layout's ranks split between them (RANKS_A_PROCESS)."""

    lockstep = True  # the trace comparison stands in for it
    backend = BACKEND

    def __init__(self, sizes: Sequence[int], timeout: float = 60.0, workers: int | None = None,
                 share_rank_lists: bool = True, start_timeout: float = 180.0) -> None:
        from shardcheck.harness.controller.worlds.machine import usable_cores

        self.nproc = math.lcm(*sizes) if sizes else 1
        self.timeout = timeout
        self.start_timeout = start_timeout  # a simulation process's imports, before any scenario's deadline
        self.workers = max(1, workers if workers is not None else usable_cores())
        # megatron's rank lists computed once per layout, each simulated rank creating only its own
        # groups (groups.share_rank_lists); False: every rank builds all of them (the benchmark's baseline)
        self.share_rank_lists = share_rank_lists
        self.startup_seconds: list[float] = []
        self.events: list[str] = []
        self.progress: Callable[[int], None] | None = None
        self._children: list[tuple[Any, Any]] = []  # (process, connection)
        self._cpu_wait = CpuWait()  # whose a missed deadline is: the target's, or the busy machine's
        self._seq = 0

    @property
    def started(self) -> bool:
        return bool(self._children)

    def start(self) -> None:
        t0 = time.perf_counter()
        ctx = _context()
        for i in range(self.workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_child, args=(child,), daemon=True, name=f"shardcheck-fake-world-{i}")
            proc.start()
            child.close()
            self._children.append((proc, parent))
        # each has imported what a simulated rank needs before a deadline of a scenario runs
        for proc, conn in self._children:
            left = t0 + self.start_timeout - time.perf_counter()
            try:
                ready = conn.poll(max(0.0, left)) and conn.recv()[0] == "ready"
            except (EOFError, OSError):
                ready = False
            if not ready:
                codes = [p.exitcode for p, _ in self._children]
                self.close()
                raise WorldError(f"a simulation process did not start within {self.start_timeout:g}s "
                                 f"(exit codes {codes})")
        self.startup_seconds.append(time.perf_counter() - t0)

    def ensure_ready(self) -> None:
        dead = [p for p, _ in self._children if not p.is_alive()]
        if dead:
            self.events.append(f"a simulation process died between scenarios (exit code {dead[0].exitcode}); "
                               "they restarted")
            self.close()
        if not self._children:
            self.start()

    def run(self, scenario: dict[str, Any], target: str, checks: Checks = Checks()) -> list[RankResult]:
        from shardcheck.harness.rank.plumbing.simulated_ranks import judge

        self.ensure_ready()
        self._seq += 1
        world = int(scenario.get("dp", 1)) * int(scenario["tp"]) * int(scenario.get("cp", 1)) * int(scenario.get("sp", 1))  # a copy: dp x tp x cp x sp
        used = self._children[:max(1, min(len(self._children), world // RANKS_A_PROCESS))]
        share = -(-world // len(used))
        results, labels = [], {}
        try:
            for i, (_, conn) in enumerate(used):
                conn.send(wire.message(wire.RUN, scenario=scenario, target=target, seq=self._seq,
                                       checks=checks.to_wire(), settings=wire.target_settings(),
                                       ranks=list(range(i * share, min(world, (i + 1) * share))),
                                       share_rank_lists=self.share_rank_lists))
            for proc, conn in used:
                # each simulated rank has the timeout to itself: the deadline follows progress
                deadline, current = time.perf_counter() + self.timeout, None
                self._cpu_wait.sample([proc.pid])  # the window's start: a busy controller polls seldom
                while True:
                    left = deadline - time.perf_counter()
                    if left <= 0 or not conn.poll(min(left, 1.0)):
                        self._cpu_wait.sample([proc.pid])
                        if left > 0:
                            continue
                        starved, busy = self._cpu_wait.judge(proc.pid, self.timeout)
                        self.close(politely=False)  # it never answered: end it, as a hung rank is ended
                        who = f"simulated rank {current}" if current is not None else "the simulated ranks"
                        if starved:
                            return self._everyone(world, f"{who} gave no result within {self.timeout:g}s; {starved}",
                                                  kind=TIMEOUT)
                        return self._everyone(world, f"{who} gave no result within {self.timeout:g}s "
                                                     "(a target that never returns)" + (f"; {busy}" if busy else ""))
                    kind, payload = conn.recv()
                    if kind != "starting":
                        break
                    deadline, current = time.perf_counter() + self.timeout, payload
                    self._cpu_wait.sample([proc.pid])
                if kind != "results":
                    self.close()
                    return self._everyone(world, f"the simulation failed: {payload.get('type')}: "
                                                 f"{payload.get('message')}")
                for result, rank_labels in payload:
                    results.append(RankResult.from_wire(result))
                    labels[results[-1].rank] = rank_labels
        except (EOFError, OSError):
            codes = [p.exitcode for p, _ in self._children]
            self.close()
            return self._everyone(world, f"a simulation process died (exit codes {codes})")
        return judge(results, labels, checks.trace_calls)

    def _everyone(self, world: int, message: str, kind: str = RANK_ERROR) -> list[RankResult]:
        failure = Failure(kind, message, list(range(world)))
        return [RankResult(r, self._seq, [failure] if r == 0 else [], {}, 0.0, {}, [], False) for r in range(world)]

    def close(self, politely: bool = True) -> None:
        """End the simulation processes: asked to stop, killed after 2 s; or, not ``politely``
        (one never answered: it will not read the request), killed at once."""
        for _, conn in self._children:
            try:
                conn.send(wire.message(wire.STOP))
            except (OSError, ValueError):
                pass
        for proc, conn in self._children:
            proc.join(timeout=2.0 if politely else 0.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
            conn.close()
        self._children = []

    def rank_output(self) -> list:
        return []

    def __enter__(self) -> FakeWorld:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _child(conn: Any) -> None:
    from shardcheck.harness.rank.plumbing import simulated_ranks as fake_world
    from shardcheck.harness.wire import die_with_parent

    die_with_parent()
    fake_world.serve(conn)


def _context() -> Any:
    """Forked from the rank processes' server where there is one (torch and megatron-core are
    imported there already), else spawned."""
    from shardcheck.harness.controller.worlds.spawned import _start_context

    return _start_context("gloo", dict(os.environ), True)
