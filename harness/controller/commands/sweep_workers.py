"""``shardcheck sweep --jobs N``: N worker processes, each with a world of its own, and one channel
to each (pytest-xdist's shape: the controller hands out commits, a worker answers each with its
cells). The controller alone reads and writes the cache.

The channel is the worker's stdin and stdout, one JSON object a line: first the set-up
(repository, scenarios, run configuration, scratch folder, timeout), then ``{"sha", "names"}``
per commit; the worker answers ``{"sha", "cells"}``. End of input: the worker closes its world and
exits. Ctrl-C reaches the workers too (one process group); the controller then closes their input
and waits for each, bounded, before it kills what is left.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardcheck.harness.controller.commands.commit_check import CommitCheck, Lazy, scenario_key
from shardcheck.harness.controller.reports.sweep_timeline import CANNOT_RUN, Cell, Commit, SweepResult
from shardcheck.scenarios.scenario import Scenario

EXIT_WAIT_S = 30.0  # a worker's world closing after its input ends (or after Ctrl-C)


def parallel_sweep(repo: Path, commits: Sequence[Commit], scenarios: Sequence[Scenario], config: Any, cache: Any,
                   scratch: Path, *, jobs: int, timeout: float,
                   progress: Callable[[int, Commit, dict[str, Cell], int], None]) -> SweepResult:
    keys = {sc.name: scenario_key(sc) for sc in scenarios}
    result = SweepResult(list(commits), [sc.name for sc in scenarios], {})
    order = {c.sha: i for i, c in enumerate(commits)}
    todo: list[tuple[Commit, dict[str, Cell], list[str]]] = []
    for commit in commits:  # what the cache holds first, in order
        cells, names = cache.held(commit.sha, keys)
        if names:
            todo.append((commit, cells, names))
        else:
            result.cells[commit.sha] = cells
            progress(order[commit.sha], commit, cells, 0)
    if not todo:
        return result
    setup = {"repo": str(repo), "scenarios": [sc.to_dict() for sc in scenarios], "config": config.to_wire(),
             "scratch": str(scratch), "timeout": timeout}
    answers: queue.Queue = queue.Queue()
    workers = [_Worker(i, setup, answers) for i in range(min(jobs, len(todo)))]
    pending = {c.sha: (c, cells, names) for c, cells, names in todo}
    waiting = list(todo)
    try:
        for w in workers:
            if waiting:
                w.send(*_job(waiting.pop(0)))
        while pending:
            worker_id, sha, fresh = answers.get()
            commit, cells, names = pending.pop(sha) if sha in pending else (None, None, None)
            if commit is None:  # a worker died: what it held cannot be said
                w = workers[worker_id]
                for lost in [s for s in list(pending) if w.holding == s]:
                    commit, cells, names = pending.pop(lost)
                    fresh = {n: Cell(CANNOT_RUN, why=f"the sweep's worker {worker_id} exited") for n in names}
                    result.cells[lost] = cells | fresh
                    progress(order[lost], commit, result.cells[lost], len(names))
                if waiting:
                    workers[worker_id] = w = _Worker(worker_id, setup, answers)
                    w.send(*_job(waiting.pop(0)))
                continue
            result.cells[sha] = cells | cache.keep(sha, keys, {n: Cell.from_dict(d) for n, d in fresh.items()}, names)
            result.ran += len(names)
            progress(order[sha], commit, result.cells[sha], len(names))
            if waiting:
                workers[worker_id].send(*_job(waiting.pop(0)))
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        for w in workers:
            w.close()
    result.commits = [c for c in commits if c.sha in result.cells]
    return result


def _job(item: tuple[Commit, dict[str, Cell], list[str]]) -> tuple[str, list[str]]:
    return item[0].sha, item[2]


class _Worker:
    """One worker process and the thread reading its answers into the controller's queue."""

    def __init__(self, worker_id: int, setup: dict[str, Any], answers: queue.Queue) -> None:
        self.id, self.answers, self.holding = worker_id, answers, None
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(setup) + "\n")
        self.proc.stdin.flush()
        threading.Thread(target=self._read, daemon=True).start()

    def send(self, sha: str, names: list[str]) -> None:
        self.holding = sha
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"sha": sha, "names": names}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.answers.put((self.id, None, None))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            self.holding = None
            self.answers.put((self.id, msg["sha"], msg["cells"]))
        self.answers.put((self.id, None, None))  # the worker is gone

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=EXIT_WAIT_S)


def main() -> int:
    """A worker: the set-up line, then one commit a line until the input ends."""
    from shardcheck.harness.controller.commands.runner import world_size_for
    from shardcheck.harness.controller.worlds.spawned import SpawnedWorld
    from shardcheck.run_config import RunConfig, in_effect

    import os

    # the channel is the stdout this process was given; anything else printing (the world, the
    # ranks it starts, a framework's import) goes to stderr
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    setup = json.loads(sys.stdin.readline())
    scenarios = [Scenario.from_dict(d) for d in setup["scenarios"]]
    config = RunConfig.from_wire(setup["config"])
    try:
        with in_effect(config), contextlib.ExitStack() as stack:
            world = Lazy(lambda: stack.enter_context(SpawnedWorld(world_size_for(scenarios),
                                                                  timeout=setup["timeout"])))
            check = CommitCheck(Path(setup["repo"]), scenarios, config, world, Path(setup["scratch"]),
                                setup["timeout"])
            for line in sys.stdin:
                job = json.loads(line)
                cells = check(job["sha"], job["names"])
                channel.write(json.dumps({"sha": job["sha"], "cells": {n: c.to_dict() for n, c in cells.items()}})
                              + "\n")
                channel.flush()
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
